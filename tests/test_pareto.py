"""The accuracy-vs-cost join: Pareto front and the fidelity / cost readers on small files."""
import csv
import json

import pytest

from experiments import pareto


def test_pareto_front_keeps_exactly_the_undominated_points():
    # (cost, quality): b dominates c (cheaper, better); d ties a on cost with less quality;
    # e is the most expensive but the best; a is the cheapest.
    points = {"a": (1.0, 0.2), "b": (2.0, 0.6), "c": (3.0, 0.5), "d": (1.0, 0.1),
              "e": (9.0, 1.0), "f": (2.0, 0.6)}
    names = list(points)
    front = [names[i] for i in pareto.pareto_front(list(points.values()))]
    assert front == ["a", "b", "f", "e"]       # equal points do not dominate each other


def test_join_reads_both_runs_and_marks_the_front(tmp_path):
    fid = tmp_path / "fid"
    fid.mkdir()
    rows = [("t1", "full", 1.0, 0.5, 0.5, 1.0, 0.0), ("t2", "full", 1.0, 0.4, 0.4, 1.0, 0.0),
            ("t1", "cheap", 0.1, 0.1, 0.5, 0.0, 1.5), ("t2", "cheap", 0.1, 0.2, 0.4, 0.5, 0.5),
            ("t1", "cheap", 0.05, 0.0, 0.5, 0.0, 3.0), ("t2", "cheap", 0.05, 0.0, 0.4, 0.0, 3.0),
            ("t1", "good", 0.1, 0.5, 0.5, 1.0, 0.1), ("t2", "good", 0.1, 0.4, 0.4, 0.5, 0.2)]
    with open(fid / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["task", "policy", "budget", "score", "full_score", "agree", "agree_prefix",
                    "kl", "n", "skipped"])
        for task, pol, b, score, full, agree, kl in rows:
            w.writerow([task, pol, b, score, full, agree, agree, kl, 12, 0])
    fidelity = pareto.read_fidelity(fid / "summary.csv", 0.1)
    assert set(fidelity) == {"full", "cheap", "good"}
    only_t2 = pareto.read_fidelity(fid / "summary.csv", 0.1, ["t2"])
    assert abs(only_t2["cheap"]["agree"] - 0.5) < 1e-9 and abs(only_t2["cheap"]["kl"] - 0.5) < 1e-9
    with pytest.raises(SystemExit, match="has tasks"):
        pareto.read_fidelity(fid / "summary.csv", 0.1, ["t1", "t3"])
    assert abs(fidelity["cheap"]["agree"] - 0.25) < 1e-9 and abs(fidelity["cheap"]["kl"] - 1.0) < 1e-9
    # pooled: the sum of its task scores over full's on the same samples, (0.1 + 0.2) / 0.9
    assert abs(fidelity["cheap"]["score_over_full"] - 0.3 / 0.9) < 1e-9
    assert abs(fidelity["good"]["score_over_full"] - 1.0) < 1e-9
    cost = tmp_path / "results.jsonl"
    recs = [("full", 100e6, 1.0), ("cheap", 10e6, 0.5), ("good", 50e6, 0.7), ("oracle", 5e6, 0.1)]
    with open(cost, "w") as f:
        for pol, b, c in recs:
            f.write(json.dumps({"scope": "decoder_layers", "protocol": "ABY3", "policy": pol,
                                "seq_len": 1024, "comm_bytes": b, "messages": 7,
                                "lan_latency_s": 0.1, "compute_s": c}) + "\n")
    rows = pareto.join(fidelity, pareto.read_costs(cost, "ABY3"), [1024], quality="agree")
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"full", "cheap", "good"}                        # oracle: no fidelity row
    assert by["good"]["comm_mb"] == 50.0 and by["good"]["lan_total_s"] == 0.1 + 0.7
    assert [p for p in by if by[p].get("front_comm")] == ["cheap", "full", "good"]
    # by task score `good` (1.0, 50 MB) dominates `full` (1.0, 100 MB): off the front
    by_score = {r["policy"]: r for r in pareto.join(fidelity, pareto.read_costs(cost, "ABY3"),
                                                    [1024])}
    assert sorted(p for p in by_score if by_score[p].get("front_comm")) == ["cheap", "good"]
    assert sorted(p for p in by_score if by_score[p].get("front_time")) == ["cheap", "good"]
    table = pareto.write(rows, tmp_path / "out")
    assert "`good`" in table and (tmp_path / "out" / "pareto.csv").is_file()
    figure = tmp_path / "fig.png"
    pareto.plot(rows, figure, 0.1)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cost_line(policy, budget, comm, steps=None, seq_len=2048):
    record = {"scope": "decoder_layers", "protocol": "ABY3", "policy": policy,
              "seq_len": seq_len, "budget": budget, "comm_bytes": comm, "messages": 9,
              "lan_latency_s": 0.2, "compute_s": 1.0}
    if steps:
        record["steps"] = [{"comm_bytes": comm} for _ in range(steps)]
    return json.dumps(record) + "\n"


def test_cost_runs_first_run_wins_and_other_budgets_are_left_out(tmp_path):
    from mpcache_jax import primitives as P
    gen, every = tmp_path / "gen", tmp_path / "every"
    gen.mkdir(), every.mkdir()
    (gen / "results.jsonl").write_text(
        _cost_line("full", None, 150e6, steps=32) + _cost_line("mpcache", "0.1min384", 80e6, 32))
    (every / "results.jsonl").write_text(
        _cost_line("full", None, 151e6) + _cost_line("mpcache", "0.1min384", 120e6)
        + _cost_line("h2o", "0.1min384", 500e6) + _cost_line("h2o", 0.1, 400e6))
    budget = P.parse_budget("0.1min384")
    costs = pareto.read_cost_runs([gen / "results.jsonl", every / "results.jsonl"], "ABY3",
                                  budget)
    assert costs[("mpcache", 2048)]["comm_bytes"] == 80e6          # the generation's mean step
    assert costs[("mpcache", 2048)]["source"] == str(gen)
    assert costs[("h2o", 2048)]["comm_bytes"] == 500e6             # the 10% record left out
    assert costs[("h2o", 2048)]["source"] == str(every)
    fidelity = {name: {"agree": 0.5, "agree_prefix": 0.5, "kl": 0.1, "score_over_full": 0.9}
                for name in ("full", "mpcache", "h2o")}
    rows = {r["policy"]: r for r in pareto.join(fidelity, costs, [2048])}
    assert rows["mpcache"]["steps"] == 32 and rows["h2o"]["steps"] == 1
    assert set(pareto.read_costs(gen / "results.jsonl", "ABY3", 0.2)) == {("full", 2048)}
    with pytest.raises(SystemExit, match="no decoder-layer records for SEMI2K at budget 0.2"):
        pareto.read_costs(gen / "results.jsonl", "SEMI2K", 0.2)


def test_main_refuses_bad_lengths_and_missing_runs(tmp_path, capsys):
    assert pareto.main(["pareto", f"--fidelity_dir={tmp_path}", f"--cost_dir={tmp_path}",
                        "--seq_lens=2048,x"]) == 2
    assert "--seq_lens" in capsys.readouterr().err
    assert pareto.main(["pareto", f"--fidelity_dir={tmp_path}", f"--cost_dir={tmp_path}"]) == 2
    assert "does not exist" in capsys.readouterr().err
