"""Per-party costs of a multi-process run, aggregated into the simulation benchmarks' schema.

Each party parses its OWN SPU profiling log (link totals, per-op counters and time of the
secure run) and sends it, JSON-encoded, to the others; the prompt owner combines them with the
simulator's code (`combine_parties`, `cost_fields` of issue 5), so both backends' records carry
the same cost fields with the same definitions: comm_bytes = the sum of every party's sent
bytes (checked equal to the sum received), per-party bytes / actions / compute in
`party_*` fields, pphlo ops and phases summed over the parties.
"""
from __future__ import annotations

import pathlib

from mpcache_jax.mpc.costs import (OpCost, RunCost, combine_parties, cost_fields,
                                   read_last_profile)


def party_cost(log_path: pathlib.Path, offset: int, party: str, rank: int, wall_s: float,
               world: int, setup_s: dict[str, float]) -> dict:
    """This party's cost of the secure run from its own profile (JSON-able): its link totals,
    execution time and per-op counters (`ops`: section -> op -> [count, seconds, sent bytes,
    received bytes, send actions, recv actions]). `world` is unused (kept for callers)."""
    del world
    run = read_last_profile(log_path, offset)
    return {"party": party, "rank": rank, "wall_s": round(wall_s, 4),
            "compute_s": round(run.exec_s, 4), "send_bytes": run.send_bytes,
            "recv_bytes": run.recv_bytes, "send_actions": run.send_actions,
            "recv_actions": run.recv_actions,
            "setup_s": {k: round(v, 4) for k, v in setup_s.items()},
            "name": run.name,
            "ops": {section: {op: [c.count, c.seconds, c.send_bytes, c.recv_bytes,
                                   c.send_actions, c.recv_actions] for op, c in table.items()}
                    for section, table in run.ops.items()}}


def party_run(cost: dict) -> RunCost:
    """A party's RunCost back from its `party_cost` dict."""
    ops = {section: {op: OpCost(int(v[0]), float(v[1]), *(int(x) for x in v[2:]))
                     for op, v in table.items()}
           for section, table in cost.get("ops", {}).items()}
    return RunCost(cost.get("name", ""), float(cost["compute_s"]), ops, int(cost["send_bytes"]),
                   int(cost["recv_bytes"]), int(cost["send_actions"]),
                   int(cost["recv_actions"]), int(cost["rank"]))


def node_record(config, party_costs: list[dict], tokens: list[int]) -> dict:
    """One JSONL record in the simulation benchmarks' schema from every party's own cost:
    `cost_fields` of the combined run (the simulator's definitions), with wall_s = the slowest
    party's run time; `per_party` adds each party's wall and setup times."""
    job = config.job
    by_rank = sorted(party_costs, key=lambda c: c["rank"])
    run = combine_parties([party_run(c) for c in by_rank])
    wall_s = max(c["wall_s"] for c in by_rank)
    return {
        "backend": "spu_nodes",
        "policy": job.policy,
        "protocol": config.protocol,
        "parties": config.world_size,
        "seq_len": job.seq_len,
        "model": job.model,
        "num_layers": job.num_layers,
        "budget": job.budget,
        "max_new_tokens": job.max_new_tokens,
        **cost_fields(run, wall_s, config.world_size),
        "per_party": [{k: v for k, v in c.items() if k not in ("ops", "name")}
                      for c in by_rank],
        "tokens": tokens,
        "node_config": config.id,
        "tls": config.link.tls is not None,
        "runtime_config": config.mpc.runtime_json(),
    }
