"""Simulated vs multi-process cost of the same job: one record per (backend, policy).

    records = compare_backends("experiments/nodes/3pc_aby3.json", ["full", "mpcache"], out)

For each policy the node config's job runs (1) in SPU's in-process simulator (issue 5's
`spu_sim` backend) and (2) as real parties over loopback brpc
(`run_loopback`); every party is profiled in both. Both records share the simulation benchmarks' schema;
`backend` tells them apart. Records are appended to `output_dir/results.jsonl`.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

from mpcache_jax.distributed.config import JobSpec, load_node_config
from mpcache_jax.mpc.config import MPCConfig
from mpcache_jax.distributed import job as job_lib
from mpcache_jax.distributed.launch import run_loopback


def simulate_outputs(job: JobSpec, mpc: MPCConfig, profile: bool = True):
    """The job's program under spu_sim -> (revealed outputs, RunCost or None, wall_s)."""
    from mpcache_jax.mpc.backends import SECRET, make_backend
    program = job_lib.build_program(job)
    params = job_lib.load_weights(job)
    prompt = job_lib.load_prompt(job, program.model.cfg.vocab_size)
    backend = make_backend("spu_sim", mpc, profile=profile)
    compiled = backend.compile(program, (params, prompt), (SECRET, SECRET))
    shared = backend.share((params, prompt), SECRET)
    outputs, run, wall = backend.run(compiled, *shared)
    revealed = [np.asarray(x) for x in backend.reveal(outputs)]
    # Work around a deadlock in spu_sim (issue 5): a party thread keeps its last job, whose
    # closure references our shared values; if that thread drops the last reference, the
    # values' finalizers call into the party threads from a party thread and wait forever.
    # A no-op job makes the threads drop it while we still hold the values; we free them here.
    backend.parties.call(lambda rank, runtime: None)
    del shared, outputs
    return revealed, run, wall


def simulate(node_config: str, **job_overrides) -> dict:
    """The node config's job under spu_sim -> a record (backend 'spu_sim')."""
    from mpcache_jax.mpc.costs import cost_fields
    config = load_node_config(node_config).with_job(**job_overrides)
    job = config.job
    revealed, run, wall = simulate_outputs(job, config.mpc)
    return {"backend": "spu_sim", "policy": job.policy, "protocol": config.protocol,
            "parties": config.world_size, "seq_len": job.seq_len, "model": job.model,
            "num_layers": job.num_layers, "budget": job.budget,
            "max_new_tokens": job.max_new_tokens, **cost_fields(run, wall, config.world_size),
            "tokens": [int(t) for t in revealed[0]], "node_config": config.id}


def compare_backends(node_config: str, policies: list[str], output_dir: str | pathlib.Path,
                     **job_overrides) -> list[dict]:
    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for policy in policies:
        sim = simulate(node_config, policy=policy, **job_overrides)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(sim) + "\n")
        [real] = run_loopback(node_config, out / f"parties_{policy}", policy=policy,
                              **job_overrides)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(real) + "\n")
        records += [sim, real]
    print(format_table(records))
    return records


def format_table(records: list[dict]) -> str:
    """Markdown: per policy, simulated vs multi-process wall time, bytes and messages."""
    lines = ["| policy | backend | tokens | wall_s | compute_s | comm_bytes | messages | "
             "lan_latency_s |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['policy']} | {r['backend']} | {r['tokens']} | {r['wall_s']:.2f} | "
                     f"{r['compute_s']:.2f} | {r['comm_bytes']:,} | {r['messages']:,} | "
                     f"{r['lan_latency_s']:.4f} |")
    return "\n".join(lines)
