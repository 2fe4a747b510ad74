"""Per-sample evaluation against the full cache: task score, agreement and KL, mechanism.

An eviction policy is judged by how closely it reproduces the full cache. For each sample the
full cache runs first (the reference); every policy then decodes from the same prefill:

- generation tasks: greedy decoding, twice per policy: freely (its text gives the task score;
  `agree` = 1 when its first `agree_tokens` tokens equal full's, `agree_prefix` = share of
  them before the first difference) and teacher-forced on full's tokens, whose distributions
  give `kl` = mean KL(p_full || p_policy) over the decode steps among the first
  `agree_tokens` (the first token comes from the dense prefill for every policy, so step 0 is
  left out). Up to the first difference the two runs are one and the same computation;
- perplexity tasks: both teacher-forced on the reference text; `kl` over every scored step,
  `agree` = share of steps whose argmax equals full's.

Samples of one prompt shape go through the device together (`evaluate_batch`): each is
prefilled alone, then the reference and each policy decode the whole batch in one loop.

Mechanism (policies with static eviction that report attended slots, samples with a known
answer span): per layer, the share of the answer's tokens that survive static eviction
(`survive`) and that the decode step writing the answer's first token attends to (`select`).
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax.numpy as jnp
import numpy as np

from experiments import common, metrics
from mpcache_jax import analysis
from mpcache_jax import primitives as P
from mpcache_jax.cache import policy_layers
from runtime.generate import apply_policy, check_serves


@dataclasses.dataclass
class Reference:
    """The full cache's run of one sample: generated (or target) tokens and the logits that
    predicted each of them ([steps, V])."""

    tokens: list[int]
    logits: np.ndarray


def answer_step(tokenizer, tokens: list[int], answers: list[str]) -> int | None:
    """Index of the generated token that starts the first answer found in the decoded output
    (case-insensitive), or None when the output holds no answer."""
    text = tokenizer.decode(tokens).lower()
    starts = [text.find(a.lower()) for a in answers if a]
    starts = [s for s in starts if s >= 0]
    if not starts:
        return None
    first = min(starts)
    for t in range(len(tokens)):
        if len(tokenizer.decode(tokens[:t + 1])) > first:
            return t
    return None


def mechanism(model, params, policy, dense, aux, logits, start_pos: int, ref: Reference,
              step: int | None, spans, max_new_tokens: int) -> dict:
    """Per-layer answer-span survival after static eviction and selection at `step` (the
    decode step whose logits write the answer; None/0: the answer came from prefill)."""
    keep = analysis.prompt_keep_masks(policy, dense, aux)
    out = {"survive": [analysis.span_coverage(m, spans) for m in keep], "select": None,
           "answer_step": step}
    if not step:
        return out
    probe = analysis.SelectionProbe(inner=policy)
    cache = apply_policy(probe, dense, aux, max_new_tokens)
    for t in range(step):
        logits, cache = model.decode_step(params, ref.tokens[t], start_pos + t, cache, probe)
    attended = analysis.attended_positions(
        [np.asarray(s.attended) for s in policy_layers(cache)], keep)
    out["select"] = [analysis.span_coverage(m, spans) for m in attended]
    return out


def sample_steps(sample, max_new_tokens: int) -> int:
    """Decode steps of a sample: its target's length (perplexity) or the generation's."""
    return len(sample.target_ids) if sample.metric == "ppl" else max_new_tokens


# Caches of one sample a batch holds at once, in units of its dense cache: the dense prefill
# cache, a policy's decode cache, and the decode loop's carried and temporary copies. Measured:
# SmolLM2 at 2048 tokens, batches of 16, peak resident memory 7.8-8.0 GB with `full` and
# `mpcache_exact` (2026-11-26).
CACHE_COPIES = 5


def batch_bytes(cfg, capacity: int, steps: int, need_queries: bool) -> int:
    """What one sample of a batch holds at most, in bytes (float32): CACHE_COPIES times its
    dense cache, the prompt queries when a policy reads them, and the logits kept for the
    reference and for a policy ([steps, V] each)."""
    global_layers = cfg.num_layers - sum(cfg.local_layers)
    local = sum(cfg.local_layers) * min(cfg.sliding_window or 0, capacity + steps)
    kv = 2 * cfg.num_kv_heads * cfg.head_dim * (global_layers * (capacity + steps) + local)
    queries = global_layers * cfg.num_heads * capacity * cfg.head_dim if need_queries else 0
    return 4 * (CACHE_COPIES * kv + queries + 2 * steps * cfg.vocab_size)


def evaluate_batch(loaded, samples, policies, *, max_new_tokens: int, agree_tokens: int,
                   with_mechanism: bool, bucket: tuple[int, int] | None = None,
                   batch_size: int | None = None) -> list[list[dict]]:
    """Every (label, budget, policy) on the samples of one batch -> one list of records per
    sample (see the module docstring for what each record holds).

    The samples share one prompt shape (exact length, or `bucket` = (smallest length,
    capacity): prompts padded to the capacity) and one number of decode steps. Each is
    prefilled once, alone; then the reference and every policy decode the whole batch at
    once on the device (`runtime.generate.decode_loop_batch`), the batch padded to
    `batch_size` samples (one compilation per shape) with copies of its last sample.
    """
    from runtime.generate import (compress_batch, decode_loop_batch, prefill_prompt,
                                  stack_samples, take_sample, unaliased)
    from mpcache_jax.policy import FULL
    model, params, tok = loaded.model, loaded.params, loaded.tokenizer
    forced = samples[0].metric == "ppl"
    steps = sample_steps(samples[0], max_new_tokens)
    if any((s.metric == "ppl") != forced or sample_steps(s, max_new_tokens) != steps
           for s in samples):
        raise ValueError("a batch mixes perplexity and generation samples, or decode lengths")
    need_queries = any(p.needs_queries for _, _, p in policies)
    real = len(samples)
    size = max(real, batch_size or real)
    common.reset_peak_rss()      # the reference's window: prefills + full's decoding
    prefilled = [prefill_prompt(model, params, s.prompt_ids, steps, need_queries, bucket=bucket)
                 for s in samples]
    prefilled += [prefilled[-1]] * (size - real)
    logits = jnp.stack([p[0] for p in prefilled])
    dense = stack_samples([p[1] for p in prefilled])
    aux = stack_samples([p[2] for p in prefilled])
    del prefilled
    lengths = [len(s.prompt_ids) for s in samples] + [len(samples[-1].prompt_ids)] * (size - real)
    start = jnp.asarray(lengths, jnp.int32)
    stop_ids = jnp.asarray(sorted(set(int(t) for t in tok.stop_ids)), jnp.int32).reshape(-1)
    prefill_peak = common.peak_rss_mb()

    def run(policy, cache, forced_tokens=None, n_forced=0, limit=steps):
        """(tokens, counts, logits rows) as numpy: greedy decoding after the first `n_forced`
        steps, which feed `forced_tokens` [size, steps]; `limit` steps in all. Every run is
        one program per policy (these are runtime values). The loop's final cache is dropped
        at once (it is as large as the batch's caches)."""
        fed = np.zeros((size, steps), np.int32)
        if forced_tokens is not None:
            fed[:, :forced_tokens.shape[1]] = forced_tokens
        tokens, counts, _, rows, _ = decode_loop_batch(
            model, policy, params, logits, cache, start, stop_ids, jnp.asarray(fed),
            jnp.full((size,), n_forced, jnp.int32), jnp.full((size,), limit, jnp.int32),
            steps=steps, keep_logits=True)
        return np.asarray(tokens), np.asarray(counts), np.asarray(rows)

    if forced:
        targets = np.asarray([list(s.target_ids) for s in samples] +
                             [list(samples[-1].target_ids)] * (size - real), np.int32)
        _, _, ref_rows = run(FULL, unaliased(compress_batch(FULL, dense, aux, steps), dense),
                             targets, steps)
        refs = [Reference(list(s.target_ids), ref_rows[i]) for i, s in enumerate(samples)]
    else:
        tokens, counts, ref_rows = run(FULL, unaliased(compress_batch(FULL, dense, aux, steps),
                                                       dense))
        refs = [Reference([int(t) for t in tokens[i, :counts[i]]], ref_rows[i, :counts[i]])
                for i in range(real)]
    del ref_rows
    reference_peak = common.peak_rss_mb()
    out: list[list[dict]] = [[] for _ in samples]
    ref_scores, ref_texts, answer_steps = [], [], []
    for sample, ref in zip(samples, refs):
        if forced:
            logp = metrics.log_softmax(ref.logits)
            ref_scores.append(float(math.exp(-logp[np.arange(len(ref.tokens)),
                                                   ref.tokens].mean())))
            ref_texts.append("")
            answer_steps.append(None)
        else:
            ref_texts.append(tok.decode(ref.tokens))
            ref_scores.append(metrics.score(sample.metric, ref_texts[-1], sample.answers))
            answer_steps.append(answer_step(tok, ref.tokens, sample.answers))
    n_forced = min(agree_tokens, steps)
    ref_fed = np.zeros((size, n_forced), np.int32)   # the reference's tokens, fed to a policy
    for i, ref in enumerate(refs):
        fed = ref.tokens[:n_forced]
        ref_fed[i, :len(fed)] = fed
    for label, budget, policy in policies:
        started = time.perf_counter()
        common.reset_peak_rss()  # this policy's window: its compression + decoding
        bases = [{"task": s.task, "sample_id": s.sample_id, "policy": label,
                  "budget": P.budget_record(budget),
                  "metric": s.metric, "prompt_tokens": len(s.prompt_ids), "answers": s.answers,
                  "full_score": score, "batch": real, **s.meta}
                 for s, score in zip(samples, ref_scores)]
        problems = []
        for i, sample in enumerate(samples):
            try:
                check_serves(policy, len(sample.prompt_ids), take_sample(aux, i))
                problems.append(None)
            except ValueError as err:   # this configuration cannot serve this prompt length
                problems.append(str(err))
        if all(problems):
            for i in range(real):
                out[i].append({**bases[i], "skipped": problems[i]})
            continue
        results = []
        if policy is FULL or policy.name == "full":
            results = [{"score": ref_scores[i], "output": ref_texts[i], "agree": 1.0,
                        "agree_prefix": 1.0, "kl": 0.0, "peak_rss_mb": reference_peak}
                       for i in range(real)]
        elif forced:
            _, _, rows = run(policy, compress_batch(policy, dense, aux, steps), targets, steps)
            for i, ref in enumerate(refs):
                run_i = forced_metrics(rows[i], ref)
                results.append({"score": run_i["ppl"], "output": "", "agree": run_i["agree"],
                                "agree_prefix": run_i["agree"], "kl": run_i["kl"]})
        else:
            _, _, rows = run(policy, compress_batch(policy, dense, aux, steps), ref_fed,
                             n_forced, n_forced)
            tokens, counts, _ = run(policy, compress_batch(policy, dense, aux, steps))
            for i, (sample, ref) in enumerate(zip(samples, refs)):
                generated = [int(t) for t in tokens[i, :counts[i]]]
                n = min(agree_tokens, len(ref.tokens))
                kls = [float(metrics.kl_divergence(ref.logits[t], rows[i, t]))
                       for t in range(1, n)]
                exact, prefix = metrics.greedy_agreement(ref.tokens, generated, agree_tokens)
                text = tok.decode(generated)
                results.append({"score": metrics.score(sample.metric, text, sample.answers),
                                "output": text, "agree": exact, "agree_prefix": prefix,
                                "kl": float(np.mean(kls)) if kls else 0.0})
        elapsed = time.perf_counter() - started
        peak = max(prefill_peak, common.peak_rss_mb())
        for i, (sample, result) in enumerate(zip(samples, results)):
            if problems[i]:
                out[i].append({**bases[i], "skipped": problems[i]})
                continue
            result.setdefault("peak_rss_mb", peak)
            record = {**bases[i], **result, "decode_s": round(elapsed / real, 3)}
            if (with_mechanism and sample.answer_spans and not forced and
                    analysis.supports_mechanism(policy)):
                record["mechanism"] = mechanism(
                    model, params, policy, take_sample(dense, i), take_sample(aux, i), logits[i],
                    len(sample.prompt_ids), refs[i], answer_steps[i], sample.answer_spans, steps)
            out[i].append(record)
    return out


def forced_metrics(rows: np.ndarray, ref: Reference) -> dict:
    """A policy's teacher-forced logits [steps, V] on the reference tokens: perplexity, KL and
    argmax agreement with the reference's."""
    logp = metrics.log_softmax(rows)
    nll = -logp[np.arange(len(ref.tokens)), ref.tokens]
    return {"ppl": float(math.exp(nll.mean())),
            "kl": float(np.mean(metrics.kl_divergence(ref.logits, rows))),
            "agree": float(np.mean(rows.argmax(-1) == ref.logits.argmax(-1)))}


def evaluate_policies(loaded, sample, policies, *, max_new_tokens: int, agree_tokens: int,
                      with_mechanism: bool, bucket: tuple[int, int] | None = None) -> list[dict]:
    """Every (label, budget, policy) on one prefill of `sample` -> one record each (a batch
    of one: `evaluate_batch`)."""
    return evaluate_batch(loaded, [sample], policies, max_new_tokens=max_new_tokens,
                          agree_tokens=agree_tokens, with_mechanism=with_mechanism,
                          bucket=bucket)[0]
