"""True cost accounting: every party profiled, totals summed over parties (seconds).

SPU 0.9.5's ABY3 kernels make the parties send different amounts, with roles drawn anew on every
call, so one party's bytes vary from run to run; the sum over parties must not."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from runtime import mpc
from runtime.distributed import costs as node_costs
from runtime.mpc import profile_log

PREFIX = "2026-01-01 00:00:00.000 [info] [api.cc:printProfilingData:223] "


def block(name, exec_s, hlo, hal=(), mpc_ops=()):
    """One party's profile lines as SPU 0.9.5 logs them. Ops: (name, seconds, sb, rb, sa, ra);
    the link line is the pphlo ops' sum, as in SPU's logs."""
    lines = [f"{PREFIX}[Profiling] SPU execution {name} completed, input processing took "
             f"1e-06s, execution took {exec_s}s, output processing took 1e-06s, total time "
             f"{exec_s}s."]
    for section, ops in (("HLO", hlo), ("HAL", hal), ("MPC", mpc_ops)):
        ops = sorted(ops, key=lambda o: -o[1])
        lines.append(f"{PREFIX}{section} profiling: total time {sum(o[1] for o in ops)}")
        lines += [f"{PREFIX}- {op}, executed 1 times, duration {s}s, send bytes {sb} recv bytes "
                  f"{rb}, send actions {sa}, recv actions {ra}" for op, s, sb, rb, sa, ra in ops]
    sb, rb, sa, ra = (sum(o[k] for o in hlo) for k in range(2, 6))
    lines.append(f"{PREFIX}Link details: total send bytes {sb}, recv bytes {rb}, send actions "
                 f"{sa}, recv actions {ra}")
    return lines


# Three parties of one ABY3-like run: asymmetric bytes (sum sent = sum received = 1800).
PARTY_OPS = {
    0: [("pphlo.less", 0.030, 600, 300, 8, 4), ("pphlo.multiply", 0.004, 100, 200, 2, 3),
        ("pphlo.constant", 0.0001, 0, 0, 0, 0)],
    1: [("pphlo.less", 0.029, 100, 500, 2, 8), ("pphlo.multiply", 0.005, 200, 100, 3, 2),
        ("pphlo.constant", 0.0002, 0, 0, 0, 0)],
    2: [("pphlo.less", 0.031, 400, 300, 6, 4), ("pphlo.multiply", 0.003, 400, 400, 2, 2),
        ("pphlo.constant", 0.0003, 0, 0, 0, 0)],
}
HAL_OPS = [("f_less", 0.02, 1, 1, 1, 1), ("f_mul", 0.003, 1, 1, 1, 1)]
MPC_OPS = [("msb_a2b", 0.02, 1, 1, 1, 1), ("trunc_a", 0.002, 1, 1, 1, 1),
           ("add_aa", 0.0001, 0, 0, 0, 0)]


def blocks():
    return {r: block(f"step.r{r}", 0.05 + r / 100, PARTY_OPS[r], HAL_OPS, MPC_OPS)
            for r in range(3)}


def check_parties(runs):
    by_rank = {r.rank: r for r in runs}
    assert sorted(by_rank) == [0, 1, 2] and {r.name for r in runs} == {"step"}
    for rank, ops in PARTY_OPS.items():
        run = by_rank[rank]
        assert (run.send_bytes, run.recv_bytes) == (sum(o[2] for o in ops), sum(o[3] for o in ops))
        assert run.exec_s == pytest.approx(0.05 + rank / 100)
        assert set(run.ops["HLO"]) == {o[0] for o in ops}
        assert set(run.ops["MPC"]) == {o[0] for o in MPC_OPS}


def test_parser_separates_interleaved_party_blocks():
    b = blocks()
    # What SPU wrote once: party 0 preempted after 5 lines, parties 2 and 1 whole, then the rest.
    text = "\n".join(b[0][:5] + b[2] + b[1] + b[0][5:])
    runs = mpc.parse_profile_log(text)
    check_parties(runs)
    assert {r.attribution for r in runs} == {"unique"}
    run = profile_log.combine_parties(runs)
    assert run.send_bytes == run.recv_bytes == 1800 and run.exec_s == pytest.approx(0.07)
    assert run.ops["HLO"]["pphlo.less"].send_bytes == 1100
    # Two opening lines back to back, then both bodies: nothing tells which body is whose;
    # the per-party split is flagged, every sum over parties is still exact.
    text = "\n".join(b[1][:1] + b[2][:1] + b[1][1:] + b[2][1:] + b[0])
    run = profile_log.combine_parties(mpc.parse_profile_log(text))
    assert run.attribution == "ambiguous"
    assert run.send_bytes == run.recv_bytes == 1800 and run.send_actions == 23


def test_cost_fields_sum_over_parties_and_model_the_network():
    run = profile_log.combine_parties(mpc.parse_profile_log("\n".join(sum(blocks().values(), []))))
    fields = mpc.cost_fields(run, wall_s=0.7, parties=3)
    assert fields["comm_bytes"] == 1800 == sum(fields["party_recv_bytes"])
    assert fields["party_send_bytes"] == [700, 300, 800]
    assert fields["party_send_actions"] == [10, 5, 8]
    assert fields["messages"] == 8              # (10 + 5 + 8) / 3, rounded up
    assert fields["compute_s"] == pytest.approx(0.07) and len(fields["party_compute_s"]) == 3
    assert fields["lan_latency_s"] == pytest.approx(1800 / 3 / 377e6 + 8 * 0.3e-3, abs=1e-5)
    assert fields["wan_total_s"] == pytest.approx(0.07 + 1800 / 3 / 40e6 + 8 * 80e-3, abs=1e-4)
    phases = fields["phase_breakdown"]
    assert phases["compare"]["comm_bytes"] == 1100 and phases["other"]["comm_bytes"] == 700
    assert sum(p["comm_bytes"] for p in phases.values()) == fields["comm_bytes"]
    # No estimate from fewer profiles than parties, and the parties must add up.
    (one,) = mpc.parse_profile_log("\n".join(blocks()[0]))
    with pytest.raises(profile_log.CostAccountingError, match="needs every party's profile"):
        mpc.cost_fields(one, wall_s=0.7, parties=3)
    parties = mpc.parse_profile_log("\n".join(blocks()[0] + blocks()[1]))
    with pytest.raises(profile_log.CostAccountingError, match="sent 1000 bytes in total but "
                                                        "received 1100"):
        profile_log.combine_parties([parties[0], parties[1], parties[1].__class__(
            "step", 0.1, {}, 0, 0, 0, 0, 2)])


def test_parties_exchange_costs_as_data_and_combine_them_as_the_simulator():
    """Each party sends its own RunCost as JSON data; the combined cost equals the
    simulator's combination of the same profiles, and a malformed record is refused."""
    runs = {r.rank: r for r in mpc.parse_profile_log("\n".join(sum(blocks().values(), [])))}
    sent = [json.loads(json.dumps(node_costs.run_cost_to_json(runs[r]))) for r in (2, 0, 1)]
    received = [node_costs.run_cost_from_json(v, f"node:{v['rank']}") for v in sent]
    got = mpc.cost_fields(profile_log.combine_parties(received), 3.0, 3)
    want = mpc.cost_fields(profile_log.combine_parties(runs.values()), 3.0, 3)
    assert got.pop("party_attribution") == "own"       # each party parsed its own log
    want.pop("party_attribution")
    assert got == want
    bad = dict(sent[0], link=["many", 0, 0, 0])
    with pytest.raises(ValueError, match="party node:9 sent a malformed cost record"):
        node_costs.run_cost_from_json(bad, "node:9")


