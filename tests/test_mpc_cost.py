"""The `--experiment=mpc_cost` harness end to end on a tiny model (seconds)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORD_FIELDS = ("policy", "protocol", "seq_len", "model", "comm_bytes", "messages", "wall_s",
                 "lan_latency_s", "wan_latency_s", "phase_breakdown", "party_send_bytes",
                 "party_recv_bytes", "party_send_actions", "party_compute_s")


def run_cli(*flags, timeout=600):
    cmd = [sys.executable, "-m", "experiments.run", "--experiment=mpc_cost", *flags]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def test_decode_costs_rank_policies_as_expected(tmp_path):
    proc = run_cli("--mpc_bench=decode", "--backend=spu_sim", "--protocol=ABY3",
                   "--model=llama-tiny", "--num_layers=2", "--mpc_share_from=0",
                   "--policies=no_cache,full,mpcache,oracle", "--budgets=0.25", "--seq_lens=128",
                   f"--output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    by_policy = {r["policy"]: r for r in records}
    assert set(by_policy) == {"lm_head", "mlp_activation", "no_cache", "full", "mpcache", "oracle"}
    for r in records:
        assert all(field in r for field in RECORD_FIELDS)
    comm = {p: by_policy[p]["comm_bytes"] for p in ("no_cache", "full", "mpcache", "oracle")}
    # Recomputing 129 tokens costs more than attending to 128 cached ones; attending to 32 of
    # them with a free public choice costs least; MPCache pays for its selection on top.
    assert comm["no_cache"] > comm["full"] > comm["mpcache"] > comm["oracle"]
    # Every party profiled: comm_bytes = sent summed over the 3 parties = received; network
    # model: bytes per party / 377 MB/s + messages x 0.3 ms.
    for r in records:
        assert len(r["party_send_bytes"]) == 3 and "party0_send_bytes" not in r
        assert sum(r["party_send_bytes"]) == r["comm_bytes"] == sum(r["party_recv_bytes"])
    r = by_policy["full"]
    assert r["lan_latency_s"] == pytest.approx(
        r["comm_bytes"] / 3 / 377e6 + r["messages"] * 0.3e-3, abs=1e-4)
    ratios = [json.loads(line) for line in (tmp_path / "ratios.jsonl").read_text().splitlines()]
    mp = next(x for x in ratios if x["policy"] == "mpcache")
    assert mp["full_over_x_comm"] == pytest.approx(comm["full"] / comm["mpcache"])
    assert "ratios measured in this run" in proc.stdout


@pytest.mark.parametrize("flag, message", [
    ("--protocol=SPDZ", "protocol='SPDZ' is unknown"),
    ('--runtime_config={"protocol": "ABY3", "field": "FM32", "fxp_fraction_bits": 18}',
     "FM32 (32 bits) is too small for 18 fraction bits"),
    ('--runtime_config={"runtime_config": {"protocol": "CHEETAH"}, "world_size": 3}',
     "CHEETAH runs with 2 parties, got 3"),
])
def test_cli_rejects_bad_runtime_configs(flag, message, tmp_path):
    proc = run_cli("--mpc_bench=topk", flag, f"--output_dir={tmp_path}", timeout=300)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_one_rsqrt_norm_needs_fewer_rounds_for_the_same_value(tmp_path):
    """--mpc_bench=norm: the shipped RMSNorm scale (select, then one rsqrt) against the two-rsqrt
    form, on a row with an attention-sink entry (the large-row branch)."""
    proc = run_cli("--mpc_bench=norm", "--protocol=ABY3", "--model=llama-tiny",
                   f"--output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = {r["policy"]: r for r in map(json.loads,
                                           (tmp_path / "results.jsonl").read_text().splitlines())}
    one, two = records["one_rsqrt"], records["two_rsqrt"]
    assert one["messages"] < 0.75 * two["messages"]
    assert one["comm_bytes"] <= 1.01 * two["comm_bytes"]
    assert one["rel_error"] < 1e-2 and two["rel_error"] < 1e-2


def test_an_unknown_benchmark_is_rejected_naming_the_registered_ones(tmp_path):
    from experiments.cost import BENCHMARKS
    proc = run_cli("--mpc_bench=nope", f"--output_dir={tmp_path}", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--mpc_bench='nope' is not a benchmark" in proc.stderr
    assert all(name in proc.stderr for name in BENCHMARKS)
    assert {"decode", "gather", "gather_dtype", "repeat_noise", "topk", "norm", "matmul",
            "generate", "rounds"} <= set(BENCHMARKS)


def test_typed_config_validates_before_any_work():
    from experiments.cost import CostConfig
    with pytest.raises(ValueError, match="unknown policy 'foo'"):
        CostConfig(policies=(("foo", "foo", {}),))
    with pytest.raises(ValueError, match="protocol='SPDZ' is unknown"):
        CostConfig(bench="topk", protocols=("SPDZ",))
    with pytest.raises(ValueError, match="--backend='gpu'"):
        CostConfig(backend="gpu")
    # A working set larger than a costed cache: refused at construction, not after `full`'s row.
    reuse = (("r2", "mpcache_exact", {"refresh_every": 2}),)
    with pytest.raises(ValueError, match="working set larger than the prompt's 64 tokens"):
        CostConfig(policies=reuse, budget=100, seq_lens=(64, 256))
    CostConfig(policies=reuse, budget=100, seq_lens=(128, 256))   # fits every length
    with pytest.raises(ValueError, match="--layers=4,5 and --num_layers=2 both pick layers"):
        CostConfig(layers=(4, 5), num_layers=2)


def test_registry_loads_the_listed_layers_of_a_geometry():
    from models import registry
    from models.config import ConfigError
    whole = registry.load("llama-tiny", seed=3)
    picked = registry.load("llama-tiny", seed=3, layers=[1, 3])
    assert picked.model.cfg.num_layers == 2
    for new, old in ((0, 1), (1, 3)):
        for a, b in zip(jax.tree_util.tree_leaves(picked.params[f"layers_{new}"]),
                        jax.tree_util.tree_leaves(whole.params[f"layers_{old}"]), strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ConfigError, match="not both"):
        registry.load("llama-tiny", num_layers=2, layers=[0, 1])
    with pytest.raises(ValueError, match=r"layers=\[3, 1\] must be increasing indices in \[0, 4\)"):
        registry.load("llama-tiny", layers=[3, 1])


def test_repeated_runs_report_the_same_bytes_and_integer_gathers_are_cheaper(tmp_path):
    """repeat_noise and gather_dtype through the harness with a typed config (no flags): the
    sum over the parties is identical run to run, though single parties' bytes may move."""
    from experiments.cost import BENCHMARKS, CostConfig, Harness
    from experiments.cost.primitives import REPEATS
    cfg = CostConfig(bench="repeat_noise", gather_tokens=64, gather_dim=8)
    harness = Harness(cfg, tmp_path / "r.jsonl")
    BENCHMARKS["repeat_noise"](cfg, harness)
    by_variant = {}
    for r in harness.records:
        by_variant.setdefault(r["policy"], []).append(r)
        assert sum(r["party_send_bytes"]) == r["comm_bytes"] == sum(r["party_recv_bytes"])
    assert {k: len(v) for k, v in by_variant.items()} == {
        "fixed_point_onehot": REPEATS, "int_onehot_gather_rows": REPEATS}
    for runs in by_variant.values():
        assert len({r["comm_bytes"] for r in runs}) == 1 and runs[0]["comm_bytes"] > 0
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2 * REPEATS

    cfg = CostConfig(bench="gather_dtype")
    harness = Harness(cfg, tmp_path / "g.jsonl")
    BENCHMARKS["gather_dtype"](cfg, harness)
    rec = {r["policy"]: r for r in harness.records}
    assert all(r["max_abs_error"] < 1e-2 for r in rec.values())
    assert rec["int_onehot_from_comparison"]["comm_bytes"] < rec["fixed_point_onehot"]["comm_bytes"]


