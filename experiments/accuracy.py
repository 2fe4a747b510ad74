"""`--experiment=accuracy`: every policy x budget on the same prefill of every sample.

Writes DIR/results.jsonl (one record per task, policy, budget: mean score, n, config, commit),
DIR/samples.jsonl (one record per sample and policy/budget), DIR/summary.csv and plots
(score_vs_budget.png; needle_heatmap.png for the needle task).
"""
from __future__ import annotations

import collections
import csv
import ctypes
import json
import math
import os
import time

import jax
import numpy as np
from tqdm import tqdm

from experiments import common, metrics, tasks
from mpcache_jax.generate import (apply_policy, continuation_nll, decode_tokens, prefill_prompt)
from mpcache_jax.policies import make_policy
from models import registry


def parse_variants(FLAGS) -> list[tuple[str, str, dict]]:
    """(label, registry name, options) for every policy to evaluate."""
    variants = [(name, name, {}) for name in FLAGS.policies]
    if FLAGS.variants:
        try:
            extra = json.loads(FLAGS.variants)
        except json.JSONDecodeError as err:
            raise SystemExit(f"--variants is not valid JSON ({err}); expected "
                             '{"label": {"policy": "mpcache", "alpha": 0.5}, ...}')
        for label, spec in extra.items():
            spec = dict(spec)
            if "policy" not in spec:
                raise SystemExit(f"--variants entry {label!r} needs a 'policy' field")
            name = spec.pop("policy")
            if "levels" in spec:  # JSON lists -> hashable tuples
                spec["levels"] = tuple((s, k) for s, k in spec["levels"])
            variants.append((label, name, spec))
    return variants


def build_policies(FLAGS):
    """[(label, budget, policy)], validated before any model work starts."""
    budgets = [parse_budget(b) for b in FLAGS.budgets]
    out = []
    for label, name, options in parse_variants(FLAGS):
        if name == "full":
            out.append((label, 1.0, make_policy("full")))
            continue
        for budget in budgets:
            out.append((label, budget, make_policy(name, budget, **options)))
    return out


