"""`mpcache pooled` (experiments/pooled.py): several fidelity runs' scores pooled per task, each
policy's pooled score against the reference's with a paired-bootstrap interval; runs that do
not pool (other model or length, one sample scored two ways) are refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import pooled


def _write_run(folder, records, *, model="m", lengths=("2048",), seed=0, data_path=None):
    folder.mkdir(parents=True)
    (folder / "run_config.json").write_text(json.dumps(
        {"model": model, "lengths": list(lengths), "seed": seed, "data_path": data_path}))
    (folder / "samples.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))
    return str(folder)


def _records(task, scores_by_policy, metric="contains", kl=0.1):
    out = []
    for policy, scores in scores_by_policy.items():
        for i, score in enumerate(scores):
            out.append({"task": task, "sample_id": f"{task}-{i}", "policy": policy,
                        "score": score, "metric": metric, "agree": 1.0 if policy == "full"
                        else 0.5, "kl": 0.0 if policy == "full" else kl})
    return out


def test_pooled_score_is_the_mean_of_task_means_over_runs(tmp_path):
    """Two runs (seeds 0 and 1) of one task pool their samples: the task's mean is over all
    six; a second task weighs the same as the first however many samples it has."""
    a = _write_run(tmp_path / "a", _records("qa", {"full": [1, 0, 1], "x": [1, 1, 0]}) +
                   _records("hop", {"full": [1, 1], "x": [0, 1]}))
    b = _write_run(tmp_path / "b", _records("qa", {"full": [0, 0, 1], "x": [1, 0, 0]}), seed=1)
    rows, tasks = pooled.summarize(pooled.load_runs([a, b]), resamples=200)
    assert tasks == ["hop", "qa"]
    full, x = rows
    assert (full["policy"], x["policy"]) == ("full", "x")
    assert full["qa"] == pytest.approx(3 / 6) and x["qa"] == pytest.approx(3 / 6)
    assert full["hop"] == 1.0 and x["hop"] == 0.5
    assert full["pooled"] == pytest.approx((1.0 + 0.5) / 2)
    assert x["pooled"] == pytest.approx((0.5 + 0.5) / 2)
    assert x["ratio"] == pytest.approx(0.5 / 0.75)
    assert (x["qa_n"], x["hop_n"]) == (6, 2)
    assert (x["qa_wins"], x["qa_losses"], x["hop_wins"], x["hop_losses"]) == (2, 2, 0, 1)
    assert x["kl"] == pytest.approx(0.1) and full["kl"] == 0.0
    assert x["ratio_lo"] <= x["ratio"] <= x["ratio_hi"]


def test_the_interval_is_paired_and_collapses_when_the_scores_agree(tmp_path):
    """Equal scores on every sample: every bootstrap draw gives a ratio of exactly 1. A policy
    that scores half of the reference's on every sample: exactly 0.5 in every draw (an
    unpaired draw would scatter it)."""
    rng = np.random.default_rng(0)
    ref = rng.uniform(0.1, 1.0, 40).round(3).tolist()
    run = _write_run(tmp_path / "a", _records("qa", {"full": ref, "same": ref,
                                                     "half": [s / 2 for s in ref]}))
    rows, _ = pooled.summarize(pooled.load_runs([run]), resamples=300)
    by = {r["policy"]: r for r in rows}
    assert by["same"]["ratio_lo"] == by["same"]["ratio_hi"] == pytest.approx(1.0)
    assert by["half"]["ratio_lo"] == pytest.approx(0.5)
    assert by["half"]["ratio_hi"] == pytest.approx(0.5)


def test_the_interval_covers_what_the_samples_leave_open(tmp_path):
    """A policy that wins and loses samples against the reference: the interval is wide and
    holds the point estimate."""
    rng = np.random.default_rng(1)
    ref = (rng.uniform(size=30) < 0.4).astype(float).tolist()
    other = (rng.uniform(size=30) < 0.4).astype(float).tolist()
    run = _write_run(tmp_path / "a", _records("qa", {"full": ref, "x": other}))
    (_, x), _ = pooled.summarize(pooled.load_runs([run]), resamples=500)
    assert x["ratio_lo"] < x["ratio"] < x["ratio_hi"]
    assert x["ratio_hi"] - x["ratio_lo"] > 0.3


def test_perplexity_tasks_are_kept_apart_from_the_pooled_score(tmp_path):
    run = _write_run(tmp_path / "a", _records("qa", {"full": [1, 0], "x": [1, 1]}) +
                     _records("continuation", {"full": [20.0, 30.0], "x": [21.0, 33.0]},
                              metric="ppl"))
    rows, tasks = pooled.summarize(pooled.load_runs([run]), resamples=50)
    assert tasks == ["qa"]
    x = rows[1]
    assert x["pooled"] == 1.0 and x["ratio"] == 2.0
    assert x["continuation"] == pytest.approx(27.0)
    assert x["continuation_ratio"] == pytest.approx(27.0 / 25.0)
    text = pooled.format_table(rows, tasks, "full")
    assert "27.00 (1.080x)" in text and "2.00x" in text


def test_only_samples_every_shown_policy_has_are_counted(tmp_path):
    """Run b lacks policy y: with y shown, b adds nothing; without it, b's samples count."""
    a = _write_run(tmp_path / "a", _records("qa", {"full": [1, 1], "x": [1, 0], "y": [0, 0]}))
    b = _write_run(tmp_path / "b", _records("qa", {"full": [0, 0], "x": [1, 1]}), seed=1)
    records = pooled.load_runs([a, b])
    rows, _ = pooled.summarize(records, resamples=10)
    assert [r["qa_n"] for r in rows] == [2, 2, 2]
    rows, _ = pooled.summarize(records, policies=["full", "x"], resamples=10)
    assert [r["qa_n"] for r in rows] == [4, 4]
    assert rows[1]["qa"] == pytest.approx(3 / 4)


