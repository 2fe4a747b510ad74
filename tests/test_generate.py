"""Generation loop, sampling, and the CLI main job on the real model."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import REPO_ROOT
from runtime.generate import SamplingConfig, generate, sample_token
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
    cmd = [sys.executable, "-m", "experiments.run", "--experiment=generate", "--policies=full",
           "--model=llama-9000"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "unknown model 'llama-9000'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag,message", [
    ("--budgets=2.5", "must be a whole number"),
    ("--budgets=ten", "is not a number"),
    ("--budgets=0.1min", "write RATIOminTOKENS, e.g. 0.1min384"),
    ("--budgets=64min384", "a token count needs no floor"),
    ("--policies=full,orcale", "unknown policy 'orcale'"),
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
    --resume keeps finished records and runs only the missing ones, a budget with a floor
    (0.1min100: 100 of the 300 tokens, not 30) among them, and a larger --num_samples extends
    a run (the chunked run made sample 0 only; the resume adds sample 1)."""
    outputs = {}
    for run, extra in (("all", ["--policy_chunk=0", "--num_samples=2"]),
                       ("chunked", ["--policy_chunk=1", "--num_samples=1"]),
                       ("resumed", ["--policy_chunk=2", "--resume", "--num_samples=2"])):
        out = tmp_path / ("chunked" if run == "resumed" else run)
        if run == "resumed":   # as if the chunked run had been killed after 2 records
            lines = (out / "samples.jsonl").read_text().splitlines()
            (out / "samples.jsonl").write_text("\n".join(lines[:2]) + "\n")
        cmd = [sys.executable, "-m", "experiments.run", "--experiment=accuracy",
               "--model=smollm2-135m", "--task=passkey", "--lengths=300",
               "--depths=0.3,0.8", "--policies=full,streaming_llm", "--budgets=0.1min100,0.5",
               "--max_new_tokens=8", f"--output_dir={out}", *extra]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        outputs[run] = sorted((r["sample_id"], r["policy"], str(r["budget"]), r["output"],
                               r["score"]) for r in records)
        if run == "resumed":
            assert "resuming: 2 finished" in proc.stdout
            results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
            assert sorted(r["n"] for r in results) == [2, 2, 2]
    # 2 samples x (full + streaming_llm at two budgets)
    assert len(outputs["all"]) == 2 * 3
    assert {o[2] for o in outputs["all"]} == {"1.0", "0.5", "0.1min100"}
    assert outputs["chunked"] == [o for o in outputs["all"] if o[0] == outputs["chunked"][0][0]]
    assert len(outputs["chunked"]) == 3 and outputs["all"] == outputs["resumed"]
    assert len({o[3] for o in outputs["all"]}) > 1  # the policies do not all say the same thing


@pytest.mark.parametrize("argv,message", [
    (["--experiment=generate", "--task=passkey"], "--task is not used by --experiment=generate"),
    (["--experiment=generate", "--policies=full", "--resume", "--num_samples=3"],
     "--num_samples, --resume are not used by --experiment=generate"),
    (["--experiment=accuracy", "--backend=xla"], "--backend is not used by --experiment=accuracy"),
    (["--experiment=accuracy", "--prompt=hi"], "--prompt is not used by --experiment=accuracy"),
    (["--experiment=mpc_cost", "--resume"], "--resume is not used by --experiment=mpc_cost"),
    (["--experiment=accuracy", "--backend=spu_nodes", "--node_config=x.json", "--num_samples=2"],
     "--num_samples is not used by --backend=spu_nodes"),
    (["--experiment=generate", "--backend=spu_nodes", "--policies=full",
      "--node_config=experiments/nodes/2pc_semi2k.json", "--protocol=ABY3"],
     "--protocol=ABY3 conflicts with --node_config=experiments/nodes/2pc_semi2k.json, which "
     "runs SEMI2K"),
    (["--experiment=mpc_cost", "--policies=full,foo", "--model=llama-tiny"],
     "unknown policy 'foo'"),
    (["--experiment=generate", "--backend=spu_nodes", "--policies=full",
      "--node_config=experiments/nodes/3pc_aby3.json", "--activation_impl=newton"],
     "--activation_impl is not used by --backend=spu_nodes"),
    (["--experiment=generate", "--policies=full", "--budgets=0.1"],
     "--policies=full keeps the whole cache: drop --budgets"),
])
def test_cli_refuses_flags_it_would_ignore_or_that_conflict(argv, message, tmp_path):
    cmd = [sys.executable, "-m", "experiments.run", f"--output_dir={tmp_path / 'out'}", *argv]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "results.jsonl").exists()


