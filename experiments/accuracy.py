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

from experiments import common, fidelity, natural_tasks, tasks
from models import model as model_module
from runtime.generate import bucket_of, compress_batch, decode_loop_batch
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
        if not isinstance(extra, dict):
            raise SystemExit('--variants must be a JSON object: {"label": {"policy": NAME, ...}}')
        for label, spec in extra.items():
            if not isinstance(spec, dict):
                raise SystemExit(f"--variants entry {label!r} must be an object such as "
                                 '{"policy": "mpcache", "refresh_every": 4}')
            spec = dict(spec)
            if "policy" not in spec:
                raise SystemExit(f"--variants entry {label!r} needs a 'policy' field")
            if "budget" in spec:
                raise SystemExit(f"--variants entry {label!r} sets 'budget'; budgets come from "
                                 "--budgets (each variant runs at every one): drop it from the "
                                 "entry")
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
    """The task's samples at `lengths` (already within the model's context: `prompt_lengths`)."""
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
    if task == "continuation":
        return list(natural_tasks.continuation(tokenizer, lengths=lengths,
                                               target_len=FLAGS.ppl_target_len, **common_args))
    if task in natural_tasks.NATURAL_TASKS:
        return list(natural_tasks.NATURAL_TASKS[task](tokenizer, lengths=lengths, depths=depths,
                                                      **common_args))
    return list(tasks.longbench_jsonl(tokenizer, data_path=FLAGS.data_path,
                                      num_samples=FLAGS.num_samples, max_length=max(lengths),
                                      metric=FLAGS.metric))   # cut as LongBench: head and tail


def evaluate_batch(loaded, batch, policies, FLAGS, batch_size: int) -> list[list[dict]]:
    """All policies on the samples of one batch (one prompt shape: `batches`) -> per sample,
    its records (task score, agreement and KL with the full cache, mechanism metrics;
    experiments/fidelity.py). A sample that cannot be run (its prompt and new tokens do not
    fit the model's context) gives one `skipped` record per policy with the reason: it never
    ends the run."""
    context = loaded.model.cfg.max_position
    out, runnable = {}, []
    for index, sample in enumerate(batch):
        need = len(sample.prompt_ids) + new_tokens(sample, FLAGS)
        if need > context:
            err = (f"{len(sample.prompt_ids)} prompt + {new_tokens(sample, FLAGS)} new tokens "
                   f"exceed the model's context of {context}")
            tqdm.write(f"skipped sample {sample.task}/{sample.sample_id}: {err}")
            out[index] = [{"task": sample.task, "sample_id": sample.sample_id, "policy": label,
                           "budget": budget, "metric": sample.metric,
                           "prompt_tokens": len(sample.prompt_ids), "skipped": f"sample: {err}"}
                          for label, budget, _ in policies]
        else:
            runnable.append(index)
    if runnable:
        first = batch[runnable[0]]
        records = fidelity.evaluate_batch(
            loaded, [batch[i] for i in runnable], policies, max_new_tokens=FLAGS.max_new_tokens,
            agree_tokens=FLAGS.agree_tokens, with_mechanism=FLAGS.mechanism,
            bucket=sample_bucket(first, FLAGS, context), batch_size=batch_size)
        out.update(zip(runnable, records))
    return [out[i] for i in range(len(batch))]


def batches(samples, FLAGS, context: int, size: int) -> list[list]:
    """The samples in groups of at most `size` that share one prompt shape (bucket, or exact
    length with --buckets=) and one number of decode steps, in the order they come."""
    groups = collections.defaultdict(list)
    for sample in samples:
        shape = sample_bucket(sample, FLAGS, context) or len(sample.prompt_ids)
        groups[(shape, new_tokens(sample, FLAGS))].append(sample)
    return [group[i:i + size] for group in groups.values() for i in range(0, len(group), size)]