def test_renames_apply_to_every_run_or_to_one(tmp_path):
    a = _write_run(tmp_path / "a", _records("qa", {"full": [1, 0], "d8r3": [1, 1],
                                                   "mpcache": [0, 0]}))
    b = _write_run(tmp_path / "b", _records("qa", {"full": [1, 1], "mpcache": [1, 0]}), seed=1)
    renames = pooled.parse_renames([f"{a}/mpcache:old", f"{a}/d8r3:mpcache"])
    rows, _ = pooled.summarize(pooled.load_runs([a, b], renames), policies=["full", "mpcache"],
                               resamples=10)
    assert rows[1]["qa"] == pytest.approx(3 / 4) and rows[1]["qa_n"] == 4
    with pytest.raises(ValueError, match="two budgets of a renamed policy"):
        pooled.load_runs([a], pooled.parse_renames(["d8r3:mpcache"]))
    with pytest.raises(ValueError, match="give OLD:NEW"):
        pooled.parse_renames(["d8r3"])
    with pytest.raises(ValueError, match="is not one of --runs"):
        pooled.load_runs([b], pooled.parse_renames([f"{a}/d8r3:mpcache"]))


def test_runs_that_do_not_pool_are_refused_with_the_reason(tmp_path):
    a = _write_run(tmp_path / "a", _records("qa", {"full": [1], "x": [0]}))
    other_len = _write_run(tmp_path / "b", _records("qa", {"full": [1], "x": [0]}),
                           lengths=("8192",), seed=1)
    with pytest.raises(ValueError, match="--lengths"):
        pooled.load_runs([a, other_len])
    other_model = _write_run(tmp_path / "c", _records("qa", {"full": [1], "x": [0]}),
                             model="n", seed=1)
    with pytest.raises(ValueError, match="--model"):
        pooled.load_runs([a, other_model])
    disagree = _write_run(tmp_path / "d", _records("qa", {"full": [1], "x": [1]}))
    with pytest.raises(ValueError, match="x on qa sample qa-0 .*0 in .*a, 1 in .*d"):
        pooled.load_runs([a, disagree])
    with pytest.raises(ValueError, match="does not exist"):
        pooled.load_runs([str(tmp_path / "absent")])
    with pytest.raises(ValueError, match="--reference=nope"):
        pooled.summarize(pooled.load_runs([a]), reference="nope")


def test_runs_of_the_same_samples_line_up_and_other_data_files_add_samples(tmp_path):
    """Two runs of the same seed with other policies: one row per policy on the same samples
    (full, in both, counted once). LongBench-format runs of two data files: two samples. A
    --data_path does not make the seeded tasks' samples other ones."""
    a = _write_run(tmp_path / "a", _records("qa", {"full": [1, 0], "x": [1, 1]}))
    b = _write_run(tmp_path / "b", _records("qa", {"full": [1, 0], "y": [0, 0]}),
                   data_path="other.jsonl")
    rows, _ = pooled.summarize(pooled.load_runs([a, b]), resamples=10)
    assert [(r["policy"], r["qa_n"], r["qa"]) for r in rows] == [
        ("full", 2, 0.5), ("x", 2, 1.0), ("y", 2, 0.0)]
    lb = lambda s: _records("longbench_jsonl", {"full": [1], "x": [s]})   # noqa: E731
    c = _write_run(tmp_path / "c", lb(0), data_path="lb_a.jsonl")
    d = _write_run(tmp_path / "d", lb(1), data_path="lb_b.jsonl")
    rows, _ = pooled.summarize(pooled.load_runs([c, d]), resamples=10)
    assert rows[1]["longbench_jsonl_n"] == 2 and rows[1]["longbench_jsonl"] == 0.5


def test_the_command_prints_the_table_and_writes_csv(tmp_path, capsys):
    run = _write_run(tmp_path / "a", _records("qa", {"full": [1, 0, 1], "x": [1, 0, 0]}))
    out = tmp_path / "t.csv"
    assert pooled.main(["mpcache pooled", f"--runs={run}", f"--out={out}",
                        "--resamples=100"]) == 0
    text = capsys.readouterr().out
    assert "| `x` | 0.333 (+0 -1) | 0.333 | 0.50x [" in text
    assert out.read_text().splitlines()[0].startswith("policy,")
    with pytest.raises(SystemExit) as stop:
        pooled.main(["mpcache pooled", f"--runs={run}", "--policies=full,nope"])
    assert stop.value.code == 2
    assert "--policies: nope not in the runs" in capsys.readouterr().err