def _shipped_flagfiles():
    """(path, {flag: value or None}) for every experiments/flags/*.flags."""
    import re
    for path in sorted((REPO_ROOT / "experiments" / "flags").glob("*.flags")):
        given = {}
        for line in path.read_text().splitlines():
            m = re.match(r"--([a-z_]+)(?:=(.*))?$", line.strip())
            if m:
                given[m.group(1)] = m.group(2)
        yield path, given


def test_every_shipped_flagfile_uses_only_flags_its_experiment_reads():
    from experiments import flags_def
    checked = 0
    for path, given in _shipped_flagfiles():
        if "party" in given:      # experiments.party's own flags
            continue
        experiment = given.get("experiment", "generate")
        key = ("nodes" if given.get("backend") == "spu_nodes" and experiment != "generate"
               else experiment)
        known = flags_def.EXPERIMENT_FLAGS[key] | {f"no{n}" for n in flags_def.EXPERIMENT_FLAGS[key]}
        assert set(given) <= known, (path.name, sorted(set(given) - known))
        checked += 1
    assert checked >= 10


def test_every_shipped_flagfile_names_registered_policies_that_construct():
    """A flag file naming a policy (or a --variants option) the registry no longer has fails
    here, not an hour into a run."""
    from experiments.options import parse_budget, parse_variants
    from mpcache_jax.policies import make_policy
    checked = 0
    for path, given in _shipped_flagfiles():
        if not given.get("policies"):
            continue
        budgets = [parse_budget(b) for b in given.get("budgets", "0.1").split(",")]
        for label, name, options in parse_variants(given["policies"].split(","),
                                                   given.get("variants") or None):
            if "calibration" in options:   # a file the flag file's comment says how to make
                options = {**options, "calibration": None}
            for budget in budgets:
                try:
                    make_policy(name, budget, **options)
                except (ValueError, TypeError) as err:
                    if "cannot hold" in str(err):   # a too-small budget is a runtime skip
                        continue
                    raise AssertionError(f"{path.name}: {label}: {err}") from err
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("variants,message", [
    ('{"x": {"policy": "mpcache", "budget": 64}}', "sets 'budget'; budgets come from --budgets"),
    ('{"x": 3}', "entry 'x' must be an object"),
    ('[1]', "must be a JSON object"),
    ('{"x": {"refresh_every": 2}}', "needs a 'policy' field"),
])
def test_a_bad_variants_entry_is_a_one_line_error(variants, message):
    from experiments.options import parse_variants
    with pytest.raises(SystemExit, match=message):
        parse_variants(["full"], variants)


@pytest.mark.parametrize("text,message", [
    ("", "no samples"),
    ('{"context": "a", "input": "b", "answers": ["c"]}\n{"context": "a", "input": \n',
     ":2: not a JSON object"),
    ('{"context": "a", "answers": ["c"]}\n', ":1: no 'input' field"),
    ('[1, 2]\n', ":1: a line must be a JSON object"),
])
def test_longbench_input_errors_name_file_and_line(tmp_path, text, message):
    from experiments.tasks import longbench_jsonl

    class Tok:
        def encode(self, text):
            return [1] * len(text.split())

        def encode_request(self, text, chat=True, system=None):
            return self.encode(text)
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        list(longbench_jsonl(Tok(), data_path=str(path), num_samples=5, max_length=100,
                             metric="contains", chat=False))
    assert str(path) in str(err.value) and message in str(err.value)


