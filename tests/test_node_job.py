"""`--backend=spu_nodes` runs (experiments/node_job.py): the node config's job decides every
field no flag given overrides; an impossible job fails before any party starts (exit 2, one
line naming the flag and what fits); a party failing mid-run is one line and exit 3 for
every experiment.

The runs that start parties use loopback copies of the configs on free ports.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from experiments import node_job
from experiments.faults import harness
from models import registry
from mpcache_jax.policies import POLICY_NAMES
from runtime.distributed import JobSpec
from runtime.distributed import bounds
from runtime.distributed.launch import free_ports

REPO = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = REPO / "experiments" / "nodes" / "3pc_aby3.json"


@pytest.fixture
def parse():
    """Parse experiments.run's flags in this process (`FLAGS[name].present` as on a command
    line); every flag back to its default afterwards."""
    from experiments.flags_def import FLAGS

    def parse_flags(*argv):
        FLAGS.unparse_flags()
        FLAGS(["run", *argv])
        return FLAGS
    yield parse_flags
    FLAGS.unparse_flags()


def on_free_ports(tmp_path: pathlib.Path, raw: dict, name: str = "nodes.json") -> pathlib.Path:
    """`raw` with its parties on ports free now, written to tmp_path/name."""
    raw = json.loads(json.dumps(raw))
    for pid, port in zip(list(raw["nodes"]), free_ports(len(raw["nodes"]))):
        raw["nodes"][pid] = f"127.0.0.1:{port}"
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def run_cli(*argv, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.run", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ----- the config's job decides unless a flag says otherwise ---------------------------------

def test_flag_defaults_never_override_the_job(parse):
    """--policies given: policy from the flag; the budget, model, prompt length and new tokens
    stay the config's although --budgets, --model and --max_new_tokens have defaults."""
    flags = parse("--backend=spu_nodes", f"--node_config={SHIPPED}", "--policies=mpcache")
    plan = node_job.plan_jobs(flags)
    assert plan.jobs == [{"policy": "mpcache"}]
    job = plan.config.with_job(**plan.jobs[0]).job
    assert (job.model, job.budget, job.seq_len, job.max_new_tokens) == ("llama-tiny", 0.5, 64, 2)
    line = node_job.describe(plan, str(SHIPPED))
    assert "budget=0.5" in line and "policy=mpcache (--policies, the config's too)" in line


def test_every_flag_given_overrides_its_field_and_is_printed(parse, tmp_path):
    flagfile = tmp_path / "nodes.flags"
    flagfile.write_text("--budgets=48\n--max_new_tokens=3\n")
    flags = parse("--backend=spu_nodes", f"--node_config={SHIPPED}", f"--flagfile={flagfile}",
                  "--model=llama-tiny", "--num_layers=1", "--seed=7")
    plan = node_job.plan_jobs(flags)
    assert plan.jobs == [{"model": "llama-tiny", "num_layers": 1, "max_new_tokens": 3,
                          "seed": 7, "budget": 48}]
    line = node_job.describe(plan, str(SHIPPED))
    for text in ("budget=48 (--budgets)", "max_new_tokens=3 (--max_new_tokens)",
                 "num_layers=1 (--num_layers)", "seed=7 (--seed)"):
        assert text in line, line


def test_sweeps_run_the_job_per_policy_budget_and_length(parse):
    """accuracy / mpc_cost: one job per --policies x --budgets x --seq_lens entry; `full`
    keeps the whole cache, so it runs once per length whatever --budgets says."""
    flags = parse("--experiment=mpc_cost", "--backend=spu_nodes", f"--node_config={SHIPPED}",
                  "--policies=full,mpcache", "--budgets=0.25,0.1min32", "--seq_lens=64,128")
    plan = node_job.plan_jobs(flags)
    assert plan.jobs == [{"policy": "full", "seq_len": 64}, {"policy": "full", "seq_len": 128},
                         *({"policy": "mpcache", "budget": b, "seq_len": t}
                           for b in (0.25, "0.1min32") for t in (64, 128))]


@pytest.mark.parametrize("argv,says", [
    (["--max_new_tokens=4090"], "--max_new_tokens=4090 = 4154 exceeds llama-tiny's context"),
    (["--experiment=accuracy", "--seq_lens=64,5000"], "--seq_lens=5000 + job.max_new_tokens=2"),
    (["--policies=mpcache", "--budgets=2"], "the smallest budget that serves the job's "
     "64-token prompt is --budgets=4 (4 tokens)"),
    (["--policies=orcale"], "--policies=orcale is unknown"),
    (["--model=llama-9000"], "--model=llama-9000 is unknown"),
    (["--prompt=hello"], "--prompt: the node config's job.model=llama-tiny has no tokenizer"),
    (["--policies=full", "--budgets=0.5"], "--policies=full keeps the whole cache: drop "
     "--budgets"),
])
def test_an_impossible_job_names_the_flag_before_any_party_starts(parse, monkeypatch, argv,
                                                                  says):
    import runtime.distributed.launch as launch

    def never(*args, **kwargs):
        raise AssertionError("a party was started")
    monkeypatch.setattr(launch, "start_parties", never)
    monkeypatch.setattr(launch, "run_loopback", never)
    flags = parse("--backend=spu_nodes", f"--node_config={SHIPPED}", *argv)
    with pytest.raises(ValueError) as info:
        node_job.run(flags)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(not registry.is_cached("smollm2-135m"), reason="SmolLM2 not fetched")
