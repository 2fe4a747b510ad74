"""Multi-process secure runs from node configs, on loopback: correctness, faults, config checks, TLS.

Every party is a real process linked over brpc on 127.0.0.1 (ports picked free at test time).
The job is a tiny secure generation (llama-tiny cut to 2 layers, 32-token prompt, 2 greedy
tokens, `mpcache` with small clusters), so each run takes seconds.
"""
from __future__ import annotations

import copy
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mpcache_jax.distributed import (JobFailed, JobSpec, NodeConfigError, load_node_config,
                                     parse_node_config, run_loopback)
from mpcache_jax.distributed import job as job_lib
from mpcache_jax.distributed.compare import simulate
from mpcache_jax.distributed.launch import prepare_config, start_parties, wait_parties

REPO = pathlib.Path(__file__).resolve().parent.parent
NODES = REPO / "experiments" / "nodes"
TINY_JOB = {"model": "llama-tiny", "num_layers": 2, "policy": "mpcache", "budget": 0.5,
            "policy_options": {"static_sinks": 4, "static_recent": 8,
                               "levels": [[8, 0.5], [4, None]]},
            "seq_len": 32, "max_new_tokens": 2, "reveal_logits": True, "timeout_s": 240}


def node_config(parties: int, protocol: str, **link) -> dict:
    ids = [f"node:{i}" for i in range(parties)]
    return {
        "id": f"test.{parties}pc",
        "nodes": {pid: f"127.0.0.1:{61400 + i}" for i, pid in enumerate(ids)},
        "devices": {
            "SPU": {"kind": "SPU", "config": {
                "node_ids": ids,
                "runtime_config": {"protocol": protocol, "field": "FM64"},
                "link": {"peer_timeout_s": 10, "recv_timeout_s": 180,
                         "connect_retry_times": 60, "connect_retry_interval_ms": 500,
                         "http_timeout_ms": 5000, **link}}},
            "MODEL_OWNER": {"kind": "PYU", "config": {"node_id": "node:0"}},
            "PROMPT_OWNER": {"kind": "PYU", "config": {"node_id": "node:1"}},
        },
        "job": dict(TINY_JOB),
    }


def write(tmp_path: pathlib.Path, raw: dict, name: str = "nodes.json") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def reference(raw_job: dict):
    """The job under XLA with the same session loop -> (tokens, logits per step)."""
    job = JobSpec(**raw_job)
    prompt_ids, _ = job_lib.load_prompt(job)
    result = job_lib.plaintext_session(job, prompt_ids)
    return np.asarray(result.tokens), np.stack(result.logits)


def spu_sim_reference(path: pathlib.Path):
    """The same job under the in-process simulator (spu_sim backend, same session loop)."""
    [summary] = simulate(str(path), profile=False)
    return np.asarray(summary["tokens"]), np.stack(summary["logits"])


# ----- secure runs match the simulator and plaintext ---------------------------------------

@pytest.mark.parametrize("parties,protocol", [(3, "ABY3"), (2, "SEMI2K")])
def test_multiprocess_generation_matches_spu_sim_and_plaintext(tmp_path, parties, protocol):
    """16 tokens, one prefill and 15 decode programs per party with the KV cache resident in
    each party's runtime between steps; tokens equal spu_sim's and plaintext's."""
    raw = node_config(parties, protocol)
    raw["job"]["max_new_tokens"] = 16
    path = write(tmp_path, raw)
    records = run_loopback(path, tmp_path / "out", use_free_ports=True)
    out = np.load(tmp_path / "out" / "outputs.npz")
    sim_tokens, sim_logits = spu_sim_reference(path)
    xla_tokens, xla_logits = reference(raw["job"])
    assert len(out["tokens"]) == 16
    # Fixed point (18 fraction bits) vs float32: logits agree to ~1e-2 on this tiny model.
    np.testing.assert_array_equal(out["tokens"], sim_tokens)
    np.testing.assert_array_equal(out["tokens"], xla_tokens)
    np.testing.assert_allclose(out["logits"], sim_logits, atol=2e-2)
    np.testing.assert_allclose(out["logits"], xla_logits, atol=5e-2)
    *steps, summary = records
    assert summary["tokens"] == xla_tokens.tolist()
    assert [s["phase"] for s in steps] == ["prefill"] + ["decode"] * 15
    assert [s["position"] for s in steps[1:]] == list(range(32, 47))
    for record in steps:
        assert record["protocol"] == protocol and record["parties"] == parties
        # comm_bytes is the measured sum of every party's own sent bytes (= received).
        assert len(record["party_send_bytes"]) == parties
        assert record["comm_bytes"] == sum(record["party_send_bytes"]) > 0
        assert record["comm_bytes"] == sum(record["party_recv_bytes"])
        for key in ("wall_s", "compute_s", "lan_latency_s", "wan_latency_s", "phase_breakdown"):
            assert key in record
    # Every decode step runs the same program (to within the link's framing bytes).
    decode = [s["comm_bytes"] for s in steps[1:]]
    assert max(decode) - min(decode) < 1e-3 * min(decode)


