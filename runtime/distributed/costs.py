"""Costs of a secure generation in one record schema for every backend.

Each party of a multi-process run parses its OWN SPU profile of every program it runs and the
parties exchange them (public numbers, as JSON: `run_cost_to_json` / `run_cost_from_json`);
`mpc.profile_log.combine_parties` makes the run's RunCost exactly as the simulator does, so
`generation_records` gives the same fields for `spu_sim` and `spu_nodes`: one record per step
(prefill, decode at each position) with `mpc.cost_fields` (comm_bytes = bytes sent summed over
the parties, per-party bytes / actions / compute, LAN/WAN model) and a summary record.
"""
from __future__ import annotations

import numpy as np

from mpcache_jax.primitives import budget_record
from runtime.distributed import wire
from runtime.mpc.costs import cost_fields
from runtime.mpc.profile_log import OpCost, RunCost


def run_cost_to_json(run: RunCost) -> dict:
    """One party's RunCost as plain data."""
    return {"rank": run.rank, "name": run.name, "exec_s": run.exec_s, "cpu_s": run.cpu_s,
            "link": [run.send_bytes, run.recv_bytes, run.send_actions, run.recv_actions],
            "ops": {section: {op: [c.count, c.seconds, c.send_bytes, c.recv_bytes,
                                   c.send_actions, c.recv_actions] for op, c in table.items()}
                    for section, table in run.ops.items()}}


def run_cost_from_json(value: dict, sender: str) -> RunCost:
    """A peer's RunCost back from `run_cost_to_json` data (a malformed one is a WireError)."""
    try:
        ops = {str(section): {str(op): OpCost(int(v[0]), float(v[1]),
                                              *(int(x) for x in v[2:6]))
                              for op, v in table.items()}
               for section, table in value["ops"].items()}
        sb, rb, sa, ra = (int(x) for x in value["link"])
        cpu = value.get("cpu_s")
        return RunCost(str(value["name"]), float(value["exec_s"]), ops, sb, rb, sa, ra,
                       int(value["rank"]), cpu_s=None if cpu is None else float(cpu))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise wire.WireError(sender, f"a malformed cost record ({err})") from None


def generation_records(result, *, backend: str, policy: str, budget, model: str,
                       num_layers: int | None, protocol: str, parties: int, prompt_len: int,
                       **extra) -> list[dict]:
    """Per-step cost records and a closing summary of one SecureGeneration."""
    common = {"backend": backend, "policy": policy, "budget": budget_record(budget),
              "protocol": protocol, "parties": parties, "model": model, "num_layers": num_layers,
              "prompt_tokens": prompt_len}
    steps = [{**common, "phase": step.phase, "position": step.position,
              **cost_fields(step.cost, step.wall_s, parties)}
             for step in result.steps if step.cost is not None]
    decode = [s for s in steps if s["phase"] == "decode"]
    summary = {**common, "summary": True, "tokens": result.tokens,
               "new_tokens": len(result.steps), "compile_s": round(result.compile_s, 3),
               **{f"decode_{k}_per_token": float(np.mean([s[k] for s in decode]))
                  for k in ("comm_bytes", "messages", "wall_s", "compute_s", "lan_total_s")
                  if decode},
               **({"decode_party_cpu_s_per_token": [float(x) for x in np.mean(
                   [s["party_cpu_s"] for s in decode], axis=0)]}
                  if decode and all("party_cpu_s" in s for s in decode) else {}),
               **extra}
    return steps + [summary]
