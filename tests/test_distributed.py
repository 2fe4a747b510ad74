"""Multi-process secure runs from node configs, on loopback: correctness, faults, config checks, TLS.

Every party is a real process linked over brpc on 127.0.0.1 (ports picked free at test time).
The job is a tiny secure generation (llama-tiny cut to 2 layers, 32-token prompt, 2 greedy
tokens, `mpcache_exact` with small clusters), so each run takes seconds.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.faults import cases, forge, harness, kinds
from runtime.distributed import (JobFailed, JobSpec, NodeConfigError, load_node_config,
                                 parse_node_config, run_loopback)
from runtime.distributed import bounds
from runtime.distributed import job as job_lib
from runtime.distributed.compare import compare_backends, simulate
from runtime.distributed.launch import free_ports, prepare_config, start_parties
from runtime.distributed.party import run_party, warn_if_insecure
from runtime.distributed.party_front import front_steps
from runtime.distributed.supervise import supervise
from experiments.faults.harness import node_config as loopback_node_config

REPO = pathlib.Path(__file__).resolve().parent.parent
NODES = REPO / "experiments" / "nodes"
TINY_JOB = {**harness.TINY_JOB, "reveal_logits": True}   # the fault cases' job, logits revealed


def node_config(parties: int, protocol: str, **link) -> dict:
    """The loopback config of experiments/faults/harness.py with this file's job (logits revealed
    for the comparisons)."""
    return loopback_node_config(parties, protocol, job=TINY_JOB, **link)


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
        # Each party's own CPU time for the program (its process: no other party's work).
        assert len(record["party_cpu_s"]) == parties and min(record["party_cpu_s"]) > 0
    assert len(summary["decode_party_cpu_s_per_token"]) == parties
    # Every decode step runs the same program (to within the link's framing bytes).
    decode = [s["comm_bytes"] for s in steps[1:]]
    assert max(decode) - min(decode) < 1e-3 * min(decode)


def test_compare_sim_runs_each_policy_in_the_simulator_and_on_real_parties(tmp_path):
    """`party --compare_sim`: per policy the simulator (in a child process, whose memory goes
    back before the parties start) and then three real parties, both appended to one
    results.jsonl: the same tokens, and each decode step the same messages and bytes (to
    within the link's framing)."""
    raw = node_config(3, "ABY3")
    path = write(tmp_path, raw)
    summaries = compare_backends(str(path), [raw["job"]["policy"]], tmp_path / "out",
                                 use_free_ports=True, max_new_tokens=3)
    records = [json.loads(line) for line in
               (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    sim = [r for r in records if r["backend"] == "spu_sim"]
    real = [r for r in records if r["backend"] == "spu_nodes"]
    assert [r["backend"] for r in summaries] == ["spu_sim", "spu_nodes"]
    assert sim[-1]["tokens"] == real[-1]["tokens"] and len(real[-1]["tokens"]) == 3
    sim_steps = [r for r in sim if r.get("phase") == "decode"]
    real_steps = [r for r in real if r.get("phase") == "decode"]
    assert len(sim_steps) == len(real_steps) == 2
    for s, r in zip(sim_steps, real_steps):
        assert s["messages"] == r["messages"] > 0
        assert abs(s["comm_bytes"] - r["comm_bytes"]) < 1e-3 * r["comm_bytes"]


# ----- faults -----------------------------------------------------------------------------

def _wait_for(path: pathlib.Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


# When the victim is hit: once its link is up (before weights are shared), or between decode
# steps (the prompt owner node:1 has received a decode step's token and the cache is resident
# as shares in every party's runtime; the job generates 4 tokens so more steps follow).
FAULT_MOMENTS = {"at link-up": ("party_node_2.log", "link up"),
                 "between decode steps": ("party_node_1.log", "(decode,")}


@pytest.mark.parametrize("moment", list(FAULT_MOMENTS))
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_dead_or_hung_party_makes_the_others_fail_naming_it(tmp_path, fault, moment):
    peer_timeout = 3
    raw = node_config(3, "ABY3", peer_timeout_s=peer_timeout)
    raw["job"]["max_new_tokens"] = 4
    config, path = prepare_config(write(tmp_path, raw), tmp_path / "out", use_free_ports=True)
    procs = start_parties(config, path, tmp_path / "out")
    victim = procs["node:2"]
    log_name, marker = FAULT_MOMENTS[moment]
    try:
        _wait_for(tmp_path / "out" / log_name, marker, timeout=240)
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
        assert not list((tmp_path / "out").glob("results.jsonl*"))
        assert not (tmp_path / "out" / "outputs.npz").exists()
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # also stopped or orphaned workers
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


def test_launcher_reports_the_failed_party_and_tears_everything_down(tmp_path):
    """A party that cannot start (bad prompt ids only it checks) fails the whole job."""
    raw = node_config(2, "SEMI2K", peer_timeout_s=3, recv_timeout_s=30, connect_timeout_s=5)
    raw["job"]["prompt_ids"] = [999] * 32  # outside the vocabulary: the prompt owner fails
    with pytest.raises(JobFailed) as info:
        run_loopback(write(tmp_path, raw), tmp_path / "out", use_free_ports=True)
    assert info.value.party == "node:1"
    assert "prompt_ids must lie in [0, 256)" in str(info.value)
    assert set(info.value.exit_codes) == {"node:0", "node:1"}
    assert info.value.exit_codes["node:1"] == 1 and info.value.exit_codes["node:0"] != 0
    # What a command line prints: one line, the party and its own error first.
    assert "\n" not in info.value.line
    assert info.value.line.startswith("secure job failed: party node:1 failed: ValueError: ")
    assert "prompt_ids must lie in [0, 256)" in info.value.line
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
    # issue 14: types, names, bounds, plain TCP
    "node id with a slash": (lambda r: (r["nodes"].update({"a/b": r["nodes"].pop("node:2")}),
                                        _spu(r)["node_ids"].__setitem__(2, "a/b")),
                             "node id 'a/b' is not allowed"),
    "node ids that share log files": (
        lambda r: (r["nodes"].update({"node_2": r["nodes"].pop("node:2")}),
                   _spu(r)["node_ids"].__setitem__(2, "node_2"),
                   r["nodes"].update({"node:2": "127.0.0.1:61499"})),
        "would share the log files node_2"),
    "string peer_timeout_s": (lambda r: _spu(r)["link"].update(peer_timeout_s="10"),
                              "link.peer_timeout_s='10' must be a number of seconds (write it "
                              "without quotes)"),
    "fractional retries": (lambda r: _spu(r)["link"].update(connect_retry_times=1.5),
                           "link.connect_retry_times=1.5 must be an integer"),
    "boolean timeout": (lambda r: _spu(r)["link"].update(recv_timeout_s=True),
                        "link.recv_timeout_s=True must be a number"),
    "non-positive connect timeout": (lambda r: _spu(r)["link"].update(connect_timeout_s=0),
                                     "link.connect_timeout_s=0 must be > 0 seconds"),
    "string insecure": (lambda r: _spu(r)["link"].update(insecure="yes"),
                        "link.insecure='yes' must be true or false"),
    "string prompt_ids": (lambda r: r["job"].update(prompt_ids=[str(i) for i in range(32)]),
                          "job.prompt_ids must be a list of integer token ids, got '0'"),
    "unknown prefill": (lambda r: r["job"].update(prefill="plain"),
                        "job.prefill='plain' is unknown; use \"secure\""),
    "budget text that is not a budget": (lambda r: r["job"].update(budget="0.1min0"),
                                         "job.budget='0.1min0' must be a number, a ratio with a "
                                         "floor such as \"0.1min384\", or null"),
    "string seq_len": (lambda r: r["job"].update(seq_len="32"),
                       "job.seq_len='32' must be an integer"),
    "seq_len beyond the context": (lambda r: r["job"].update(seq_len=10**9),
                                   "exceeds llama-tiny's context of 4096 tokens"),
    "max_new_tokens beyond the context": (lambda r: r["job"].update(max_new_tokens=10**6),
                                          "= 1000032 exceeds llama-tiny's context"),
    "too many layers": (lambda r: r["job"].update(num_layers=9), "job.num_layers:"),
    "bad policy options": (lambda r: r["job"].update(policy_options={"nonsense": 1}),
                           "job.policy='mpcache_exact' with job.budget=0.5"),
    "memory over the limit": (lambda r: r["job"].update(seq_len=3000, memory_limit_gb=1.0),
                              "over the limit of 1.0 GiB (job.memory_limit_gb)"),
    "plain TCP off loopback": (lambda r: r["nodes"].update({"node:2": "10.0.0.3:61402"}),
                               'or add "insecure": true to the link section'),
    "insecure with TLS": (lambda r: _spu(r)["link"].update(insecure=True, tls={
        "ca": "ca.crt", "certs": {}}), "link.insecure=true and link.tls contradict"),
    # issue 32: configs that passed validation and failed at run time
    "IPv6 literal": (lambda r: r["nodes"].update({"node:2": "[::1]:61402"}),
                     "nodes['node:2']='[::1]:61402' is an IPv6 address: not supported"),
    "bare IPv6": (lambda r: r["nodes"].update({"node:2": "::1:61402"}),
                  "is an IPv6 address: not supported"),
    "full-width port": (lambda r: r["nodes"].update({"node:2": "127.0.0.1:\uff16\uff12\uff14"}),
                        "must be a number from 1 to 65535 in ASCII digits 0-9"),
    "port 0": (lambda r: r["nodes"].update({"node:2": "127.0.0.1:0"}),
               "must be a number from 1 to 65535"),
    "port as a number": (lambda r: r["nodes"].update({"node:2": 61402}),
                         "must be a string \"host:port\""),
    "same port via localhost": (lambda r: r["nodes"].update({"node:2": "localhost:61400"}),
                                "nodes 'node:0' and 'node:2' both use port 61400"),
    "connect timeout 1e12": (lambda r: _spu(r)["link"].update(connect_timeout_s=1e12),
                             "link.connect_timeout_s=1e+12 is beyond the longest timeout the "
                             "link accepts, 604800 s"),
    "retry interval beyond 32 bits": (
        lambda r: _spu(r)["link"].update(connect_retry_interval_ms=2**40),
        "link.connect_retry_interval_ms=1099511627776 is beyond the bound"),
    "job timeout beyond a week": (lambda r: r["job"].update(timeout_s=1e9),
                                  "job.timeout_s=1e+09 is beyond 604800 s"),
    "negative shaping delay": (lambda r: _spu(r)["link"].update(shape={"delay_ms": -1}),
                               "link.shape.delay_ms=-1 must be a number of milliseconds"),
    "negative shaping rate": (lambda r: _spu(r)["link"].update(shape={"rate_mb_s": -40}),
                              "link.shape.rate_mb_s=-40 must be a rate in MB/s above 0"),
    "unknown shaping profile": (lambda r: _spu(r)["link"].update(shape="lte"),
                                "link.shape='lte' is unknown; use \"lan\""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_config_is_rejected_with_what_to_fix(case):
    mutate, message = CASES[case]
    with pytest.raises(NodeConfigError) as info:
        parse_node_config(_break(mutate))
    assert message in str(info.value)


@pytest.mark.parametrize("case", ["missing prompt owner", "node id with a slash",
                                  "string peer_timeout_s", "string prompt_ids"])
def test_party_cli_rejects_a_bad_config_before_starting(tmp_path, case):
    """Exit 2 with the message, no traceback, no party started (so no port is held)."""
    mutate, message = CASES[case]
    raw = _break(mutate)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "experiments.party",
                             f"--node_config={write(tmp_path, raw)}", "--party=all",
                             f"--output_dir={out}"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (out.exists() and list(out.glob("party_*.log")))
    assert not harness.processes_mentioning(str(out))


def test_a_repeated_key_is_refused_at_load(tmp_path):
    """json.loads keeps the last of two equal keys; the loader refuses them, in any object."""
    text = json.dumps(node_config(3, "ABY3"))
    entry = '"node:1": "127.0.0.1:61401"'
    path = tmp_path / "nodes.json"
    path.write_text(text.replace(entry, f'{entry}, "node:1": "127.0.0.1:61409"'))
    with pytest.raises(NodeConfigError, match="the key 'node:1' appears twice"):
        load_node_config(path)
    path.write_text(text.replace('"seq_len": 32', '"seq_len": 32, "seq_len": 64'))
    with pytest.raises(NodeConfigError, match="the key 'seq_len' appears twice"):
        load_node_config(path)


def _tls_config(tmp_path, node0_days: int):
    parties = ["node:0", "node:1", "node:2"]
    harness.make_certs(tmp_path / "certs", parties)
    harness.issue_cert(tmp_path / "certs", "node_0", "node:0", days=node0_days)
    return write(tmp_path, node_config(3, "ABY3", tls=tls_section(parties)))


def test_an_expired_certificate_is_refused_at_load(tmp_path):
    path = _tls_config(tmp_path, node0_days=-1)
    with pytest.raises(NodeConfigError, match=r"link.tls.certs\['node:0'\].cert=.* expired on"):
        load_node_config(path)
    with pytest.raises(NodeConfigError, match="expired on"):
        load_node_config(path, party="node:0")
    load_node_config(path, party="node:1")        # a party checks its own files only


def test_a_certificate_expiring_within_a_week_warns_at_load(tmp_path):
    path = _tls_config(tmp_path, node0_days=3)
    config = load_node_config(path)
    assert len(config.warnings) == 1 and "link.tls.certs['node:0'].cert" in config.warnings[0]
    assert "expires on" in config.warnings[0]
    assert not load_node_config(path, party="node:1").warnings


def test_the_documented_certificate_recipe_fits_the_shipped_tls_config(tmp_path):
    """scripts/make_certs.sh (the recipe in WORKSPACE.md) makes CN=node:N certificates with a
    SAN for each host; the shipped 3pc_aby3_hosts_tls.json loads with them, whole and per party."""
    import shutil
    nodes = tmp_path / "nodes"
    shutil.copytree(NODES, nodes)
    subprocess.run(["bash", str(REPO / "scripts" / "make_certs.sh"), str(nodes / "certs"),
                    "10.0.0.1", "10.0.0.2", "10.0.0.3"], check=True, capture_output=True)
    config = load_node_config(nodes / "3pc_aby3_hosts_tls.json")
    assert config.link.tls is not None and not config.warnings
    for pid in config.party_ids:
        load_node_config(nodes / "3pc_aby3_hosts_tls.json", party=pid)


def test_job_overrides_are_bounded_before_anything_starts(tmp_path):
    path = write(tmp_path, node_config(2, "SEMI2K"))
    with pytest.raises(NodeConfigError, match="exceeds llama-tiny's context of 4096"):
        run_loopback(path, tmp_path / "out", seq_len=5000)
    with pytest.raises(NodeConfigError, match="job.timeout_s='60' must be a number"):
        run_loopback(path, tmp_path / "out", timeout_s="60")
    assert not list((tmp_path / "out").glob("party_*.log"))


def test_memory_estimate_follows_its_formula():
    """1 GiB + b * (P + 2*T*V + 2*L*Hkv*d*(T+N) + 4*max(H*T*(T+N), T*F)), b = 16 for ABY3 FM64."""
    config = parse_node_config(node_config(3, "ABY3"))
    job = config.job                                      # llama-tiny, 2 layers, T=32, N=2
    cfg = job_lib.build(job)[0].cfg
    params = sum(int(np.prod(leaf.shape)) for leaf in
                 __import__("jax").tree_util.tree_leaves(job_lib.weight_shapes(job)))
    T, N = 32, 2
    want = (2**30 + 16 * (params + 2 * T * cfg.vocab_size
                          + 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (T + N)
                          + 4 * max(cfg.num_heads * T * (T + N), T * cfg.intermediate_size)))
    assert bounds.estimate_party_memory(job, config.mpc)[0] == want
    semi = parse_node_config(node_config(2, "SEMI2K"))
    assert bounds.estimate_party_memory(job, semi.mpc)[0] - 2**30 == (want - 2**30) // 2


def test_clear_prefill_memory_estimate_drops_the_secure_prefill():
    """prefill="clear": 1 GiB + b * (P + cache + 4*max(H*(T+N), F)) + 4 B * (P + T*V +
    4*max(H*T*(T+N), T*F)); below the secure prefill's estimate, and at 2048 tokens of
    llama2-d1024 under the limit that refuses the secure prefill on a 24 GB 3-party host."""
    raw = node_config(3, "ABY3")
    raw["job"]["prefill"] = "clear"
    config = parse_node_config(raw)
    job = config.job
    cfg = job_lib.build(job)[0].cfg
    params = sum(int(np.prod(leaf.shape)) for leaf in
                 __import__("jax").tree_util.tree_leaves(job_lib.weight_shapes(job)))
    T, N = 32, 2
    cache = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (T + N)
    want = (2**30 + 16 * (params + cache + 4 * max(cfg.num_heads * (T + N),
                                                   cfg.intermediate_size))
            + 4 * (params + T * cfg.vocab_size
                   + 4 * max(cfg.num_heads * T * (T + N), T * cfg.intermediate_size)))
    assert bounds.estimate_party_memory(job, config.mpc)[0] == want
    secure = parse_node_config(node_config(3, "ABY3"))
    assert want < bounds.estimate_party_memory(secure.job, secure.mpc)[0]
    for prefill, fits in (("secure", False), ("clear", True)):
        big = JobSpec(model="llama2-d1024", num_layers=2, policy="full", seq_len=2048,
                      max_new_tokens=4, prefill=prefill)
        need = bounds.estimate_party_memory(big, config.mpc)[0]
        assert (need < 0.8 * 24 * 2**30 / 3) == fits, (prefill, need / 2**30)


def test_clear_prefill_refuses_a_private_prompt_file(tmp_path):
    raw = node_config(3, "ABY3")
    raw["job"]["prefill"] = "clear"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a private question")
    config = load_node_config(write(tmp_path, raw), party="node:1")
    with pytest.raises(ValueError, match="makes the prompt public"):
        run_party(config, "node:1", tmp_path / "out", prompt_file=str(prompt))


def test_clear_prefill_then_secure_decode_steps_cost_what_they_cost_after_a_secure_prefill(
        tmp_path):
    """Three real parties: with job.prefill="clear" the model owner prefills in plaintext and
    shares the cache; the decode steps are the same programs, so they give the same tokens as
    the secure prefill's run and plaintext, and the same bytes and messages per step."""
    runs = {}
    for prefill in ("secure", "clear"):
        raw = node_config(3, "ABY3")
        raw["job"].update(max_new_tokens=3, prefill=prefill)
        runs[prefill] = run_loopback(write(tmp_path, raw, f"{prefill}.json"),
                                     tmp_path / prefill, use_free_ports=True)
    xla_tokens, _ = reference(node_config(3, "ABY3")["job"] | {"max_new_tokens": 3})
    for prefill, records in runs.items():
        assert records[-1]["tokens"] == xla_tokens.tolist(), prefill
        assert records[-1]["prefill"] == prefill
    secure_steps, clear_steps = runs["secure"][:-1], runs["clear"][:-1]
    assert [s["phase"] for s in secure_steps] == ["prefill", "decode", "decode"]
    assert [s["phase"] for s in clear_steps] == ["decode", "decode"]   # no MPC cost to record
    for a, b in zip(secure_steps[1:], clear_steps):
        assert a["position"] == b["position"]
        assert a["messages"] == b["messages"] > 0
        assert abs(a["comm_bytes"] - b["comm_bytes"]) < 1e-3 * a["comm_bytes"]


def test_a_worker_killed_by_sigkill_is_reported_as_out_of_memory(tmp_path, capsys):
    config = parse_node_config(node_config(3, "ABY3"))
    code = supervise(config, "node:0", str(tmp_path), [
        sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert code == 1
    err = capsys.readouterr().err
    assert "killed by SIGKILL" in err and "out-of-memory" in err and "GiB per party" in err


def test_insecure_plain_tcp_is_allowed_explicitly_and_warns(capsys):
    raw = node_config(2, "SEMI2K", insecure=True)
    raw["nodes"]["node:1"] = "10.0.0.2:61401"
    config = parse_node_config(raw)
    warn_if_insecure(config, "node:0")
    assert "warning: link.insecure=true" in capsys.readouterr().err


def test_unknown_party_on_the_command_line_is_rejected(tmp_path):
    path = write(tmp_path, node_config(2, "SEMI2K"))
    with pytest.raises(NodeConfigError, match=r"--party='node:5' is not one of the SPU parties"):
        load_node_config(path, party="node:5")


def test_loopback_launcher_refuses_remote_hosts(tmp_path):
    raw = node_config(2, "SEMI2K", insecure=True)
    raw["nodes"]["node:1"] = "10.0.0.2:61401"
    with pytest.raises(NodeConfigError, match="not a loopback address"):
        run_loopback(write(tmp_path, raw), tmp_path / "out")


@pytest.mark.parametrize("name", ["3pc_aby3.json", "2pc_semi2k.json"])
def test_example_node_configs_are_valid(name):
    config = load_node_config(NODES / name)
    assert config.world_size == {"3pc_aby3.json": 3, "2pc_semi2k.json": 2}[name]
    assert config.model_owner != config.prompt_owner


# ----- TLS ----------------------------------------------------------------------------------

def tls_section(parties: list[str], ca: str = "certs/ca.crt") -> dict:
    return harness.tls_section({p: harness.tag(p) for p in parties}, ca)


def test_tls_between_parties(tmp_path):
    """The documented recipe (scripts/make_certs.sh, run as WORKSPACE.md says) gives a mutual
    TLS run through the parties' fronts that completes with the plaintext tokens."""
    parties = ["node:0", "node:1"]
    subprocess.run(["bash", str(REPO / "scripts" / "make_certs.sh"), str(tmp_path / "certs"),
                    "127.0.0.1", "127.0.0.1"], check=True, capture_output=True)
    raw = node_config(2, "SEMI2K", tls=tls_section(parties))
    record = run_loopback(write(tmp_path, raw), tmp_path / "out", use_free_ports=True)[-1]
    xla_tokens, _ = reference(TINY_JOB)
    assert record["tls"] is True
    assert record["tokens"] == xla_tokens.tolist()
    # Under TLS each front holds a peer to yacl's throttle window of unread messages: it saw
    # messages wait unread and this party's acknowledgements release them (without those, the
    # thousands of messages of the run would have passed the window of 12 and been dropped).
    for pid in parties:
        steps = front_steps((tmp_path / "out" / f"party_{harness.tag(pid)}.log").read_text())
        assert steps and sum(step["frames"] for step in steps) > 100
        assert 1 <= steps[-1]["most_unread_so_far"] <= 12


def _non_loopback_address() -> str | None:
    """An IPv4 address of this machine other than loopback (the one a UDP socket would send
    from; nothing is sent), or None."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_plain_tcp_to_remote_peers_holds_them_to_the_unread_window(tmp_path):
    """With `insecure` plain TCP to a non-loopback address, brpc's outgoing connections pass
    the party's front as under TLS, so the front reads this party's acknowledgements and holds
    each peer to yacl's throttle window of unread messages; the run gives the plaintext
    tokens."""
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    raw = node_config(2, "SEMI2K", insecure=True)
    for pid, port in zip(("node:0", "node:1"), free_ports(2)):
        raw["nodes"][pid] = f"{address}:{port}"
    path = write(tmp_path, raw)
    procs = {pid: subprocess.Popen([sys.executable, "-m", "experiments.party",
                                    f"--node_config={path}", f"--party={pid}",
                                    f"--output_dir={tmp_path / harness.tag(pid)}"],
                                   cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
             for pid in ("node:0", "node:1")}
    logs = {pid: p.communicate(timeout=300)[0] for pid, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), logs
    record = [json.loads(line) for line in
              (tmp_path / "node_1" / "results.jsonl").read_text().splitlines()][-1]
    xla_tokens, _ = reference(TINY_JOB)
    assert record["tokens"] == xla_tokens.tolist()
    for pid, log in logs.items():
        steps = front_steps(log)
        assert steps and 1 <= steps[-1]["most_unread_so_far"] <= 12, pid


# ----- TLS identity and faults before link-up -------------------------------------------------

PARTIES3 = ["node:0", "node:1", "node:2"]


def run_parties(tmp_path, plan: dict, judges, timeout=120.0):
    """Start the parties of `plan` ({party: (config path, prelude)}), wait for `judges` to
    exit -> ({party: exit code or None}, {judge: its error line}, seconds from the first
    judge's 'linking' line (else from the start) to the last judge's exit)."""
    out = tmp_path / "out"
    start = time.monotonic()
    procs = {pid: harness.start_party(path, pid, out, prelude) for pid, (path, prelude) in plan.items()}
    linking = None
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(procs[j].poll() is None for j in judges):
            if linking is None and any("] linking to " in harness.log_text(out, j) for j in judges):
                linking = time.monotonic()
            time.sleep(0.05)
        elapsed = time.monotonic() - (linking or start)
        codes = {pid: p.poll() for pid, p in procs.items()}
    finally:
        harness.kill_all(procs)
    return codes, {j: harness.error_line(out, j) for j in judges}, elapsed


def tls_config(tmp_path, **files) -> dict:
    raw = node_config(3, "ABY3", connect_timeout_s=20)
    raw["nodes"] = {p: f"127.0.0.1:{port}" for p, port in zip(PARTIES3, free_ports(3))}
    _spu(raw)["link"]["tls"] = cases.tls_files(tmp_path, PARTIES3, **files)
    return raw


@pytest.mark.parametrize("variant", ["one certificate for all", "owner presents node:2's"])
def test_a_certificate_for_the_wrong_node_is_refused_naming_both(tmp_path, variant):
    """Rejected by config validation (exit 2 before anything starts), and, when a party skips
    its own check (it controls its code), by its peers on the network, naming the expected
    node and the name in the certificate. Before this, both ran to exit 0."""
    shared = variant == "one certificate for all"
    raw = tls_config(tmp_path, shared_imposter=shared)
    if not shared:
        certs = _spu(raw)["link"]["tls"]["certs"]
        certs["node:1"] = dict(certs["node:2"])
    expected_cn = "CN='imposter'" if shared else "CN='node:2'"
    with pytest.raises(NodeConfigError) as info:
        parse_node_config(raw, base_dir=tmp_path)
    assert expected_cn in str(info.value) and ("node 'node:0'" if shared else "node 'node:1'") \
        in str(info.value)

    hostile = write(tmp_path, raw, "hostile.json")
    if shared:
        plan = {p: (hostile, harness.SKIP_OWN_CERT_CHECK) for p in PARTIES3}
        judges = PARTIES3
    else:
        honest_raw = json.loads(json.dumps(raw))
        _spu(honest_raw)["link"]["tls"] = harness.tls_section({p: harness.tag(p) for p in PARTIES3})
        honest = write(tmp_path, honest_raw, "honest.json")
        plan = {"node:0": (honest, None), "node:1": (hostile, harness.SKIP_OWN_CERT_CHECK),
                "node:2": (honest, None)}
        judges = ["node:0", "node:2"]
    codes, lines, elapsed = run_parties(tmp_path, plan, judges)
    assert all(codes[j] == 3 for j in judges), (codes, lines)
    naming = [j for j in judges
              if expected_cn in lines[j] and "is not who the config says" in lines[j]]
    if shared:   # the first to look ends the run; the others may only see it gone
        assert naming, lines
        assert any(f"where node '{p}'" in lines[j] for j in naming for p in PARTIES3)
    else:
        assert naming == judges, lines
        assert all("party node:1 " in lines[j] and "node 'node:1'" in lines[j] for j in judges)
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_a_refused_tls_handshake_is_named(tmp_path):
    """node:2's certificate is signed by another CA (and node:2 skips the check at load that
    would refuse it, as a party running other code can): the others name it, node:2 names the
    peer that refused it; seconds, not job.timeout_s."""
    path = write(tmp_path, tls_config(tmp_path, other_ca_for="node:2"))
    plan = {p: (path, harness.SKIP_OWN_CERT_CHECK if p == "node:2" else None)
            for p in PARTIES3}
    codes, lines, elapsed = run_parties(tmp_path, plan, PARTIES3)
    assert all(codes[p] == 3 for p in PARTIES3), (codes, lines)
    for p in ("node:0", "node:1"):
        assert "party node:2 " in lines[p] and "failed the TLS handshake" in lines[p], lines[p]
    assert "refused the TLS handshake" in lines["node:2"], lines["node:2"]
    assert elapsed < 20


def test_a_party_that_never_starts_is_named_within_connect_timeout(tmp_path):
    raw = node_config(3, "ABY3", connect_timeout_s=5)
    raw["nodes"] = {p: f"127.0.0.1:{port}" for p, port in zip(PARTIES3, free_ports(3))}
    path = write(tmp_path, raw)
    codes, lines, elapsed = run_parties(tmp_path, {p: (path, None) for p in PARTIES3[:2]},
                                        PARTIES3[:2])
    assert codes == {"node:0": 3, "node:1": 3}, lines
    for p in PARTIES3[:2]:
        assert "party node:2 never came up within link.connect_timeout_s=5 s" in lines[p], lines[p]
    assert 5 <= elapsed < 5 + 10, elapsed


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_signal_to_the_launcher_leaves_no_party_and_no_results(tmp_path, signum):
    """`experiments.party --party=all` signalled once every party is linked: SIGTERM makes it
    kill every party and exit 143; SIGKILL (a crash) takes the parties with it (they die with
    their parent). No party process is left and none writes results.jsonl / outputs.npz."""
    case = kinds.LauncherSignalCase("launcher", signum, "", "")
    observed = case.run(kinds.Context(tmp_path))
    want = 143 if signum == signal.SIGTERM else -9
    assert observed.exit_codes == f"launcher {want}", observed
    assert observed.note == "no party process, no result file", observed
    if signum == signal.SIGTERM:
        assert "interrupted by SIGTERM" in observed.error
    assert observed.passed


def test_party_table_pools_runs_and_prints_ratios_to_full(tmp_path):
    """Medians (or means) over every decode step of repeated runs; ratios full / policy per
    config and T."""
    from experiments import party_table

    def step(policy, wall, cpu, mb, msgs, net):
        return {"phase": "decode", "prompt_tokens": 1024,
                "policy": policy, "wall_s": wall, "party_cpu_s": cpu, "comm_bytes": mb * 1e6,
                "messages": msgs, "lan_latency_s": net}
    runs = {"r1/full": [step("full", 4.0, [2.0, 3.0, 2.5], 120, 2100, 0.8),
                        {"phase": "prefill", "policy": "full"}],
            "r2/full": [step("full", 6.0, [3.0, 3.5, 2.0], 120, 2100, 0.8),
                        step("full", 5.0, [1.0, 1.0, 4.0], 120, 2100, 0.8)],
            "r1/mpcache": [step("mpcache", 2.5, [2.0, 2.0, 2.0], 60, 2200, 0.4)]}
    for name, records in runs.items():
        (tmp_path / name).mkdir(parents=True)
        summary = {"summary": True, "node_config": "netns"}   # names the run's node config
        (tmp_path / name / "results.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records + [summary]))
    rows = party_table.summarize(party_table.decode_steps(tmp_path))
    full, mp = {r["policy"]: r for r in rows}["full"], {r["policy"]: r for r in rows}["mpcache"]
    assert full["steps"] == 3 and full["wall_s"] == 5.0 and full["max_party_cpu_s"] == 3.5
    assert full["lan_network_plus_cpu_s"] == pytest.approx(4.3)   # median of 3.8, 4.3, 4.8
    assert mp["steps"] == 1 and mp["wall_s"] == 2.5 and mp["max_party_cpu_s"] == 2.0
    assert full["link"] == "-" and full["model_s"] is None           # no config, no simulation
    text = party_table.format_tables(rows)
    assert "| netns | 1024 | `mpcache` | 2.00x | 2.00x | 2.00x | 1.79x | - |" in text
    assert party_table.main(["party_table", str(tmp_path)]) == 0
    assert (tmp_path / "party_table.csv").read_text().count("\n") == 3
    # the mean: a policy whose steps differ by design (refresh / reuse) costs its mean per token
    means = {r["policy"]: r for r in party_table.summarize(party_table.decode_steps(tmp_path),
                                                           statistic="mean")}
    assert means["full"]["wall_s"] == 5.0 and means["full"]["max_party_cpu_s"] == pytest.approx(
        (3.0 + 3.5 + 4.0) / 3)
    assert means["full"]["lan_network_plus_cpu_s"] == pytest.approx(0.8 + 3.5)
    assert party_table.main(["party_table", "--statistic=mean", str(tmp_path)]) == 0
    with pytest.raises(SystemExit) as err:
        party_table.main(["party_table", "--statistic=mode", str(tmp_path)])
    assert err.value.code == 2


def test_party_table_predicts_each_run_from_simulated_steps_for_its_link(tmp_path):
    """With simulated steps of the same length and policy in the folder (--compare_sim), a run
    on a "wan" link is set beside the simulated WAN time and a "lan" one beside the LAN time;
    the simulated records are not counted as measured steps."""
    from experiments import party_table

    def step(backend, policy, wall, lan, wan):
        return {"phase": "decode", "backend": backend, "prompt_tokens": 2048, "policy": policy,
                "wall_s": wall, "party_cpu_s": [1.0, 1.0, 1.0], "comm_bytes": 1e8,
                "messages": 2000, "lan_latency_s": 0.5, "lan_total_s": lan, "wan_total_s": wan}
    for shape in ("lan", "wan"):
        for policy, wall in (("full", 6.0), ("mpcache", 4.0)):
            run = tmp_path / shape / policy
            run.mkdir(parents=True)
            config = {"devices": {"SPU": {"config": {"link": {"shape": shape}}}}}
            (run / "node_config.json").write_text(json.dumps(config))
            records = [step("spu_nodes", policy, wall if shape == "lan" else 30 * wall, 0, 0),
                       {"summary": True, "node_config": f"cfg.{shape}"}]
            (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            if shape == "lan":     # --compare_sim's own file: simulated steps, the real copied
                records += [step("spu_sim", policy, 1, 2 * wall, 25 * wall),
                            step("spu_sim", policy, 1, 4 * wall, 35 * wall)]
                with open(tmp_path / shape / "results.jsonl", "a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in records))
    rows = party_table.summarize(party_table.decode_steps(tmp_path),
                                 party_table.simulated_steps(tmp_path))
    got = {(r["link"], r["policy"]): r for r in rows}
    assert len(rows) == 4 and all(r["steps"] == 1 for r in rows)
    assert got["lan", "full"]["model_s"] == 18.0 and got["wan", "full"]["model_s"] == 180.0
    assert got["wan", "mpcache"]["wall_s"] == 120.0 and got["wan", "mpcache"]["model_s"] == 120.0
    assert "| cfg.wan | 2048 | `mpcache` | 1.50x | 1.00x | 1.00x | 1.00x | 1.50x |" in \
        party_table.format_tables(rows)


# ----- the front door (issue 32) -------------------------------------------------------------

FRONT_CASES = {case.name: case for case in cases.front_cases()}


@pytest.fixture(scope="session")
def fast_front(tmp_path_factory):
    """runtime/distributed/fast_front.c built once for the session."""
    from runtime.distributed.fast_front import FAST_FRONT_NAME
    binary = tmp_path_factory.mktemp("fast_front") / FAST_FRONT_NAME
    why = forge.build_fast_front(binary)
    if why:
        pytest.skip(f"cannot build the front in C here ({why}); front.py serves every party")
    return binary


@pytest.mark.parametrize("name", sorted(FRONT_CASES))
def test_the_front_drops_a_hostile_frame_and_names_the_peer(tmp_path, name, request):
    """Each forged frame of experiments/faults/cases.py against a real front process (front.py,
    and for the plain-TCP cases also the front in C): the connection is closed with a line
    naming the peer, nothing of it reaches brpc, the front still answers the hello."""
    case = FRONT_CASES[name]
    ctx = kinds.Context(tmp_path, request.getfixturevalue("fast_front") if case.fast else None)
    observed = case.run(ctx)
    assert observed.passed, (observed.error, observed.note)


def _quick(case):
    """A scenario row as the tests run it: the byte-every-8-s connection at a 2 s deadline and
    a byte every 1.6 s (the table's row waits out the real 10 s)."""
    if case.name.endswith("one byte every 8 s"):
        import dataclasses
        return dataclasses.replace(case, scenario=cases._trickle(b"P", 1.6),
                                   spec_overrides={"frame_deadline_s": 2.0})
    return case


SCENARIO_CASES = {case.name: _quick(case) for case in cases.front_scenario_cases()}


@pytest.mark.parametrize("name", sorted(SCENARIO_CASES))
def test_the_front_holds_slow_and_flooding_peers_and_local_writers(tmp_path, name, request):
    """The fault cases of the front's own rules (experiments/faults/cases.py,
    front_scenario_cases) against a real front process, front.py and the front in C: a hello
    or frame not whole within its deadline is closed, saying so; a flood of connections
    without a hello cannot keep a peer out and is counted by source; each connection has its
    own budget of unfinished messages; under TLS the outbound socket serves the worker only."""
    case = SCENARIO_CASES[name]
    ctx = kinds.Context(tmp_path, request.getfixturevalue("fast_front") if case.fast else None)
    observed = case.run(ctx)
    assert observed.passed, (observed.error, observed.note)


NEW_CONFIG_CASES = {case.name: case for case in cases.config_cases() if case.name in (
    "config: certificate from another CA", "config: key of another certificate",
    "config: node missing from node_ids", "config: cert path is a directory",
    "config: cert path is /dev/zero")}


@pytest.mark.parametrize("name", sorted(NEW_CONFIG_CASES))
def test_a_config_that_would_fail_at_run_time_fails_at_load(tmp_path, name):
    """A certificate the CA did not sign, a key of another certificate, a node outside
    node_ids, a certificate path that is a directory or a device: exit 2 at load, one line
    naming the field, before any party starts."""
    observed = NEW_CONFIG_CASES[name].run(kinds.Context(tmp_path))
    assert observed.passed, (observed.error, observed.note)


SIDE_DOOR_CASES = {case.name: case for case in cases.party_cases() if case.name.split(":")[0]
                   in ("side door", "flood", "forge") or case.name.startswith("tls: local")}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SIDE_DOOR_CASES))
def test_no_side_door_no_starving_flood_and_forgeries_named(tmp_path, name):
    """Real parties: a local process that pushes a 2^40-byte chunk to every TCP port the
    parties' processes listen on finds only the public ports, and the run completes; so does
    a run whose node:0 gets 260 connections without a hello before node:2 starts (the flood
    named); under TLS, writes to node:0's outbound sockets are refused and reach no peer; a
    Push forged under the run's link key stops the run at once, naming the forgery."""
    observed = SIDE_DOOR_CASES[name].run(kinds.Context(tmp_path))
    assert observed.passed, (observed.error, observed.note)


def test_front_parses_the_frames_spu_sends():
    """A Push as SPU 0.9.5 frames it (a chunk of a 3 MB message, read off the wire) parses to
    its rank, key, chunk length and offset; a header alone waits for the body."""
    from runtime.distributed import frames, rules
    frame = forge.forge_frame(2, b"l.run:P2P-7:2->0", b"z" * 100, message_length=3000, chunk_offset=200)
    push = frames.parse_frame(bytearray(frame + b"PRPC"), 1 << 20)
    assert (push.sender_rank, push.key, push.chunk_bytes, push.message_length,
            push.chunk_offset, push.frame_bytes) == (2, b"l.run:P2P-7:2->0", 100, 3000, 200,
                                                     len(frame))
    assert frames.parse_frame(bytearray(frame[:20]), 1 << 20) is None
    book, conn = rules.UnfinishedBook(5000, 2), rules.ConnLedger()
    given = dict(bound_rank=2, my_rank=0, link_id=b"l.run", max_message_bytes=4000, book=book,
                 conn=conn)
    rules.check_push(push, **given)
    assert (conn.count, conn.bytes, book.total_bytes) == (1, 3000, 3000)
    with pytest.raises(frames.FrameError, match="unfinished messages of 6,000 bytes in flight "
                                               "on this connection"):
        rules.check_push(frames.parse_frame(bytearray(forge.forge_frame(
            2, b"l.run:P2P-8:2->0", b"z", message_length=3000)), 1 << 20), **given)
    with pytest.raises(frames.FrameError, match="restating its message's length"):
        rules.check_push(frames.parse_frame(bytearray(forge.forge_frame(
            2, b"l.run:P2P-7:2->0", b"z", message_length=2999)), 1 << 20), **given)
    with pytest.raises(frames.FrameError, match=r"\(2->1\) on a connection from rank 2 to this "
                                               r"party \(rank 0\)"):
        rules.check_push(frames.parse_frame(bytearray(forge.forge_frame(
            2, b"l.run:P2P-9:2->1")), 1 << 20), **given)
    with pytest.raises(frames.FrameError, match="another service"):
        frames.parse_frame(bytearray(forge.forge_frame(2, b"k", service=b"evil.Service")), 1 << 20)
    with pytest.raises(frames.FrameError, match="not a brpc frame"):
        frames.parse_frame(bytearray(b"\x80\x04\x95pickle..."), 1 << 20)


def test_front_reads_frames_as_protobuf_and_yacl_would():
    """Where a lenient reader and protobuf would disagree, the front refuses: a field given
    twice (protobuf merges messages), a varint over 64 bits, a meta shorter than the Push
    request it starts like; a peer may not hold more than MAX_UNFINISHED_MESSAGES chunked
    messages unfinished however small; a hello nonce must be 32 hex digits."""
    from runtime.distributed import frames, rules
    pf, key = forge.pb_field, b"l.run:P2P-1:0->1"

    def parse(frame):
        return frames.parse_frame(bytearray(frame), 1 << 20)
    with pytest.raises(frames.FrameError, match="field 5 appears twice"):
        parse(forge.forge_frame(0, key, b"", message_length=8, push_extra=pf(5, pf(2, 0))))
    with pytest.raises(frames.FrameError, match="field 1 appears twice"):
        parse(forge.forge_frame(0, key, push_extra=pf(1, 0)))
    assert parse(forge.forge_frame(0, key, push_extra=pf(16, 1) + pf(16, 2))).key == key
    over = b"\x08" + b"\xff" * 9 + b"\x03"      # field 1 = a 66-bit varint
    with pytest.raises(frames.FrameError, match="over 64 bits"):
        parse(forge.forge_frame(0, key, push_extra=over))
    # A meta of 3 bytes that starts like the Push request: read within its 3 bytes (as brpc
    # reads it), not as the request the bytes after it spell.
    full = forge.forge_frame(0, key)
    with pytest.raises(frames.FrameError, match="field 1 declares 48 bytes, 1 remain"):
        parse(full[:8] + struct.pack(">I", 3) + full[12:])
    book, conn = rules.UnfinishedBook(1 << 20, 2), rules.ConnLedger()
    given = dict(bound_rank=0, my_rank=1, link_id=b"l.run", max_message_bytes=1 << 20,
                 book=book, conn=conn)
    for i in range(rules.MAX_UNFINISHED_MESSAGES):
        rules.check_push(parse(forge.forge_frame(0, b"l.run:P2P-%d:0->1" % i, b"",
                                                 message_length=1)), **given)
    with pytest.raises(frames.FrameError, match="65 unfinished chunked messages in flight on "
                                               "this connection, over the per-connection cap "
                                               "of 64"):
        rules.check_push(parse(forge.forge_frame(0, b"l.run:P2P-99:0->1", b"",
                                                 message_length=1)), **given)
    nonce = bytes(range(16))
    assert frames.parse_hello(frames.hello_request(nonce)) == nonce
    spaced = frames.hello_request(nonce).replace(nonce.hex()[:2].encode(), b" 0", 1)
    assert len(spaced) == frames.HELLO_REQUEST_BYTES and frames.parse_hello(spaced) is None


def _mutated_frame_cases(rng, count: int) -> list[bytes]:
    """`count` byte strings a peer might send on a new connection: one to three frames of the
    kinds yacl sends (and lies about them), then bytes flipped, cut, inserted or appended, or
    fields added."""
    pf = forge.pb_field

    def wrap(push: bytes) -> bytes:
        meta = pf(1, pf(1, b"org.interconnection.link.ReceiverService") + pf(2, b"Push"))
        return b"PRPC" + struct.pack(">II", len(meta) + len(push), len(meta)) + meta + push

    def frame():
        i = rng.randrange(1, 40)
        kind = rng.randrange(12)
        if kind == 9:       # fields of the wrong type
            key = pf(2, f"test.3pc.run:P2P-{i}:0->1\x01\x02{i}".encode())
            return wrap(rng.choice((pf(1, b"0") + key, pf(1, 0) + pf(2, 7),
                                    pf(1, 0) + key + pf(4, 1) + pf(5, pf(1, b"8")),
                                    pf(1, 0) + key + pf(4, 1) + pf(5, pf(2, b"0")),
                                    pf(1, 0) + key + pf(3, 5) + pf(4, 1) + pf(5, pf(1, 5)),
                                    pf(1, 0) + key + pf(4, b"\x01") + pf(5, 3))))
        src = rng.choice((0, 0, 0, 2, 1, 7))
        key = rng.choice((f"test.3pc.run:P2P-{i}:{src}->1", f"test.3pc.run:{i}:ALLGATHER",
                          f"test.3pc.run-{i}", f"connect_{src}", "ACK", "FIN",
                          f"other.run:P2P-{i}:0->1", f"test.3pc.run:P2P-{i}:0->2",
                          f"test.3pc.run:P2P-{i}:0->1->1", "test.3pc.run:x:00->1",
                          "test.3pc.run:" + "k" * 600))
        value = rng.randbytes(rng.choice((0, 1, 8, 300, 5000)))
        extra = dict(seq=rng.choice((i, i, 0, 10 ** 19, 10 ** 21)))
        if kind < 4:
            length = rng.choice((len(value), len(value) + 1, 3 * len(value) + 1, 4096, 4097,
                                 1 << 40, 2 ** 64 - 1))
            extra.update(message_length=length,
                         chunk_offset=rng.choice((0, 0, len(value), max(0, length - len(value)),
                                                  1 << 62)))
        if kind == 5:
            extra["push_extra"] = rng.choice((pf(5, pf(2, 0)), pf(1, 0), pf(16, 1) + pf(16, 2),
                                              pf(4, 1), pf(3, b"v"), b"\x08" + b"\xff" * 9 + b"\x01",
                                              b"\x08" + b"\xff" * 9 + b"\x02",
                                              b"\x08" + b"\xff" * 10 + b"\x01", b"\x0f",
                                              pf(2, b"k")))
        if kind == 6:
            extra["meta_extra"] = rng.choice((pf(1, pf(1, b"x")), pf(8, pf(1, 7)), pf(3, 1),
                                              pf(5, 0), pf(5, 9), pf(2, b""), pf(20, 1), pf(0, 1)))
        if kind == 7:
            extra["service"] = rng.choice((b"evil.Service", b"org.interconnection.link.Receiver"))
        out = forge.forge_frame(min(src, 2) if rng.random() < 0.8 else rng.choice((2 ** 32, 5)),
                                key.encode(), value, **extra)
        if kind == 8:       # the meta written field by field (the generic path)
            meta_size = struct.unpack(">I", out[8:12])[0]
            meta = out[12:12 + meta_size]
            request_field = forge.pb_field(1, pf(1, b"org.interconnection.link.ReceiverService")
                                           + pf(2, b"Push"))
            rest = meta[len(request_field):]
            meta = rest + request_field if rng.random() < 0.5 else request_field + rest
            body = meta + out[12 + meta_size:]
            out = b"PRPC" + struct.pack(">II", len(body), len(meta)) + body
        return out

    cases = []
    for _ in range(count):
        data = bytearray(b"".join(frame() for _ in range(rng.choice((1, 1, 2, 3)))))
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            how = rng.randrange(5)
            at = rng.randrange(len(data) + 1)
            if how == 0 and at < len(data):
                data[at] ^= 1 << rng.randrange(8)
            elif how == 1 and at < len(data):
                data[at] = rng.choice((0, 1, 0x7F, 0x80, 0xFF))
            elif how == 2:
                del data[at:]
            elif how == 3:
                data[at:at] = rng.randbytes(rng.randrange(1, 4))
            else:
                data += rng.randbytes(rng.randrange(1, 20))
        cases.append(bytes(data))
    return cases


def _ledger_streams() -> dict[str, list[bytes]]:
    """Connections, one after the other, that fill the book of unfinished messages: each
    connection's own caps (count, bytes), a message a closed connection left that a later one
    finishes or restates, and the caps of all connections together (the fault another
    connection's or, once, the connection's own)."""
    serial = iter(range(10_000))

    def unfinished(length, n=1, value=b""):
        return b"".join(forge.forge_frame(0, b"test.3pc.run:P2P-%d:0->1" % j, value,
                                          message_length=length, seq=j)
                        for j in (next(serial) + 1 for _ in range(n)))

    def numbered(seq, counter):
        return forge.forge_frame(0, b"test.3pc.run:P2P-%d:0->1" % counter, b"v", seq=seq)

    def part(j, value, length, offset):
        return forge.forge_frame(0, b"test.3pc.run:P2P-%d:0->1" % j, value,
                                 message_length=length, chunk_offset=offset, seq=j)
    return {
        "own caps, resumed": [unfinished(1, 65), unfinished(4096, 4),
                              part(9001, b"a" * 5, 10, 0), part(9001, b"b" * 5, 10, 5),
                              part(9002, b"c" * 5, 10, 0), part(9002, b"d" * 5, 11, 5)],
        "all together, another's": [unfinished(4096, 3) for _ in range(3)] + [unfinished(4096)],
        "all together, its own": [unfinished(4096) for _ in range(7)] + [unfinished(4096, 3)],
        "all together, count": [unfinished(1, 64) for _ in range(3)] + [unfinished(1)],
        # A message number that comes back: under its own key (a retry), in a slot another
        # number took since, under another key (a second sender for the rank).
        "numbers": [numbered(60, 60), numbered(60, 60), numbered(60, 56),
                    numbered(60 + 4096, 9), numbered(60, 57),
                    numbered(61, 61) + numbered(61, 62),
                    numbered(10 ** 20 - 1, 5) + numbered(10 ** 20 - 1, 6)],
    }


def _py_verdicts(spec, cases: list[bytes]) -> list[str]:
    """front.py's verdicts on `cases`, each the bytes of a new connection that then closes."""
    import types
    from runtime.distributed import front_state, rules
    reference = front_state.Front(spec)
    out = []
    for i, data in enumerate(cases):
        conn = types.SimpleNamespace(node=None, ledger=None,
                                     unfinished=rules.ConnLedger(f"case {i}"))
        at, err = reference.check_frames(conn, memoryview(data))
        tag = ("(forged) " if err.kind == rules.FORGED else "(anonymous) " if err.anonymous
               else "") if err else ""
        out.append(f"{at} error: {tag}{err}" if err else f"{at} waits")
        reference.book.close(conn.unfinished)
    return out


def test_the_front_in_c_gives_front_py_verdicts(fast_front, tmp_path):
    """A differential fuzz: thousands of forged and mutated connections' bytes read by
    fast_front.c (--check) and by front.py's Front.check_frames give the same verdict (bytes
    that pass, and the same error message, naming the connection or not), with the book of
    unfinished messages carried across connections; then connections that fill that book to
    each cap; the same again from a build with AddressSanitizer and UndefinedBehaviorSanitizer,
    where cc has them, which must not report anything."""
    import random
    from runtime.distributed import front_state
    from runtime.distributed.fast_front import FAST_FRONT_SOURCE, fast_front_args
    spec = front_state.FrontSpec(
        party="node:1", rank=1, listen_host="127.0.0.1", listen_port=1, link_id="test.3pc.run",
        peers={"node:2": {"rank": 2}, "node:0": {"rank": 0}}, hello_key="00" * 32,
        max_frame_bytes=(1 << 20) + (64 << 10), max_message_bytes=4096,
        max_buffered_bytes=12_288, events_path="/dev/null", private_dir="/nonexistent")
    streams = {"mutated": _mutated_frame_cases(random.Random(2026), 3000), **_ledger_streams()}
    sanitized = tmp_path / "fast_front_sanitized"
    built = subprocess.run(["cc", "-O1", "-g", "-fsanitize=address,undefined",
                            "-fno-sanitize-recover=all", "-pthread", "-o", str(sanitized),
                            str(FAST_FRONT_SOURCE), "-lcrypto"], capture_output=True)
    verdicts = {}
    for name, cases_ in streams.items():
        want = verdicts[name] = _py_verdicts(spec, cases_)
        stream = b"".join(struct.pack(">I", len(d)) + d for d in cases_)
        for binary in [fast_front] + ([sanitized] if built.returncode == 0 else []):
            done = subprocess.run([str(binary), "--check"] + fast_front_args(spec),
                                  input=stream, capture_output=True, timeout=300)
            assert done.returncode == 0 and not done.stderr, (binary, done.stderr[-2000:])
            got = done.stdout.decode().splitlines()
            assert len(got) == len(want)
            differ = [(i, cases_[i][:120], w, g) for i, (w, g) in enumerate(zip(want, got))
                      if w != g]
            assert not differ, (name, binary, differ[:5])
    # Not vacuous: many kinds of error, and frames passing; each cap of the book reached.
    every = [w for stream in verdicts.values() for w in stream]
    kinds_of_error = {re.sub(r"[\d,]+|b'.*?'|b\".*?\"|case N.*", "N", w.split("error: ", 1)[1])
                      for w in every if "error: " in w}
    assert len(kinds_of_error) >= 29, sorted(kinds_of_error)
    assert sum(int(w.split()[0]) > 0 for w in verdicts["mutated"]) >= 150
    caps = verdicts["own caps, resumed"]
    assert "65 unfinished chunked messages in flight on this connection" in caps[0]
    assert "unfinished messages of 16,384 bytes in flight on this connection" in caps[1]
    assert caps[2:5] == [f"{n} waits" for n in (len(x) for x in
                                                _ledger_streams()["own caps, resumed"][2:5])]
    assert "restating its message's length as 11 (first 10)" in caps[5]
    assert verdicts["all together, another's"][-1].startswith(
        "0 error: (anonymous) 10 unfinished chunked messages (40,960 bytes) at this party, over "
        "its total of 192 messages / 36,864 bytes for all connections together; the most, "
        "12,288 bytes in 3, from case 0 (node:0), closed")
    own = verdicts["all together, its own"][-1]
    assert "error: 10 unfinished" in own and "from case 7 (node:0)" in own and "closed" not in own
    assert "193 unfinished chunked messages" in verdicts["all together, count"][-1]
    numbers = verdicts["numbers"]
    assert [v.split()[1] for v in numbers] == ["waits"] * 2 + ["error:"] + ["waits"] * 2 + [
        "error:"] * 2
    assert numbers[2] == (
        "0 error: (forged) message 60 of rank 0 under the key b'test.3pc.run:P2P-56:0->1' on "
        "case 2 (node:0), after it came under the key b'test.3pc.run:P2P-60:0->1' on case 0 "
        "(node:0): two connections claim rank 0, and yacl keeps the first")
    assert "(forged) message 61 of rank 0" in numbers[5]
    assert "(forged) message 99999999999999999999 of rank 0" in numbers[6]


def test_front_holds_a_peer_to_the_throttle_window_of_unread_messages():
    """Complete messages of a peer count as unread until this party's own outgoing ACK names
    their sequence number (read off its brpc frames by the outbound side); one more than the
    window is refused; a retried delivery of a read message does not count again."""
    from runtime.distributed import frames, rules
    ledger = rules.PeerLedger()
    given = dict(bound_rank=0, my_rank=1, link_id=b"l.run", max_message_bytes=1 << 20,
                 book=rules.UnfinishedBook(2 << 20, 2), conn=rules.ConnLedger(), peer=ledger,
                 max_unread=3)

    def deliver(seq, **chunk):
        frame = forge.forge_frame(0, f"l.run:P2P-{seq}:0->1".encode(), b"v" * 10, seq=seq,
                                  **chunk)
        rules.check_push(frames.parse_frame(bytearray(frame), 1 << 20), **given)

    def acknowledge(*seqs):
        acks = b"".join(forge.forge_frame(1, b"ACK", str(s).encode()) for s in seqs)
        assert rules.note_acknowledgements(bytearray(acks + b"PRPC"), 0, 1 << 20,
                                           ledger) == len(acks)

    for seq in (1, 2, 3):
        deliver(seq)
    assert sorted(ledger.unread) == [1, 2, 3]
    with pytest.raises(frames.FrameError, match="4 messages .40 bytes. that this party has not "
                                               "read, over the 3"):
        deliver(4)
    acknowledge(1, 3, 4)
    assert sorted(ledger.unread) == [2] and (ledger.read_floor, ledger.read_above) == (1, {3, 4})
    deliver(1)                                  # a retry of a read message: not unread again
    deliver(5, message_length=30)               # a chunked message counts once it is whole
    assert sorted(ledger.unread) == [2]
    deliver(5, message_length=30, chunk_offset=10)
    deliver(5, message_length=30, chunk_offset=20)
    assert ledger.unread == {2: 10, 5: 30}
    acknowledge(2)
    assert (ledger.read_floor, ledger.read_above) == (4, set())


def test_message_cap_follows_its_formula():
    """cap = 1 MiB + b * max(largest weight, T*V, 4 * max(H*T*(T+N), T*F, V)); the announced
    prompt length replaces job.seq_len."""
    from runtime.distributed.party_front import message_cap_bytes
    config = parse_node_config(node_config(3, "ABY3"))
    cfg = job_lib.build(config.job)[0].cfg
    largest = max(int(np.prod(leaf.shape)) for leaf in
                  __import__("jax").tree_util.tree_leaves(job_lib.weight_shapes(config.job)))
    for T in (32, 500):
        values = max(largest, T * cfg.vocab_size, 4 * max(cfg.num_heads * T * (T + 2),
                                                          T * cfg.intermediate_size,
                                                          cfg.vocab_size))
        assert message_cap_bytes(config, prompt_len=T) == (1 << 20) + 16 * values


def test_link_shape_profiles_reach_the_front(tmp_path):
    """link.shape "lan" / "wan" / explicit -> the front's one-way delay (s) and rate (B/s)."""
    from runtime.distributed.party_front import front_spec
    for shape, delay_s, rate in (("lan", 0.0003, 377e6), ("wan", 0.08, 40e6),
                                 ({"delay_ms": 5}, 0.005, None), (None, 0.0, None)):
        config = parse_node_config(node_config(3, "ABY3", shape=shape))
        spec = front_spec(config, "node:1", tmp_path / "events.jsonl")
        assert spec.delay_s == pytest.approx(delay_s)
        assert spec.rate_bytes_s == (None if rate is None else pytest.approx(rate))


@pytest.mark.parametrize("program", ["front.py", "fast_front"])
def test_the_front_relays_frames_intact_however_the_reads_cut_them(tmp_path, program, request):
    """Frames sent in random pieces (one byte up to several frames at once; 1 MiB chunks of
    one message among small ones, so that the read buffer grows) reach brpc whole, in order,
    byte for byte; a bad frame after them is not relayed, nor anything after it."""
    import random
    import socket
    binary = request.getfixturevalue("fast_front") if program == "fast_front" else None
    proc, spec, backend, received = forge.start_test_front(tmp_path, free_ports(1)[0],
                                                           max_message_bytes=4 << 20,
                                                           fast_front=binary)
    rng = random.Random(7)
    frames = []
    for i in range(1, 41):
        key = f"test.3pc.run:P2P-{i}:0->1".encode()
        if i % 10 == 0:     # one message of two chunks, the first a full 1 MiB
            whole = bytes(rng.getrandbits(8) for _ in range(64)) * ((1 << 20) // 32)
            frames.append(forge.forge_frame(0, key, whole[:1 << 20], seq=i,
                                            message_length=len(whole)))
            frames.append(forge.forge_frame(0, key, whole[1 << 20:], seq=i,
                                            message_length=len(whole), chunk_offset=1 << 20))
        else:
            frames.append(forge.forge_frame(0, key, rng.randbytes(rng.randrange(1, 5000)), seq=i))
    good = b"".join(frames)
    bad = forge.forge_frame(0, b"test.3pc.run:P2P-99:0->2", b"x" * 10, seq=99)   # not to us
    stream = good + bad + forge.forge_frame(0, b"test.3pc.run:P2P-100:0->1", seq=100)
    try:
        with socket.create_connection(("127.0.0.1", spec.listen_port)) as sock:
            at = 0
            while at < len(stream):
                cut = rng.choice((1, 3, 11, 200, 4096, 70_000, 300_000, 2_500_000))
                try:
                    sock.sendall(stream[at:at + cut])
                except OSError:
                    break           # the front closed the connection at the bad frame
                at += cut
            deadline = time.monotonic() + 20
            while sum(map(len, received)) < len(good) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
        assert b"".join(received) == good
        events = [json.loads(line) for line in open(spec.events_path)]
        assert [e["kind"] for e in events] == ["dropped a frame and closed the connection"]
        assert events[0]["node"] == "node:0" and "0->2" in events[0]["why"]
    finally:
        proc.kill()
        proc.wait()
        backend.close()


def test_a_shaping_front_relays_every_frame_intact(tmp_path):
    """With a delay and a rate, the checked frames still reach brpc whole and in order."""
    import socket
    proc, spec, backend, received = forge.start_test_front(
        tmp_path, free_ports(1)[0], spec_overrides={"delay_s": 0.02, "rate_bytes_s": 2e6})
    try:
        frames = [forge.forge_frame(0, f"test.3pc.run:P2P-{i}:0->1".encode(), bytes([i]) * 3000,
                                    seq=i + 1)
                  for i in range(20)]
        with socket.create_connection(("127.0.0.1", spec.listen_port)) as sock:
            for frame in frames:
                sock.sendall(frame)
            deadline = time.monotonic() + 20
            while sum(map(len, received)) < sum(map(len, frames)) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert b"".join(received) == b"".join(frames)
    finally:
        proc.kill()
        proc.wait()
        backend.close()


def test_the_bare_relay_stands_in_for_a_front_in_plain_tcp_only(tmp_path):
    """experiments.front_cost --floor: the C relay with no checks, started by start_front in the
    front's place (its `program`), answers the fronts' hello (a peer's probe finds the party
    alive) and relays bytes both ways; a TLS config refuses any stand-in (so do remote
    peers)."""
    import socket
    from experiments.front_cost import build_bare_relay
    from runtime.distributed.blame import ALIVE, probe
    from runtime.distributed.party_front import start_front
    bare = str(build_bare_relay(tmp_path))
    config = load_node_config(write(tmp_path, node_config(3, "ABY3")))
    handle = start_front(config, "node:1", tmp_path, forge.private_dir(), program=bare)
    try:
        assert probe(config, "node:0", "node:1").state == ALIVE
        with socket.socket(socket.AF_UNIX) as brpc:
            brpc.bind(handle.backend)
            brpc.listen()
            host, _, port = config.address("node:1").rpartition(":")
            with socket.create_connection((host, int(port)), timeout=10) as peer:
                peer.sendall(b"PRPC" + bytes(range(200)))
                inner, _ = brpc.accept()
                with inner:
                    inner.settimeout(10)
                    got = b""
                    while len(got) < 204:
                        got += inner.recv(4096)
                    assert got == b"PRPC" + bytes(range(200))
                    inner.sendall(b"reply")
                    assert peer.recv(16) == b"reply"
        assert handle.stats()["frames"] >= 2      # the stats line: a read each way counted
    finally:
        handle.proc.kill()
        handle.proc.wait()
    (tmp_path / "certs").mkdir()
    subprocess.run(["bash", str(REPO / "scripts" / "make_certs.sh"), str(tmp_path / "certs"),
                    "127.0.0.1", "127.0.0.1"], check=True, capture_output=True)
    tls = load_node_config(write(tmp_path, node_config(2, "SEMI2K", tls=tls_section(
        ["node:0", "node:1"])), "tls.json"))
    with pytest.raises(RuntimeError, match="loopback benchmarks only; leave it out for a TLS run"):
        start_front(tls, "node:1", tmp_path, program=bare)


def test_the_front_process_loads_the_standard_library_only(tmp_path, monkeypatch):
    """A front started with the repository on PYTHONPATH (as the launchers and benchmarks
    start parties) does not load the project's package, and with it JAX: it is up in a
    fraction of a second and small."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    proc, _, backend, _ = forge.start_test_front(tmp_path, free_ports(1)[0])
    try:
        maps = pathlib.Path(f"/proc/{proc.pid}/maps").read_text()
        assert "jaxlib" not in maps and "numpy" not in maps
    finally:
        proc.kill()
        proc.wait()
        backend.close()