# ----- faults -----------------------------------------------------------------------------

def _wait_for(path: pathlib.Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_dead_or_hung_party_makes_the_others_fail_naming_it(tmp_path, fault):
    peer_timeout = 3
    raw = node_config(3, "ABY3", peer_timeout_s=peer_timeout)
    config, path = prepare_config(write(tmp_path, raw), tmp_path / "out", use_free_ports=True)
    procs = start_parties(config, path, tmp_path / "out")
    victim = procs["node:2"]
    try:
        _wait_for(tmp_path / "out" / "party_node_2.log", "link up", timeout=180)
        os.killpg(victim.pid, fault)  # the party: its supervisor and worker
        faulted = time.monotonic()
        others = [procs["node:0"], procs["node:1"]]
        for p in others:
            p.wait(timeout=peer_timeout + 15)
        elapsed = time.monotonic() - faulted
        assert all(p.returncode == 3 for p in others), [p.returncode for p in others]
        for pid in ("node:0", "node:1"):
            text = (tmp_path / "out" / f"party_{pid.replace(':', '_')}.log").read_text()
            error = [l for l in text.splitlines() if "] error: " in l][-1]
            assert "party node:2 " in error, error
        assert elapsed < peer_timeout + 15
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # also stopped or orphaned workers
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


def test_launcher_reports_the_failed_party_and_tears_everything_down(tmp_path):
    """A party that cannot start (bad prompt ids only it checks) fails the whole job."""
    raw = node_config(2, "SEMI2K", peer_timeout_s=3, recv_timeout_s=30)
    raw["job"]["prompt_ids"] = [999] * 32  # outside the vocabulary: the prompt owner fails
    with pytest.raises(JobFailed) as info:
        run_loopback(write(tmp_path, raw), tmp_path / "out", use_free_ports=True)
    assert info.value.party == "node:1"
    assert "prompt_ids must lie in [0, 256)" in str(info.value)
    assert set(info.value.exit_codes) == {"node:0", "node:1"}
    assert info.value.exit_codes["node:1"] == 1 and info.value.exit_codes["node:0"] != 0
    assert not (tmp_path / "out" / "results.jsonl").exists()


# ----- malformed configs: rejected before anything starts ----------------------------------

def _break(mutate):
    raw = node_config(3, "ABY3")
    mutate(raw)
    return raw


def _spu(raw):
    return raw["devices"]["SPU"]["config"]


CASES = {
    "duplicate port": (lambda r: r["nodes"].update({"node:2": r["nodes"]["node:0"]}),
                       "both use port 61400"),
    "unknown party in node_ids": (lambda r: _spu(r)["node_ids"].__setitem__(2, "node:9"),
                                  "names unknown party 'node:9'"),
    "protocol/party count": (lambda r: _spu(r)["runtime_config"].update(protocol="CHEETAH"),
                             "CHEETAH runs with 2 parties, got 3"),
    "missing model owner": (lambda r: r["devices"].pop("MODEL_OWNER"),
                            "devices.MODEL_OWNER is missing"),
    "missing prompt owner": (lambda r: r["devices"].pop("PROMPT_OWNER"),
                             "devices.PROMPT_OWNER is missing"),
    "owner not a party": (lambda r: r["devices"]["PROMPT_OWNER"]["config"].update(node_id="node:7"),
                          "PROMPT_OWNER.config.node_id='node:7' is not an SPU party"),
    "same owner": (lambda r: r["devices"]["PROMPT_OWNER"]["config"].update(node_id="node:0"),
                   "would see both the weights and the prompt"),
    "bad address": (lambda r: r["nodes"].update({"node:1": "127.0.0.1"}), "is not host:port"),
    "unknown protocol": (lambda r: _spu(r)["runtime_config"].update(protocol="ABY4"),
                         "protocol='ABY4' is unknown"),
    "unknown link option": (lambda r: _spu(r)["link"].update(recv_timeout=3),
                            "link has unknown option(s) ['recv_timeout']"),
    "non-positive timeout": (lambda r: _spu(r)["link"].update(peer_timeout_s=0),
                             "link.peer_timeout_s=0 must be > 0 seconds"),
    "missing TLS file": (lambda r: _spu(r)["link"].update(tls={
        "ca": "nope/ca.crt", "certs": {p: {"cert": "a.crt", "key": "a.key"} for p in r["nodes"]}}),
        "link.tls.certs['node:0'].cert='a.crt' does not exist"),
    "TLS cert for unknown party": (lambda r: _spu(r)["link"].update(tls={
        "ca": "ca.crt", "certs": {"node:5": {"cert": "a.crt", "key": "a.key"}}}),
        "link.tls.certs names unknown part(y/ies) ['node:5']"),
    "unknown policy": (lambda r: r["job"].update(policy="magic"), "job.policy='magic' is unknown"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_config_is_rejected_with_what_to_fix(case):
    mutate, message = CASES[case]
    with pytest.raises(NodeConfigError) as info:
        parse_node_config(_break(mutate))
    assert message in str(info.value)


def test_party_cli_rejects_a_bad_config_before_starting(tmp_path):
    raw = _break(lambda r: r["devices"].pop("PROMPT_OWNER"))
    result = subprocess.run([sys.executable, "-m", "experiments.party",
                             f"--node_config={write(tmp_path, raw)}", "--party=all",
                             f"--output_dir={tmp_path / 'out'}"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "devices.PROMPT_OWNER is missing" in result.stderr
    assert not list((tmp_path / "out").glob("party_*.log")) if (tmp_path / "out").exists() else True


def test_unknown_party_on_the_command_line_is_rejected(tmp_path):
    path = write(tmp_path, node_config(2, "SEMI2K"))
    with pytest.raises(NodeConfigError, match=r"--party='node:5' is not one of the SPU parties"):
        load_node_config(path, party="node:5")


def test_loopback_launcher_refuses_remote_hosts(tmp_path):
    raw = node_config(2, "SEMI2K")
    raw["nodes"]["node:1"] = "10.0.0.2:61401"
    with pytest.raises(NodeConfigError, match="not a loopback address"):
        run_loopback(write(tmp_path, raw), tmp_path / "out")


@pytest.mark.parametrize("name", ["3pc_aby3.json", "2pc_semi2k.json"])
def test_example_node_configs_are_valid(name):
    config = load_node_config(NODES / name)
    assert config.world_size == {"3pc_aby3.json": 3, "2pc_semi2k.json": 2}[name]
    assert config.model_owner != config.prompt_owner


# ----- TLS ----------------------------------------------------------------------------------

def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(directory: pathlib.Path, parties: list[str], ca_name: str = "ca") -> None:
    """A throwaway CA and one CA-signed certificate per party (SAN 127.0.0.1)."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca_name}.key",
             "-out", f"{ca_name}.crt", "-days", "1", "-subj", f"/CN={ca_name}", cwd=directory)
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for pid in parties:
        tag = pid.replace(":", "_")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{tag}.key", "-out",
                 f"{tag}.csr", "-subj", f"/CN={tag}", cwd=directory)
        _openssl("x509", "-req", "-in", f"{tag}.csr", "-CA", f"{ca_name}.crt", "-CAkey",
                 f"{ca_name}.key", "-CAcreateserial", "-out", f"{tag}.crt", "-days", "1",
                 "-extfile", "san.ext", cwd=directory)


def tls_section(parties: list[str], ca: str = "certs/ca.crt") -> dict:
    return {"ca": ca, "certs": {p: {"cert": f"certs/{p.replace(':', '_')}.crt",
                                    "key": f"certs/{p.replace(':', '_')}.key"} for p in parties}}


def test_tls_between_parties(tmp_path):
    parties = ["node:0", "node:1"]
    make_certs(tmp_path / "certs", parties)
    raw = node_config(2, "SEMI2K", tls=tls_section(parties))
    record = run_loopback(write(tmp_path, raw), tmp_path / "out", use_free_ports=True)[-1]
    xla_tokens, _ = reference(TINY_JOB)
    assert record["tls"] is True
    assert record["tokens"] == xla_tokens.tolist()