def batch_size(FLAGS, loaded, samples, policies, context: int) -> tuple[int, str]:
    """(samples per batch, why): --batch_size when given, else as many as the memory budget
    (--memory_budget_mb, default half of the memory available now) holds at the longest
    prompt shape of the run, at most 16."""
    if FLAGS.batch_size:
        return FLAGS.batch_size, "--batch_size"
    if FLAGS.memory_budget_mb:
        budget_mb = FLAGS.memory_budget_mb
    else:   # half of what is free, less the weights the run holds besides the batch
        weights_mb = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(loaded.params))
        budget_mb = max(common.available_mb() / 2 - weights_mb / 1e6, 0.0)
    need_queries = any(p.needs_queries for _, _, p in policies)
    longest = max((sample_bucket(s, FLAGS, context) or (0, len(s.prompt_ids)))[1]
                  for s in samples)
    steps = max(new_tokens(s, FLAGS) for s in samples)
    per_sample = fidelity.batch_bytes(loaded.model.cfg, longest, steps, need_queries) / 1e6
    size = int(max(1, min(16, budget_mb // per_sample)))
    return size, (f"memory budget {budget_mb:.0f} MB / {per_sample:.0f} MB per sample at "
                  f"{longest} prompt slots")


def new_tokens(sample, FLAGS) -> int:
    """Tokens decoded after the sample's prompt: its target (perplexity) or the generation."""
    return len(sample.target_ids) if sample.metric == "ppl" else FLAGS.max_new_tokens


def sample_bucket(sample, FLAGS, context: int) -> tuple[int, int] | None:
    """(smallest length, capacity) of the sample's bucket, or None (--buckets= empty: every
    prompt length compiles its own programs). A bucket never leaves less room than the
    sample's new tokens before the model's `context`: its capacity is capped there."""
    if not FLAGS.buckets:
        return None
    low, capacity = bucket_of(len(sample.prompt_ids), parse_numbers("buckets", FLAGS.buckets, int))
    return low, min(capacity, context - new_tokens(sample, FLAGS))


def prompt_lengths(lengths: list[int], steps: int, context: int, model: str,
                   buckets: list[int] = ()) -> list[int]:
    """--lengths within the model's context: a length whose prompt leaves no room for `steps`
    new tokens is cut to context - steps (as LongBench truncates), one beyond the context, or
    beyond the largest of `buckets` (when given), is an error naming the flag."""
    too_long = [n for n in lengths if n > context]
    if too_long:
        raise ValueError(f"--lengths={','.join(map(str, lengths))}: {too_long[0]} exceeds "
                         f"{model}'s context of {context} tokens")
    if steps >= context:
        raise ValueError(f"{steps} new tokens (--max_new_tokens / --ppl_target_len) leave no room "
                         f"for a prompt in {model}'s context of {context} tokens")
    fitted = sorted({min(n, context - steps) for n in lengths})
    if buckets and fitted[-1] > max(buckets):
        raise ValueError(f"--lengths={','.join(map(str, lengths))}: {fitted[-1]} is longer than "
                         f"the largest of --buckets ({max(buckets)}); add an edge of at least "
                         f"{fitted[-1]}, or --buckets= for exact lengths")
    return fitted


def compilations() -> dict[str, int]:
    """Programs compiled so far: prefill, policy compression, decode loop."""
    return {"prefill": model_module._prefill._cache_size(),
            "compress": compress_batch._cache_size(),
            "decode": decode_loop_batch._cache_size()}


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


def record_key(task: str, sample_id: str, policy: str, budget) -> tuple:
    """Identity of one sample x policy record (what --resume skips)."""
    return (task, sample_id, policy, budget)


# Flags that only choose which records a run makes (or where and how it runs); every other
# flag can change a record, so --resume only reuses records made with the same values of those.
SCOPE_FLAGS = ("task", "policies", "variants", "budgets", "resume", "output_dir", "verbose",
               "policy_chunk", "mechanism", "experiment")


def record_settings(FLAGS) -> dict:
    """The flag values a sample record depends on (all but SCOPE_FLAGS)."""
    return {k: v for k, v in common.flag_values(FLAGS).items() if k not in SCOPE_FLAGS}


def load_finished(out, settings: dict):
    """Per-sample records of an earlier run in `out` (--resume): samples.jsonl.partial when an
    interrupted run left one, else samples.jsonl. Refuses records made with other settings."""
    path = out / "samples.jsonl.partial"
    if not path.exists():
        path = out / "samples.jsonl"
    if not path.exists():
        raise ValueError(f"--resume: no {out / 'samples.jsonl'} to resume from")
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    wanted = common.config_hash(settings)
    foreign = [r for r in records if r.get("config_hash") != wanted]
    if foreign:
        old = json.loads((out / "run_config.json").read_text()) \
            if (out / "run_config.json").exists() else {}
        differ = sorted(k for k in settings if k in old and old[k] != settings[k])
        changes = ", ".join(f"--{k} ({old[k]!r} then, {settings[k]!r} now)" for k in differ)
        why = f"flags that differ: {changes}" if differ else "they carry no or another settings hash"
        raise ValueError(f"--resume: {len(foreign)} of {len(records)} records in {path} were made "
                         f"with other settings ({why}); rerun with those settings, or into a new "
                         "--output_dir")
    print(f"resuming: {len(records)} finished sample x policy records in {path}")
    return records


FIDELITY_FIELDS = ("score", "full_score", "agree", "agree_prefix", "kl")


def aggregate(sample_records, FLAGS):
    """One record per (task, policy, budget): means of the task score, full's score on the same
    samples, greedy agreement with full (exact / prefix share) and KL from full."""
    groups = collections.defaultdict(list)
    for r in sample_records:
        groups[(r["task"], r["policy"], r["budget"])].append(r)
    config = common.flag_values(FLAGS)
    commit = common.git_commit()
    out = []
    for (task, policy, budget), records in groups.items():
        ran = [r for r in records if "skipped" not in r]
        means = {field: float(np.mean([r.get(field, np.nan) for r in ran])) if ran else
                 float("nan") for field in FIDELITY_FIELDS}
        peaks = [r["peak_rss_mb"] for r in ran if "peak_rss_mb" in r]
        means["peak_rss_mb"] = float(np.max(peaks)) if peaks else float("nan")
        out.append({"task": task, "policy": policy, "budget": budget, **means, "n": len(ran),
                    "skipped": len(records) - len(ran), "model": FLAGS.model,
                    "git_commit": commit, "config": config})
    return out


def aggregate_mechanism(sample_records) -> list[dict]:
    """Per (task, policy, budget, layer): mean share of the answer's tokens that survive static
    eviction and that the answer-writing step selects (samples where full wrote the answer)."""
    groups = collections.defaultdict(list)
    for r in sample_records:
        if r.get("mechanism"):
            groups[(r["task"], r["policy"], r["budget"])].append(r["mechanism"])
    rows = []
    for (task, policy, budget), mechs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        layers = len(mechs[0]["survive"])
        for layer in range(layers):
            survive = [m["survive"][layer] for m in mechs]
            select = [m["select"][layer] for m in mechs if m.get("select")]
            rows.append({"task": task, "policy": policy, "budget": budget, "layer": layer,
                         "survive": float(np.nanmean(survive)),
                         "select": float(np.nanmean(select)) if select else float("nan"),
                         "n": len(mechs), "n_select": len(select)})
    return rows


def write_csv(rows: list[dict], columns: list[str], path) -> None:
    common.replace_file(path, lambda tmp: _write_csv(rows, columns, tmp))


def _write_csv(rows: list[dict], columns: list[str], path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in rows:
            writer.writerow([f"{r[c]:.4f}" if isinstance(r[c], float) else r[c] for c in columns])


def write_summary(results, path):
    rows = sorted(results, key=lambda r: (r["task"], r["policy"], str(r["budget"])))
    write_csv(rows, ["task", "policy", "budget", *FIDELITY_FIELDS, "peak_rss_mb", "n", "skipped"],
              path)


METRIC_LABELS = {"score": "score", "agree": "greedy agreement with full",
                 "kl": "KL(full || policy), nats per step"}


def plot_vs_budget(results, path, field: str = "score"):
    """One panel per task: `field` vs budget, one line per policy (full as a dashed level)."""
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
                by_policy[r["policy"]].append((r["budget"], r[field], r["n"]))
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
        ppl = field == "score" and any(r["task"] == task and r.get("full_score", 0) > 1.5
                                       for r in results)
        ax.set_ylabel("perplexity (lower is better)" if ppl else METRIC_LABELS[field])
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


def plot_mechanism(rows: list[dict], path):
    """One panel per task: per layer, the share of the answer's tokens surviving static
    eviction (solid) and selected at the answer step (dashed), one colour per policy@budget."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task_names = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(task_names), figsize=(6 * len(task_names), 4.2), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for ax, task in zip(axes.flat, task_names):
        combos = sorted({(r["policy"], str(r["budget"])) for r in rows if r["task"] == task})
        for i, (policy, budget) in enumerate(combos):
            mine = sorted((r for r in rows if r["task"] == task and r["policy"] == policy
                           and str(r["budget"]) == budget), key=lambda r: r["layer"])
            layers = [r["layer"] for r in mine]
            color = colors[i % len(colors)]
            ax.plot(layers, [r["survive"] for r in mine], color=color,
                    label=f"{policy}@{budget}")
            ax.plot(layers, [r["select"] for r in mine], color=color, linestyle="--")
        ax.set_xlabel("layer")
        ax.set_ylabel("share of answer tokens")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task}: kept by static eviction (solid), selected (dashed)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
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
                scores = [r["score"] for r in sample_records if "skipped" not in r and
                          r["policy"] == policy and
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
    context = registry.get_config(FLAGS.model, FLAGS.num_layers).max_position
    steps = max(FLAGS.max_new_tokens, FLAGS.ppl_target_len if
                {"ppl", "continuation"} & set(task_names) else 0)
    fitted = prompt_lengths(lengths, steps, context, FLAGS.model,   # before any work
                            parse_numbers("buckets", FLAGS.buckets, int))
    for label, budget, policy in policies:
        if policy.reuses:   # a working set no prompt can hold: stop now
            try:
                policy.check_prompt(max(fitted))
            except ValueError as err:
                raise SystemExit(f"--budgets={budget} for {label}: {err}") from None
    out = common.ensure_dir(FLAGS.output_dir or "results/accuracy")
    settings = record_settings(FLAGS)
    settings_hash = common.config_hash(settings)
    all_records = load_finished(out, settings) if FLAGS.resume else []
    loaded = common.with_model_numerics(
        registry.load(FLAGS.model, weights_path=FLAGS.weights_path, cache_dir=FLAGS.cache_dir,
                      seed=FLAGS.seed, num_layers=FLAGS.num_layers), FLAGS)
    if loaded.tokenizer is None:
        raise SystemExit(f"model {FLAGS.model!r} has no tokenizer; accuracy runs need a real model")
    if fitted != sorted(lengths):
        print(f"prompt lengths {fitted}: --lengths cut to leave room for {steps} new tokens in "
              f"{FLAGS.model}'s context of {context}")
    samples = [sample for task in task_names
               for sample in make_samples(FLAGS, task, loaded.tokenizer, fitted, depths)]
    # Records go to samples.jsonl.partial while the run lasts; the previous run's files stay as
    # they were until this run has finished and replaces them all (a failed run mixes nothing).
    samples_path = out / "samples.jsonl.partial"
    finished = {record_key(r["task"], r["sample_id"], r["policy"], r["budget"])
                for r in all_records}
    samples_path.write_text("".join(json.dumps(r) + "\n" for r in all_records))
    chunks = policy_chunks(policies, FLAGS.policy_chunk)
    size, why = batch_size(FLAGS, loaded, samples, policies, context)
    print(f"batches of up to {size} samples ({why})")
    groups = batches(samples, FLAGS, context, size)
    bar = tqdm(total=len(samples) * len(chunks), desc=",".join(task_names), unit="sample")
    compiled = collections.Counter()
    warm_s = []     # wall time per sample of batches that compiled nothing (after warm-up)
    for number, chunk in enumerate(chunks, 1):
        before = compilations()
        for batch in groups:
            todo = [s for s in batch if any(
                record_key(s.task, s.sample_id, label, budget) not in finished
                for label, budget, _ in chunk)]
            bar.update(len(batch) - len(todo))
            if not todo:
                continue
            start, seen = time.perf_counter(), compilations()
            per_sample = evaluate_batch(loaded, todo, chunk, FLAGS, size)
            if compilations() == seen:
                warm_s.extend([(time.perf_counter() - start) / len(todo)] * len(todo))
            records = [{**r, "config_hash": settings_hash} for sample_records in per_sample
                       for r in sample_records
                       if record_key(r["task"], r["sample_id"], r["policy"], r["budget"])
                       not in finished]
            common.write_jsonl(samples_path, records, append=True)
            all_records.extend(records)
            means = collections.defaultdict(list)
            for r in records:
                if "skipped" not in r:
                    means[f"{r['policy']}@{r['budget']}"].append(r["score"])
            bar.update(len(todo))
            bar.set_postfix({k: f"{np.mean(v):.2f}" for k, v in list(means.items())[:4]})
        compiled.update({k: v - before[k] for k, v in compilations().items()})
        if len(chunks) > 1:
            release_compiled_programs()
            tqdm.write(f"policy group {number}/{len(chunks)} done; resident memory "
                       f"{common.resident_mb():.0f} MB")
    bar.close()
    buckets = sorted({sample_bucket(s, FLAGS, context) for s in samples}, key=str)
    print(f"compilations: {dict(compiled)} for {len(policies)} policy x budget programs and "
          f"{len(buckets)} prompt shape(s) {buckets if FLAGS.buckets else '(exact lengths)'}")
    if warm_s:
        print(f"wall time per sample after warm-up (all its policies, batched): median "
              f"{np.median(warm_s):.1f} s over {len(warm_s)} samples")
    results = aggregate(all_records, FLAGS)
    common.replace_file(out / "run_config.json",
                        lambda tmp: tmp.write_text(json.dumps(settings, indent=1, default=str)))
    common.write_jsonl(out / "results.jsonl", results)
    write_summary(results, out / "summary.csv")
    written = ["results.jsonl", "samples.jsonl", "summary.csv"]
    for field in ("score", "agree", "kl"):
        plot_vs_budget(results, out / f"{field}_vs_budget.png", field)
        written.append(f"{field}_vs_budget.png")
    mechanism_rows = aggregate_mechanism(all_records)
    if mechanism_rows:
        write_csv(mechanism_rows, ["task", "policy", "budget", "layer", "survive", "select", "n",
                                   "n_select"], out / "mechanism.csv")
        plot_mechanism(mechanism_rows, out / "mechanism.png")
        written += ["mechanism.csv", "mechanism.png"]
    if "needle" in task_names:
        plot_needle_heatmaps([r for r in all_records if r["task"] == "needle"],
                             out / "needle_heatmap.png")
        written.append("needle_heatmap.png")
    print_table(results, mechanism_rows)
    os.replace(samples_path, out / "samples.jsonl")
    print(f"wrote {out}/: {', '.join(written)}")


def print_table(results, mechanism_rows) -> None:
    width = max([len("task")] + [len(r["task"]) for r in results]) + 2
    print(f"\n{'task':<{width}}{'policy':<22}{'budget':>7}{'score':>8}{'full':>8}{'agree':>7}"
          f"{'prefix':>8}{'kl':>8}{'peak MB':>9}{'n':>4}{'skip':>5}")
    for r in sorted(results, key=lambda r: (r["task"], r["policy"], str(r["budget"]))):
        print(f"{r['task']:<{width}}{r['policy']:<22}{r['budget']!s:>7}{r['score']:>8.3f}"
              f"{r['full_score']:>8.3f}{r['agree']:>7.2f}{r['agree_prefix']:>8.2f}"
              f"{r['kl']:>8.3f}{r.get('peak_rss_mb', float('nan')):>9.0f}{r['n']:>4}"
              f"{r.get('skipped', 0):>5}")
    if mechanism_rows:
        print(f"\n{'mechanism: task':<16}{'policy':<22}{'budget':>7}{'survive':>9}{'select':>8}"
              f"{'n':>4}  (means over layers)")
        groups = collections.defaultdict(list)
        for r in mechanism_rows:
            groups[(r["task"], r["policy"], str(r["budget"]))].append(r)
        def mean(values):   # "-": no sample had one (e.g. every answer began at prefill)
            values = [v for v in values if v is not None and not np.isnan(v)]
            return f"{np.mean(values):.3f}" if values else "-"
        for (task, policy, budget), rows in sorted(groups.items()):
            print(f"{task:<16}{policy:<22}{budget:>7}{mean(r['survive'] for r in rows):>9}"
                  f"{mean(r['select'] for r in rows):>8}{rows[0]['n']:>4}")