def parse_budget(text: str) -> float | int:
    """'0.1' -> ratio 0.1 of the prompt; '128' -> 128 tokens."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--budgets entry {text!r} is not a number; give ratios in (0, 1] or "
                         "token counts such as 128") from None
    if value <= 1.0:
        return value
    if not value.is_integer():
        raise ValueError(f"--budgets entry {text!r}: a budget above 1 is a token count and must "
                         "be a whole number")
    return int(value)


def parse_numbers(flag: str, values: list[str], kind):
    try:
        return [kind(v) for v in values]
    except ValueError:
        what = "whole number" if kind is int else "number"
        raise ValueError(f"--{flag}={','.join(values)}: every entry must be a {what}") from None


def parse_tasks(values: list[str]) -> list[str]:
    chosen = [v.strip() for v in values if v.strip()]
    unknown = [t for t in chosen if t not in tasks.TASKS]
    if not chosen or unknown:
        raise ValueError(f"--task: unknown task(s) {unknown or values}; choose from "
                         f"{', '.join(tasks.TASKS)} (comma-separated for several)")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"--task lists a task twice: {values}")
    return chosen


def make_samples(FLAGS, task: str, tokenizer, lengths: list[int], depths: list[float]):
    common_args = dict(num_samples=FLAGS.num_samples, seed=FLAGS.seed)
    if task == "passkey":
        return list(tasks.passkey(tokenizer, lengths=lengths, depths=depths, **common_args))
    if task == "needle":
        return list(tasks.needle(tokenizer, lengths=lengths, depths=depths, **common_args))
    if task == "kv_retrieval":
        return list(tasks.kv_retrieval(tokenizer, lengths=lengths, **common_args))
    if task == "ppl":
        return list(tasks.perplexity_chunks(tokenizer, data_path=FLAGS.data_path, lengths=lengths,
                                            target_len=FLAGS.ppl_target_len, **common_args))
    return list(tasks.longbench_jsonl(tokenizer, data_path=FLAGS.data_path,
                                      num_samples=FLAGS.num_samples, max_length=max(lengths),
                                      metric=FLAGS.metric))


def evaluate_sample(loaded, sample, policies, FLAGS):
    """All policies on one prefill of the sample -> list of per-sample records."""
    model, params, tok = loaded.model, loaded.params, loaded.tokenizer
    is_ppl = sample.metric == "ppl"
    steps = len(sample.target_ids) if is_ppl else FLAGS.max_new_tokens
    need_queries = any(p.needs_queries for _, _, p in policies)
    logits, dense, aux = prefill_prompt(model, params, sample.prompt_ids, steps, need_queries)
    T = len(sample.prompt_ids)
    records = []
    for label, budget, policy in policies:
        cache = apply_policy(policy, dense, aux, steps)
        start = time.perf_counter()
        if is_ppl:
            nll = continuation_nll(model, params, logits, cache, policy=policy, start_pos=T,
                                   target_ids=sample.target_ids)
            score, text = float(math.exp(nll.mean())), ""
        else:
            result = decode_tokens(model, params, logits, cache, policy=policy, start_pos=T,
                                   max_new_tokens=steps, stop_ids=tok.stop_ids)
            text = tok.decode(result.tokens)
            score = metrics.score(sample.metric, text, sample.answers)
        records.append({
            "task": sample.task, "sample_id": sample.sample_id, "policy": label,
            "budget": budget, "score": score, "metric": sample.metric, "prompt_tokens": T,
            "answers": sample.answers, "output": text, "decode_s": round(time.perf_counter() - start, 3),
            **sample.meta,
        })
    return records


def policy_chunks(policies, size: int):
    """`policies` in consecutive groups of `size` programs (0: one group).

    Each group prefills every sample again and frees its compiled programs afterwards, so
    peak memory follows the group size instead of the number of policies x budgets.
    """
    if size < 0:
        raise SystemExit(f"--policy_chunk must be >= 0, got {size}")
    if size == 0:
        return [policies]
    return [policies[i:i + size] for i in range(0, len(policies), size)]


def release_compiled_programs() -> None:
    """Drop every compiled program and hand the freed heap back to the OS: glibc keeps freed
    memory otherwise (resident memory after each group of a 12-program passkey sweep: 2.1 GB
    without the trim, 1.0 GB with it)."""
    jax.clear_caches()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to trim
        pass


def resident_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError):
        return float("nan")


def record_key(task: str, sample_id: str, policy: str, budget) -> tuple:
    """Identity of one sample x policy record (what --resume skips)."""
    return (task, sample_id, policy, budget)


def load_finished(samples_path):
    """Per-sample records of an earlier run in the same output directory (--resume)."""
    if not samples_path.exists():
        raise SystemExit(f"--resume: no {samples_path} to resume from")
    records = [json.loads(line) for line in samples_path.read_text().splitlines() if line]
    print(f"resuming: {len(records)} finished sample x policy records in {samples_path}")
    return records


def aggregate(sample_records, FLAGS):
    groups = collections.defaultdict(list)
    for r in sample_records:
        groups[(r["task"], r["policy"], r["budget"])].append(r["score"])
    config = common.flag_values(FLAGS)
    commit = common.git_commit()
    return [{"task": task, "policy": policy, "budget": budget,
             "score": float(np.mean(scores)), "n": len(scores), "model": FLAGS.model,
             "git_commit": commit, "config": config}
            for (task, policy, budget), scores in groups.items()]


def write_summary(results, path):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "policy", "budget", "score", "n"])
        for r in sorted(results, key=lambda r: (r["task"], r["policy"], r["budget"])):
            writer.writerow([r["task"], r["policy"], r["budget"], f"{r['score']:.4f}", r["n"]])


def plot_score_vs_budget(results, path):
    """One panel per task: score vs budget, one line per policy (full as a dashed level)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task_names = sorted({r["task"] for r in results})
    many = len({r["policy"] for r in results}) > 8
    cols = 2 if len(task_names) >= 4 else len(task_names)
    rows = -(-len(task_names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(task_names):]:
        ax.axis("off")
    for ax, task in zip(axes.flat, task_names):
        by_policy = collections.defaultdict(list)
        for r in results:
            if r["task"] == task:
                by_policy[r["policy"]].append((r["budget"], r["score"], r["n"]))
        colors = plt.get_cmap("tab20").colors
        markers = "osD^vP*X<>"
        for i, (policy, points) in enumerate(sorted(by_policy.items())):
            points.sort()
            if policy == "full":
                ax.axhline(points[0][1], color="black", linestyle="--", label="full")
                continue
            # Distinct colour + marker per policy, slightly jittered so equal scores stay visible.
            jitter = 0.004 * (i - len(by_policy) / 2) if len(by_policy) > 8 else 0.0
            ax.plot([p[0] for p in points], [p[1] + jitter for p in points],
                    marker=markers[i % len(markers)], color=colors[i % len(colors)], label=policy)
        n = max(p[2] for points in by_policy.values() for p in points)
        ax.set_xlabel("budget (prompt tokens attended, ratio or count)")
        ax.set_ylabel("perplexity (lower is better)" if task == "ppl" else "score")
        ax.set_title(f"{task} ({results[0]['model']}, n={n})")
        if not many:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if many:  # one shared legend beside the panels instead of one covering each panel
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_needle_heatmaps(sample_records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["policy"], r["budget"]) for r in sample_records})
    lengths = sorted({r["length"] for r in sample_records})
    depths = sorted({r["depth"] for r in sample_records})
    cols = min(4, len(combos))
    rows = math.ceil(len(combos) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    for ax, (policy, budget) in zip(axes.flat, combos):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, depth in enumerate(depths):
            for j, length in enumerate(lengths):
                scores = [r["score"] for r in sample_records if r["policy"] == policy and
                          r["budget"] == budget and r["depth"] == depth and r["length"] == length]
                if scores:
                    grid[i, j] = np.mean(scores)
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(f"{policy} @ {budget}", fontsize=8)
        ax.set_xlabel("prompt tokens", fontsize=7)
        ax.set_ylabel("needle depth", fontsize=7)
    for ax in list(axes.flat)[len(combos):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(FLAGS) -> None:
    task_names = parse_tasks(FLAGS.task)
    policies = build_policies(FLAGS)
    lengths = parse_numbers("lengths", FLAGS.lengths, int)
    depths = parse_numbers("depths", FLAGS.depths, float)
    loaded = common.with_model_numerics(
        registry.load(FLAGS.model, weights_path=FLAGS.weights_path, cache_dir=FLAGS.cache_dir,
                      seed=FLAGS.seed, num_layers=FLAGS.num_layers), FLAGS)
    if loaded.tokenizer is None:
        raise SystemExit(f"model {FLAGS.model!r} has no tokenizer; accuracy runs need a real model")
    samples = [sample for task in task_names
               for sample in make_samples(FLAGS, task, loaded.tokenizer, lengths, depths)]
    out = common.ensure_dir(FLAGS.output_dir or "results/accuracy")
    samples_path = out / "samples.jsonl"
    all_records = load_finished(samples_path) if FLAGS.resume else []
    finished = {record_key(r["task"], r["sample_id"], r["policy"], r["budget"])
                for r in all_records}
    samples_path.write_text("".join(json.dumps(r) + "\n" for r in all_records))
    chunks = policy_chunks(policies, FLAGS.policy_chunk)
    bar = tqdm(total=len(samples) * len(chunks), desc=",".join(task_names), unit="sample")
    for number, chunk in enumerate(chunks, 1):
        for sample in samples:
            todo = [(label, budget, policy) for label, budget, policy in chunk
                    if record_key(sample.task, sample.sample_id, label, budget) not in finished]
            if not todo:
                bar.update()
                continue
            records = evaluate_sample(loaded, sample, todo, FLAGS)
            common.write_jsonl(samples_path, records, append=True)
            all_records.extend(records)
            means = collections.defaultdict(list)
            for r in records:
                means[f"{r['policy']}@{r['budget']}"].append(r["score"])
            bar.update()
            bar.set_postfix({k: f"{np.mean(v):.2f}" for k, v in list(means.items())[:4]})
        if len(chunks) > 1:
            release_compiled_programs()
            tqdm.write(f"policy group {number}/{len(chunks)} done; resident memory "
                       f"{resident_mb():.0f} MB")
    bar.close()
    results = aggregate(all_records, FLAGS)
    common.write_jsonl(out / "results.jsonl", results)
    write_summary(results, out / "summary.csv")
    plot_score_vs_budget(results, out / "score_vs_budget.png")
    if "needle" in task_names:
        plot_needle_heatmaps([r for r in all_records if r["task"] == "needle"],
                             out / "needle_heatmap.png")
    print(f"\n{'task':<14}{'policy':<24}{'budget':>8}{'score':>10}{'n':>5}")
    for r in sorted(results, key=lambda r: (r["task"], r["policy"], r["budget"])):
        print(f"{r['task']:<14}{r['policy']:<24}{r['budget']:>8}{r['score']:>10.4f}{r['n']:>5}")
    print(f"wrote {out}/results.jsonl, samples.jsonl, summary.csv, score_vs_budget.png")