def test_output_dir_that_is_a_file_is_refused_before_any_work(tmp_path):
    from experiments.common import ensure_dir
    target = tmp_path / "results"
    target.write_text("not a directory")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        ensure_dir(target)


def test_resume_refuses_records_made_with_other_settings(tmp_path):
    from experiments.accuracy_store import load_finished
    from experiments.common import config_hash
    then = {"seed": 0, "max_new_tokens": 24, "model": "smollm2-135m"}
    records = [{"task": "qa", "sample_id": f"qa-{i}", "policy": "full", "budget": 1.0,
                "config_hash": config_hash(then)} for i in range(3)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "run_config.json").write_text(json.dumps(then))
    assert load_finished(tmp_path, dict(then)) == records
    with pytest.raises(ValueError) as err:
        load_finished(tmp_path, {**then, "seed": 1, "max_new_tokens": 8})
    assert "3 of 3 records" in str(err.value)
    assert "--max_new_tokens (24 then, 8 now)" in str(err.value)
    assert "--seed (0 then, 1 now)" in str(err.value)
    # an interrupted run's partial file is what a resume continues from
    (tmp_path / "samples.jsonl.partial").write_text(json.dumps(records[0]) + "\n")
    assert load_finished(tmp_path, dict(then)) == records[:1]


@pytest.mark.slow
def test_an_interrupted_accuracy_run_leaves_the_previous_results_intact(tmp_path):
    """A finished run, then a second run into the same folder killed after its first record:
    results.jsonl / samples.jsonl / summary.csv are byte-for-byte the first run's."""
    import os
    import signal
    import time
    base = [sys.executable, "-m", "experiments.run", "--experiment=accuracy",
            "--model=smollm2-135m", "--num_layers=2", "--task=passkey", "--lengths=200",
            "--max_new_tokens=4", f"--output_dir={tmp_path}"]
    proc = subprocess.run([*base, "--num_samples=1", "--policies=full"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before = {name: (tmp_path / name).read_bytes()
              for name in ("results.jsonl", "samples.jsonl", "summary.csv")}
    # one sample per batch, so the run is still going after its first record
    second = subprocess.Popen([*base, "--num_samples=6", "--policies=full,streaming_llm",
                               "--budgets=0.5", "--batch_size=1"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    partial = tmp_path / "samples.jsonl.partial"
    deadline = time.time() + 500
    while time.time() < deadline and second.poll() is None:
        if partial.exists() and partial.read_text().count("\n") >= 1:
            break
        time.sleep(0.2)
    assert second.poll() is None, "the second run ended before it could be interrupted"
    os.killpg(second.pid, signal.SIGKILL)
    second.wait()
    assert partial.read_text().count("\n") >= 1
    for name, content in before.items():
        assert (tmp_path / name).read_bytes() == content, name


def test_first_divergence_reports_where_and_by_how_much():
    import types
    from experiments.generate import NEAR_TIE_LOGITS, first_divergence
    logits = [np.zeros(5), np.array([0.0, 0.0, 1.0, 1.0 - NEAR_TIE_LOGITS / 2, 0.0]),
              np.array([0.0, 3.0, 0.0, 0.0, 0.0])]
    plain = types.SimpleNamespace(tokens=[1, 2, 1], logits=logits)
    tie = first_divergence([1, 3, 1], plain)
    assert (tie["step"], tie["plaintext_token"], tie["secure_token"]) == (1, 2, 3)
    assert tie["margin"] == pytest.approx(NEAR_TIE_LOGITS / 2) and tie["near_tie"]
    wrong = first_divergence([1, 2, 4], plain)
    assert wrong["step"] == 2 and wrong["margin"] == pytest.approx(3.0) and not wrong["near_tie"]
    shorter = first_divergence([1, 2], plain)
    assert shorter["step"] == 2 and not shorter["near_tie"]