def test_median_run_picks_the_median_compute_and_refuses_changing_costs():
    from experiments.cost.harness import median_run
    fields = lambda cost, wall: {"comm_bytes": cost[0], "messages": cost[1], "compute_s": wall}
    runs = iter([((10, 2), 5.0), ((10, 2), 1.0), ((10, 2), 3.0)])
    cost, wall, times = median_run(lambda: next(runs), 3, fields)
    assert (cost, wall, times) == ((10, 2), 3.0, [5.0, 1.0, 3.0])
    assert median_run(lambda: ((10, 2), 4.0), 1, fields) == ((10, 2), 4.0, None)
    runs = iter([((10, 2), 5.0), ((11, 2), 1.0)])
    with pytest.raises(RuntimeError, match="different costs"):
        median_run(lambda: next(runs), 2, fields)


def test_round_cutting_alternatives_compute_what_they_replace():
    """--mpc_bench=rounds compares SPU's row max and q . K with two lower-round forms; both must
    compute the same thing (plaintext: ties, padding to the fan-in, GQA grouping)."""
    import jax.numpy as jnp
    import numpy as np
    from experiments.cost.primitives import integer_query_scores, tournament_max
    from mpcache_jax.attention import grouped_scores
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 16, 37, 64):                         # powers of 4 and not
        x = rng.normal(size=(3, 2, n)).astype(np.float32)
        x[0, 0, :] = 1.5                                    # all tied
        got = np.asarray(tournament_max(jnp.asarray(x)))
        assert got.shape == (3, 2)
        np.testing.assert_array_equal(got, x.max(-1))
    q = rng.normal(size=(6, 16)).astype(np.float32)         # 6 query heads on 2 KV heads
    k = rng.normal(size=(2, 40, 16)).astype(np.float32)
    exact = np.asarray(grouped_scores(jnp.asarray(q), jnp.asarray(k)))
    approx = np.asarray(integer_query_scores(jnp.asarray(q), jnp.asarray(k)))
    assert approx.shape == exact.shape == (2, 3, 40)
    err = np.abs(approx - exact).max()
    assert 0 < err < 0.05                                   # quantized, not exact, not wrong
