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
    assert abs(fidelity["cheap"]["score_over_full"] - 0.35) < 1e-9      # (0.2 + 0.5) / 2
    cost = tmp_path / "results.jsonl"
    recs = [("full", 100e6, 1.0), ("cheap", 10e6, 0.5), ("good", 50e6, 0.7), ("oracle", 5e6, 0.1)]
    with open(cost, "w") as f:
        for pol, b, c in recs:
            f.write(json.dumps({"scope": "decoder_layers", "protocol": "ABY3", "policy": pol,
                                "seq_len": 1024, "comm_bytes": b, "messages": 7,
                                "lan_latency_s": 0.1, "compute_s": c}) + "\n")
    rows = pareto.join(fidelity, pareto.read_costs(cost, "ABY3"), [1024])
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"full", "cheap", "good"}                        # oracle: no fidelity row
    assert by["good"]["comm_mb"] == 50.0 and by["good"]["lan_total_s"] == 0.1 + 0.7
    assert [p for p in by if by[p].get("front_comm")] == ["cheap", "full", "good"]
    table = pareto.write(rows, tmp_path / "out")
    assert "`good`" in table and (tmp_path / "out" / "pareto.csv").is_file()
