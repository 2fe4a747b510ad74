"""Generation loop, sampling, and the CLI main job on the real model."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import REPO_ROOT
from mpcache_jax.generate import SamplingConfig, generate, sample_token
from models import registry


def test_sampling_rules():
    logits = jnp.asarray([0.0, 3.0, 2.9, -1.0])
    key = jax.random.PRNGKey(0)
    assert int(sample_token(logits, key, 0.0, 1.0)) == 1
    # A tiny top-p keeps only the most likely token, whatever the temperature.
    draws = {int(sample_token(logits, k, 5.0, 0.01)) for k in jax.random.split(key, 20)}
    assert draws == {1}
    # With top_p = 1 and a high temperature, other tokens appear.
    draws = {int(sample_token(logits, k, 5.0, 1.0)) for k in jax.random.split(key, 50)}
    assert len(draws) > 2
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1.0)


def test_generate_greedy_matches_forward_argmax():
    lm = registry.load("llama-tiny")
    prompt = list(np.random.RandomState(0).randint(0, 256, size=20))
    result = generate(lm.model, lm.params, prompt, max_new_tokens=6)
    seq = prompt + result.tokens
    logits = np.asarray(lm.model.forward(lm.params, seq))
    assert result.tokens == [int(x) for x in logits[len(prompt) - 1:-1].argmax(-1)]
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(lm.model, lm.params, prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="context"):
        generate(lm.model, lm.params, prompt, max_new_tokens=lm.model.cfg.max_position)


@pytest.mark.slow
def test_capital_of_france_is_paris():
    lm = registry.load("smollm2-135m")
    tok = lm.tokenizer
    ids = tok.encode_chat("What is the capital of France?")
    result = generate(lm.model, lm.params, ids, max_new_tokens=24, stop_ids=tok.stop_ids)
    answer = tok.decode(result.tokens)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_cli_main_job_writes_results(tmp_path):
    cmd = [sys.executable, "-m", "experiments.run", "--flagfile=experiments/flags/chat.flags",
           "--max_new_tokens=12", f"--output_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 1
    record = records[0]
    assert record["text"] and record["text"] in proc.stdout
    assert len(record["tokens"]) <= 12 and all(isinstance(t, int) for t in record["tokens"])
    assert "Paris" in record["text"]


def test_cli_rejects_unknown_model():
    cmd = [sys.executable, "-m", "experiments.run", "--experiment=generate", "--model=llama-9000"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "unknown model 'llama-9000'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag,message", [
    ("--budgets=2.5", "must be a whole number"),
    ("--budgets=ten", "is not a number"),
    ("--policies=full,oracle", "unknown policy 'oracle'"),
    ("--variants={bad json", "not valid JSON"),
    ("--lengths=1400,long", "--lengths=1400,long: every entry must be a whole number"),
    ("--task=passkey,riddles", "unknown task(s) ['riddles']"),
    ("--task=needle,needle", "lists a task twice"),
    ("--backend=spu_nodes", "needs --node_config=FILE"),
])
def test_accuracy_cli_rejects_bad_flags_before_loading(flag, message):
    cmd = [sys.executable, "-m", "experiments.run", "--experiment=accuracy", "--model=llama-tiny",
           flag]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_accuracy_policy_chunks_and_resume_give_the_same_records(tmp_path):
    """--policy_chunk only changes when programs are compiled and freed, not any result;
    --resume keeps finished records and runs only the missing ones."""
    outputs = {}
    for run, extra in (("all", ["--policy_chunk=0"]), ("chunked", ["--policy_chunk=1"]),
                       ("resumed", ["--policy_chunk=2", "--resume"])):
        out = tmp_path / ("chunked" if run == "resumed" else run)
        if run == "resumed":   # as if the chunked run had been killed after 2 records
            lines = (out / "samples.jsonl").read_text().splitlines()
            (out / "samples.jsonl").write_text("\n".join(lines[:2]) + "\n")
        cmd = [sys.executable, "-m", "experiments.run", "--experiment=accuracy",
               "--model=smollm2-135m", "--task=passkey", "--num_samples=2", "--lengths=300",
               "--depths=0.3,0.8", "--policies=full,streaming_llm", "--budgets=0.2,0.5",
               "--max_new_tokens=8", f"--output_dir={out}", *extra]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        outputs[run] = sorted((r["sample_id"], r["policy"], r["budget"], r["output"], r["score"])
                              for r in records)
        if run == "resumed":
            assert "resuming: 2 finished" in proc.stdout
            results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
            assert sorted(r["n"] for r in results) == [2, 2, 2]
    # 2 samples x (full + streaming_llm at two budgets)
    assert len(outputs["all"]) == 2 * 3
    assert outputs["all"] == outputs["chunked"] == outputs["resumed"]
    assert len({o[3] for o in outputs["all"]}) > 1  # the policies do not all say the same thing
