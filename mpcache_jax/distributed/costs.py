"""Per-party costs of a multi-process run, aggregated into the simulation benchmarks' schema.

Each party parses its OWN SPU profiling log (bytes, messages, per-op time of the secure run);
the prompt owner aggregates them. Unlike the simulator (which profiles party 0 only and
estimates total bytes as party 0's x parties), `comm_bytes` here is the measured sum of every
party's sent bytes. `messages`, `lan_latency_s` and `wan_latency_s` keep the simulator's
definitions (party 0's send actions; compute + bytes / bandwidth + messages x RTT for party 0)
so the two backends' records compare field by field.
"""
from __future__ import annotations

import pathlib
import time

from mpcache_jax.mpc.costs import LAN, WAN, parse_profile_log, phase_breakdown


def read_run_profile(log_path: pathlib.Path, offset: int, timeout_s: float = 10.0):
    """The last SPU run profiled in `log_path` after byte `offset` (waits for the log writer)."""
    deadline = time.time() + timeout_s
    while True:
        text = ""
        if log_path.exists():
            with open(log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
        runs = parse_profile_log(text)
        if runs and "Link details" in text.split("[Profiling] SPU execution")[-1]:
            return runs[-1]
        if time.time() > deadline:
            raise RuntimeError(f"no SPU profile of the secure run in {log_path}: was "
                               "enable_pphlo_profile switched off?")
        time.sleep(0.05)


def party_cost(log_path: pathlib.Path, offset: int, party: str, rank: int, wall_s: float,
               setup_s: dict[str, float]) -> dict:
    """This party's cost of the secure run, from its own profile (JSON-able)."""
    run = read_run_profile(log_path, offset)
    return {"party": party, "rank": rank, "wall_s": round(wall_s, 4),
            "compute_s": round(run.exec_s, 4), "send_bytes": run.send_bytes,
            "recv_bytes": run.recv_bytes, "send_actions": run.send_actions,
            "recv_actions": run.recv_actions, "phase_breakdown": phase_breakdown(run),
            "setup_s": {k: round(v, 4) for k, v in setup_s.items()}}


def node_record(config, party_costs: list[dict], tokens: list[int]) -> dict:
    """One JSONL record (policy, protocol, seq_len, model, comm_bytes, messages, wall_s,
    lan_latency_s, wan_latency_s, phase_breakdown, ...) from every party's own cost."""
    job = config.job
    by_rank = sorted(party_costs, key=lambda c: c["rank"])
    first = by_rank[0]
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
        "comm_bytes": int(sum(c["send_bytes"] for c in by_rank)),
        "party0_send_bytes": int(first["send_bytes"]),
        "party0_recv_bytes": int(first["recv_bytes"]),
        "messages": int(first["send_actions"]),
        "wall_s": max(c["wall_s"] for c in by_rank),
        "compute_s": first["compute_s"],
        "lan_latency_s": round(LAN.latency(first["send_bytes"], first["send_actions"],
                                           first["compute_s"]), 4),
        "wan_latency_s": round(WAN.latency(first["send_bytes"], first["send_actions"],
                                           first["compute_s"]), 4),
        "phase_breakdown": first["phase_breakdown"],
        "per_party": [{k: v for k, v in c.items() if k != "phase_breakdown"} for c in by_rank],
        "tokens": tokens,
        "node_config": config.id,
        "tls": config.link.tls is not None,
        "runtime_config": config.mpc.runtime_json(),
    }
