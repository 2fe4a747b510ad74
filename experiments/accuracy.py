"""`--experiment=accuracy` (`mpcache accuracy`): every policy x budget on the same prefill of
every sample.

Writes DIR/results.jsonl (one record per task, policy, budget: mean score, n, config, commit),
DIR/samples.jsonl (one record per sample and policy/budget), DIR/summary.csv and plots
(score_vs_budget.png; needle_heatmap.png for the needle task). The flags become an
`AccuracyConfig` once (`from_flags`); the samples come from experiments/task_registry.py, the
records' store is experiments/accuracy_store.py, the results and plots
experiments/accuracy_report.py.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import os
import time

import jax
import numpy as np
from tqdm import tqdm

from experiments import accuracy_report, accuracy_store, common, fidelity
from experiments.accuracy_store import record_key
from experiments.options import build_policies, parse_budget, parse_numbers, parse_variants
from experiments.task_registry import PERPLEXITY_TASKS, SampleSpec, make_samples, parse_tasks
from models import model as model_module
from models import registry
from mpcache_jax import primitives as P
from runtime.generate import bucket_of, compress_batch, decode_loop_batch


@dataclasses.dataclass(frozen=True)
class AccuracyConfig:
    """What an accuracy run reads, typed and checked once (`from_flags`).

    tasks: registered task names; variants: (label, registered name, options) per policy;
    budgets: ratios of the prompt or token counts; buckets: prompt-shape edges (() = exact
    lengths); batch_size 0 = as many samples as memory_budget_mb (0: half of what is free)
    holds; flag_values: every flag of the run as given (the records' settings and config)."""

    model: str = "smollm2-135m"
    tasks: tuple[str, ...] = ("multi_needle",)
    variants: tuple = (("full", "full", {}),)
    budgets: tuple = (0.1,)
    lengths: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = (0.5,)
    num_samples: int = 10
    seed: int = 0
    data_path: str | None = None
    metric: str | None = None
    ppl_target_len: int = 64
    buckets: tuple[int, ...] = ()
    max_new_tokens: int = 24
    agree_tokens: int = 16
    mechanism: bool = False
    batch_size: int = 0
    memory_budget_mb: int = 0
    policy_chunk: int = 0
    output_dir: str = "results/accuracy"
    resume: bool = False
    weights_path: str | None = None
    cache_dir: str | None = None
    num_layers: int | None = None
    activation_impl: str = "exact"
    flag_values: dict = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.policy_chunk < 0:
            raise SystemExit(f"--policy_chunk must be >= 0, got {self.policy_chunk}")

    @classmethod
    def from_flags(cls, FLAGS) -> "AccuracyConfig":
        values = common.flag_values(FLAGS)
        return cls(
            model=FLAGS.model, tasks=tuple(parse_tasks(FLAGS.task)),
            variants=tuple(parse_variants(FLAGS.policies, FLAGS.variants)),
            budgets=tuple(parse_budget(b) for b in FLAGS.budgets),
            lengths=tuple(parse_numbers("lengths", FLAGS.lengths, int)),
            depths=tuple(parse_numbers("depths", FLAGS.depths, float)),
            buckets=tuple(parse_numbers("buckets", FLAGS.buckets, int)),
            num_samples=FLAGS.num_samples, seed=FLAGS.seed, data_path=FLAGS.data_path,
            metric=FLAGS.metric, ppl_target_len=FLAGS.ppl_target_len,
            max_new_tokens=FLAGS.max_new_tokens, agree_tokens=FLAGS.agree_tokens,
            mechanism=FLAGS.mechanism, batch_size=FLAGS.batch_size,
            memory_budget_mb=FLAGS.memory_budget_mb, policy_chunk=FLAGS.policy_chunk,
            output_dir=FLAGS.output_dir or "results/accuracy", resume=FLAGS.resume,
            weights_path=FLAGS.weights_path, cache_dir=FLAGS.cache_dir,
            num_layers=FLAGS.num_layers, activation_impl=FLAGS.activation_impl,
            flag_values=values)

    def recorded(self) -> dict:
        """The run's settings as its records carry them: the flag values when the run came
        from flags, else this config's fields."""
        if self.flag_values:
            return dict(self.flag_values)
        fields = dataclasses.asdict(self)
        fields.pop("flag_values")
        fields["budgets"] = [P.budget_record(b) for b in self.budgets]
        return fields

    def sample_spec(self, lengths: list[int]) -> SampleSpec:
        return SampleSpec(lengths=tuple(lengths), depths=self.depths, num_samples=self.num_samples,
                          seed=self.seed, data_path=self.data_path,
                          target_len=self.ppl_target_len, metric=self.metric)


def evaluate_batch(loaded, batch, policies, cfg: AccuracyConfig,
                   batch_size: int) -> list[list[dict]]:
    """All policies on the samples of one batch (one prompt shape: `batches`) -> per sample,
    its records (task score, agreement and KL with the full cache, mechanism metrics;
    experiments/fidelity.py). A sample that cannot be run (its prompt and new tokens do not
    fit the model's context) gives one `skipped` record per policy with the reason: it never
    ends the run."""
    context = loaded.model.cfg.max_position
    out, runnable = {}, []
    for index, sample in enumerate(batch):
        need = len(sample.prompt_ids) + new_tokens(sample, cfg)
        if need > context:
            err = (f"{len(sample.prompt_ids)} prompt + {new_tokens(sample, cfg)} new tokens "
                   f"exceed the model's context of {context}")
            tqdm.write(f"skipped sample {sample.task}/{sample.sample_id}: {err}")
            out[index] = [{"task": sample.task, "sample_id": sample.sample_id, "policy": label,
                           "budget": P.budget_record(budget), "metric": sample.metric,
                           "prompt_tokens": len(sample.prompt_ids), "skipped": f"sample: {err}"}
                          for label, budget, _ in policies]
        else:
            runnable.append(index)
    if runnable:
        first = batch[runnable[0]]
        records = fidelity.evaluate_batch(
            loaded, [batch[i] for i in runnable], policies, max_new_tokens=cfg.max_new_tokens,
            agree_tokens=cfg.agree_tokens, with_mechanism=cfg.mechanism,
            bucket=sample_bucket(first, cfg, context), batch_size=batch_size)
        out.update(zip(runnable, records))
    return [out[i] for i in range(len(batch))]


def batches(samples, cfg: AccuracyConfig, context: int,
            size: int) -> list[tuple[list, int]]:
    """The samples in groups that share one prompt shape (bucket, or exact length with
    --buckets=) and one number of decode steps, in the order they come, each group cut into
    as few batches of at most `size` as it needs -> [(batch, padded size)]. A group's
    batches are evened out and padded to one size (one compilation per shape), never above
    the group's own count: one sample runs as a batch of one, seven with `size` 5 as 4 + 3
    padded to 4, not 5 + 2 padded to 5."""
    groups = collections.defaultdict(list)
    for sample in samples:
        shape = sample_bucket(sample, cfg, context) or len(sample.prompt_ids)
        groups[(shape, new_tokens(sample, cfg))].append(sample)
    out = []
    for group in groups.values():
        pad_to = -(-len(group) // -(-len(group) // size))
        out += [(group[i:i + pad_to], pad_to) for i in range(0, len(group), pad_to)]
    return out


def batch_size(cfg: AccuracyConfig, loaded, samples, policies,
               context: int) -> tuple[int, str]:
    """(samples per batch, why): --batch_size when given, else as many as the memory budget
    (--memory_budget_mb, default half of the memory available now) holds at the longest
    prompt shape of the run, at most 16."""
    if cfg.batch_size:
        return cfg.batch_size, "--batch_size"
    if cfg.memory_budget_mb:
        budget_mb = cfg.memory_budget_mb
    else:   # half of what is free, less the weights the run holds besides the batch
        weights_mb = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(loaded.params))
        budget_mb = max(common.available_mb() / 2 - weights_mb / 1e6, 0.0)
    need_queries = any(p.needs_queries for _, _, p in policies)
    longest = max((sample_bucket(s, cfg, context) or (0, len(s.prompt_ids)))[1]
                  for s in samples)
    steps = max(new_tokens(s, cfg) for s in samples)
    per_sample = fidelity.batch_bytes(loaded.model.cfg, longest, steps, need_queries) / 1e6
    size = int(max(1, min(16, budget_mb // per_sample)))
    return size, (f"memory budget {budget_mb:.0f} MB / {per_sample:.0f} MB per sample at "
                  f"{longest} prompt slots")


def new_tokens(sample, cfg: AccuracyConfig) -> int:
    """Tokens decoded after the sample's prompt: its target (perplexity) or the generation."""
    return len(sample.target_ids) if sample.metric == "ppl" else cfg.max_new_tokens


def sample_bucket(sample, cfg: AccuracyConfig, context: int) -> tuple[int, int] | None:
    """(smallest length, capacity) of the sample's bucket, or None (--buckets= empty: every
    prompt length compiles its own programs). A bucket never leaves less room than the
    sample's new tokens before the model's `context`: its capacity is capped there."""
    if not cfg.buckets:
        return None
    low, capacity = bucket_of(len(sample.prompt_ids), list(cfg.buckets))
    return low, min(capacity, context - new_tokens(sample, cfg))


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


def run(FLAGS) -> None:
    """`--experiment=accuracy` from the flags."""
    evaluate(AccuracyConfig.from_flags(FLAGS))


def evaluate(cfg: AccuracyConfig) -> list[dict]:
    """The run: every sample of cfg.tasks under every policy x budget -> the results rows
    (also written under cfg.output_dir)."""
    task_names = list(cfg.tasks)
    policies = build_policies(list(cfg.variants), list(cfg.budgets))
    context = registry.get_config(cfg.model, cfg.num_layers).max_position
    steps = max(cfg.max_new_tokens,
                cfg.ppl_target_len if PERPLEXITY_TASKS & set(task_names) else 0)
    fitted = prompt_lengths(list(cfg.lengths), steps, context, cfg.model,   # before any work
                            list(cfg.buckets))
    for label, budget, policy in policies:
        if policy.reuses:   # a working set no prompt can hold: stop now
            try:
                policy.check_prompt(max(fitted))
            except ValueError as err:
                raise SystemExit(f"--budgets={budget} for {label}: {err}") from None
    out = common.ensure_dir(cfg.output_dir)
    settings = accuracy_store.record_settings(cfg.recorded())
    settings_hash = common.config_hash(settings)
    all_records = accuracy_store.load_finished(out, settings) if cfg.resume else []
    loaded = common.with_model_numerics(
        registry.load(cfg.model, weights_path=cfg.weights_path, cache_dir=cfg.cache_dir,
                      seed=cfg.seed, num_layers=cfg.num_layers), cfg)
    if loaded.tokenizer is None:
        raise SystemExit(f"model {cfg.model!r} has no tokenizer; accuracy runs need a real model")
    if fitted != sorted(cfg.lengths):
        print(f"prompt lengths {fitted}: --lengths cut to leave room for {steps} new tokens in "
              f"{cfg.model}'s context of {context}")
    spec = cfg.sample_spec(fitted)
    samples = [sample for task in task_names
               for sample in make_samples(task, loaded.tokenizer, spec)]
    # Records go to samples.jsonl.partial while the run lasts; the previous run's files stay as
    # they were until this run has finished and replaces them all (a failed run mixes nothing).
    samples_path = out / "samples.jsonl.partial"
    finished = {record_key(r["task"], r["sample_id"], r["policy"], r["budget"])
                for r in all_records}
    samples_path.write_text("".join(json.dumps(r) + "\n" for r in all_records))
    chunks = policy_chunks(policies, cfg.policy_chunk)
    size, why = batch_size(cfg, loaded, samples, policies, context)
    print(f"batches of up to {size} samples ({why})")
    groups = batches(samples, cfg, context, size)
    bar = tqdm(total=len(samples) * len(chunks), desc=",".join(task_names), unit="sample")
    compiled = collections.Counter()
    warm_s = []     # wall time per sample of batches that compiled nothing (after warm-up)
    for number, chunk in enumerate(chunks, 1):
        before = compilations()
        for batch, pad_to in groups:
            todo = [s for s in batch if any(
                record_key(s.task, s.sample_id, label, budget) not in finished
                for label, budget, _ in chunk)]
            bar.update(len(batch) - len(todo))
            if not todo:
                continue
            start, seen = time.perf_counter(), compilations()
            per_sample = evaluate_batch(loaded, todo, chunk, cfg, pad_to)
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
                    means[f"{r['policy']}@{P.budget_label(r['budget'])}"].append(r["score"])
            bar.update(len(todo))
            bar.set_postfix({k: f"{np.mean(v):.2f}" for k, v in list(means.items())[:4]})
        compiled.update({k: v - before[k] for k, v in compilations().items()})
        if len(chunks) > 1:
            release_compiled_programs()
            tqdm.write(f"policy group {number}/{len(chunks)} done; resident memory "
                       f"{common.resident_mb():.0f} MB")
    bar.close()
    buckets = sorted({sample_bucket(s, cfg, context) for s in samples}, key=str)
    print(f"compilations: {dict(compiled)} for {len(policies)} policy x budget programs and "
          f"{len(buckets)} prompt shape(s) {buckets if cfg.buckets else '(exact lengths)'}")
    if warm_s:
        print(f"wall time per sample after warm-up (all its policies, batched): median "
              f"{np.median(warm_s):.1f} s over {len(warm_s)} samples")
    results = accuracy_report.aggregate(all_records, cfg.recorded(), cfg.model)
    common.replace_file(out / "run_config.json",
                        lambda tmp: tmp.write_text(json.dumps(settings, indent=1, default=str)))
    written = accuracy_report.write_reports(out, results, all_records, task_names)
    os.replace(samples_path, out / "samples.jsonl")
    print(f"wrote {out}/: {', '.join([*written, 'samples.jsonl'])}")
    return results