def test_a_prompt_text_sets_the_length_the_job_is_checked_at(parse):
    """--prompt: the job's seq_len is the prompt's token count (counted as the prompt owner
    will count it); a budget too small for it names --budgets and the prompt."""
    flags = parse("--backend=spu_nodes", f"--node_config={SHIPPED}", "--model=smollm2-135m",
                  "--prompt=What is the capital of France?")
    plan = node_job.plan_jobs(flags)
    tokenizer = registry.load("smollm2-135m").tokenizer
    count = len(tokenizer.encode_request("What is the capital of France?", chat=True))
    assert plan.jobs == [{"model": "smollm2-135m", "seq_len": count, "prompt_ids": None}]
    assert f"seq_len={count} (the --prompt's tokens)" in node_job.describe(plan, "x")
    flags = parse("--backend=spu_nodes", f"--node_config={SHIPPED}", "--model=smollm2-135m",
                  "--prompt=What is the capital of France?", "--budgets=2")
    with pytest.raises(ValueError, match=rf"--budgets=2: .*serves the job's {count}-token"):
        node_job.plan_jobs(flags)


def test_smallest_budget_is_what_a_scan_finds_for_every_policy():
    """The binary search of bounds.smallest_budget (which assumes that a policy serving a
    budget serves every larger one) gives the first budget a scan of every token count
    finds, for every registered policy."""
    checked = 0
    for name in POLICY_NAMES:
        for T in (64, 200):
            job = JobSpec(policy=name, budget=None, seq_len=T)
            scan = next((k for k in range(1, T + 1) if bounds._serves(job, k, T)), None)
            counts = bounds.smallest_budget(job, T, ratio=False)
            assert (counts and counts[0]) == scan, (name, T)
            ratios = bounds.smallest_budget(job, T, ratio=True)
            if scan is None:
                assert ratios is None
                continue
            ratio, tokens = ratios
            assert tokens == scan and bounds._serves(job, ratio, T), (name, T)
            checked += 1
    assert checked >= len(POLICY_NAMES)


# ----- the acceptance checks, as a user runs them -----------------------------------

def test_the_shipped_job_runs_with_its_own_budget(tmp_path):
    """`--policies=mpcache` and nothing else: the config's budget 0.5 (not --budgets' default),
    prompt length and new tokens; the records say so."""
    config = on_free_ports(tmp_path, json.loads(SHIPPED.read_text()))
    out = tmp_path / "out"
    proc = run_cli("--backend=spu_nodes", f"--node_config={config}", "--policies=mpcache",
                   f"--output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "policy=mpcache (--policies, the config's too)" in proc.stdout
    summary = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()][-1]
    assert summary["summary"] and summary["budget"] == 0.5 and summary["policy"] == "mpcache"
    assert summary["model"] == "llama-tiny" and summary["prompt_tokens"] == 64
    assert len(summary["tokens"]) == 2


def test_an_impossible_budget_exits_2_naming_the_smallest_that_fits(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("--backend=spu_nodes", f"--node_config={SHIPPED}", "--policies=mpcache",
                   "--budgets=0.01", f"--output_dir={out}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = error_lines(proc.stderr)
    assert line.startswith("error: --budgets=0.01: ") and "Traceback" not in proc.stderr
    assert "the smallest budget that serves the job's 64-token prompt is --budgets=0.05 " \
           "(4 tokens; or --budgets=4, a token count)" in line
    # The launcher never ran: it writes the effective config and a log per party first.
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.parametrize("experiment", ["generate", "accuracy", "mpc_cost"])
def test_a_party_killed_mid_run_is_one_line_and_exit_3(tmp_path, experiment):
    """node:2 killed once its link is up: every experiment's run ends with one `error:` line
    naming it, exit 3, no traceback, no results."""
    raw = harness.node_config(3, "ABY3", job={"max_new_tokens": 4}, peer_timeout_s=3)
    config = on_free_ports(tmp_path, raw)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.run",
                             f"--experiment={experiment}", "--backend=spu_nodes",
                             f"--node_config={config}", f"--output_dir={out}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while "link up" not in harness.log_text(out, "node:2"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.1)
        victims = harness.processes_mentioning(f"--party=node:2 --output_dir={out}")
        assert victims
        for pid in victims:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, stderr[-3000:]
    [line] = error_lines(stderr)
    assert line.startswith("error: secure job failed: party node:2 failed: "), line
    assert "Traceback" not in stderr
    assert not (out / "results.jsonl").exists()
