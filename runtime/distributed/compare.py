"""Simulated vs multi-process cost of the same job: one record per (backend, policy).

    records = compare_backends("experiments/nodes/3pc_aby3.json", ["full", "mpcache"], out)

For each policy the node config's job runs (1) in SPU's simulator (the `spu_sim` backend,
in a child process) and (2) as real parties over loopback brpc (`run_loopback`); every
party is profiled in both. Both records share the simulation benchmarks' schema; `backend`
tells them apart. Records are appended to `output_dir/results.jsonl`.
"""
from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import pathlib

from runtime.distributed import job as job_lib
from runtime.distributed.config import load_node_config
from runtime.distributed.costs import generation_records
from runtime.distributed.launch import run_loopback


def simulate(node_config: str, prompt_file: str | None = None, profile: bool = True,
             **job_overrides) -> list[dict]:
    """The node config's job under spu_sim with the same session and records (backend
    'spu_sim'): per-step records and a summary (+ `logits` when the job reveals them)."""
    from runtime.mpc.backends import make_backend
    from runtime.mpc.secure import SecureSession
    config = load_node_config(node_config, check_job=False).with_job(**job_overrides)
    job = config.job
    model, policy = job_lib.build(job)
    prompt_ids, stop_ids = job_lib.load_prompt(job, prompt_file)
    backend = make_backend("spu_sim", config.mpc, profile=profile)
    session = SecureSession(backend, model, job_lib.load_weights(job), policy)
    result = session.generate(prompt_ids, job.max_new_tokens, stop_ids=stop_ids,
                              reveal_logits=job.reveal_logits, prefill=job.prefill)
    if not profile:
        return [{"backend": "spu_sim", "summary": True, "tokens": result.tokens,
                 "logits": result.logits}]
    records = generation_records(result, backend="spu_sim", policy=job.policy,
                                 budget=job.budget, model=job.model, num_layers=job.num_layers,
                                 protocol=config.protocol,
                                 parties=config.world_size, prompt_len=len(prompt_ids),
                                 node_config=config.id, prefill=job.prefill)
    if result.logits is not None:
        records[-1]["logits"] = result.logits
    return records


def simulate_apart(node_config: str, **job_overrides) -> list[dict]:
    """`simulate` in a child process, which hands the simulator's memory back before the real
    parties start. (Run in the launcher, two policies' 32 steps of llama2-d1024 at 2048
    tokens left it 15 GB, and the second policy's parties ran out of memory on 24 GB.)"""
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(simulate, node_config, **job_overrides).result()


def compare_backends(node_config: str, policies: list[str], output_dir: str | pathlib.Path,
                     use_free_ports: bool = False, **job_overrides) -> list[dict]:
    """Each policy's job in spu_sim and as real parties over loopback; prints a table of the
    decode cost per token in both."""
    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = []
    for policy in policies:
        sim = simulate_apart(node_config, policy=policy, **job_overrides)
        with open(out / "results.jsonl", "a") as f:
            f.write("".join(json.dumps({k: v for k, v in r.items() if k != "logits"}) + "\n"
                            for r in sim))
        real = run_loopback(node_config, out / f"parties_{policy}", use_free_ports,
                            policy=policy, **job_overrides)
        with open(out / "results.jsonl", "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in real))
        summaries += [sim[-1], real[-1]]
    print(format_table(summaries))
    return summaries


def format_table(summaries: list[dict]) -> str:
    """Markdown: per policy and backend, tokens and the mean decode cost per token."""
    lines = ["| policy | backend | tokens | decode wall s/token | compute s/token | "
             "comm bytes/token | messages/token | LAN total s/token |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summaries:
        def get(key, fmt):
            value = r.get(f"decode_{key}_per_token")
            return format(value, fmt) if value is not None else "-"
        lines.append(f"| {r['policy']} | {r['backend']} | {r['tokens']} | {get('wall_s', '.2f')} "
                     f"| {get('compute_s', '.2f')} | {get('comm_bytes', ',.0f')} | "
                     f"{get('messages', '.0f')} | {get('lan_total_s', '.3f')} |")
    return "\n".join(lines)
