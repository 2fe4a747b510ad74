"""Per-party costs of a multi-process run, aggregated into the simulation benchmarks' schema.

Each party parses its OWN SPU profiling log (bytes, messages, per-op time of the secure run);
the prompt owner aggregates them. Unlike the simulator (which profiles party 0 only and
estimates total bytes as party 0's x parties), `comm_bytes` here is the measured sum of every
party's sent bytes. Every other cost field comes from issue 5's `cost_fields` applied to party
0's own profile, so the two backends' records compare field by field.
"""
from __future__ import annotations

import pathlib

from mpcache_jax.mpc.costs import cost_fields, read_last_profile


def party_cost(log_path: pathlib.Path, offset: int, party: str, rank: int, wall_s: float,
               world: int, setup_s: dict[str, float]) -> dict:
    """This party's cost of the secure run from its own profile (JSON-able): its own link
    totals plus `fields`, the simulator's cost fields computed from this party's view."""
    run = read_last_profile(log_path, offset)
    return {"party": party, "rank": rank, "wall_s": round(wall_s, 4),
            "compute_s": round(run.exec_s, 4), "send_bytes": run.send_bytes,
            "recv_bytes": run.recv_bytes, "send_actions": run.send_actions,
            "recv_actions": run.recv_actions,
            "setup_s": {k: round(v, 4) for k, v in setup_s.items()},
            "fields": cost_fields(run, wall_s, world)}


def node_record(config, party_costs: list[dict], tokens: list[int]) -> dict:
    """One JSONL record in the simulation benchmarks' schema from every party's own cost.

    Fields are party 0's view with the simulator's definitions (cost_fields), except:
    comm_bytes = measured sum of every party's sent bytes (the simulator's party-0 x parties
    estimate is kept as comm_bytes_estimate), wall_s = the slowest party's run time."""
    job = config.job
    by_rank = sorted(party_costs, key=lambda c: c["rank"])
    fields = dict(by_rank[0]["fields"])
    fields["comm_bytes_estimate"] = fields["comm_bytes"]
    fields["comm_bytes"] = int(sum(c["send_bytes"] for c in by_rank))
    fields["wall_s"] = max(c["wall_s"] for c in by_rank)
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
        **fields,
        "per_party": [{k: v for k, v in c.items() if k != "fields"} for c in by_rank],
        "tokens": tokens,
        "node_config": config.id,
        "tls": config.link.tls is not None,
        "runtime_config": config.mpc.runtime_json(),
    }