def test_same_program_reports_the_same_total_every_run_and_sent_equals_received():
    """Comparisons, an equality and truncations on 384 elements: B2A, eqz and TruncAPr2 draw
    their roles at random, so each party's bytes (and party 0's x 3, the old estimate) change
    between runs; the sum over parties must not."""
    backend = mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"))
    x = np.random.RandomState(0).randn(384).astype(np.float32)

    def fn(a):
        return jnp.where(a > 0.1, a * 0.37, a * a) * 1.5 + (a == 0.5)
    program = backend.compile(fn, (x,), mpc.SECRET)
    shared = backend.share(x, mpc.SECRET)
    records = []
    for _ in range(3):
        _, cost, wall = backend.run(program, shared)
        records.append(mpc.cost_fields(cost, wall, 3))
    assert len({r["comm_bytes"] for r in records}) == 1, [r["comm_bytes"] for r in records]
    assert len({r["messages"] for r in records}) == 1
    for r in records:
        assert len(r["party_send_bytes"]) == 3 and min(r["party_send_bytes"]) > 0
        assert sum(r["party_send_bytes"]) == sum(r["party_recv_bytes"]) == r["comm_bytes"]
        assert sum(p["comm_bytes"] for p in r["phase_breakdown"].values()) == r["comm_bytes"]
        assert len(r["party_compute_s"]) == 3
