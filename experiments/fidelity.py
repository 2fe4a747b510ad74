"""Per-sample evaluation against the full cache: task score, agreement and KL, mechanism.

An eviction policy is judged by how closely it reproduces the full cache. For one sample the
full cache runs first (`reference`); every policy then decodes from the same prefill:

- generation tasks: greedy decoding. While the policy's tokens equal full's, its step
  distributions are teacher-forced on full's output already; at the first difference the run
  forks: the free branch goes on (its text gives the task score) and a teacher-forced branch
  feeds full's tokens (its distributions give the KL). `agree` = 1 when the first
  `agree_tokens` tokens equal full's, `agree_prefix` = share of them before the first
  difference, `kl` = mean KL(p_full || p_policy) over the decode steps among them (the first
  token comes from the dense prefill for every policy, so step 0 is left out);
- perplexity tasks: both teacher-forced on the reference text; `kl` over every scored step,
  `agree` = share of steps whose argmax equals full's.

Mechanism (policies with static eviction that report attended slots, samples with a known
answer span): per layer, the share of the answer's tokens that survive static eviction
(`survive`) and that the decode step writing the answer's first token attends to (`select`).
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, metrics
from mpcache_jax import analysis
from mpcache_jax.cache import policy_layers
from runtime.generate import apply_policy


@dataclasses.dataclass
class Reference:
    """The full cache's run of one sample: generated (or target) tokens and the logits that
    predicted each of them ([steps, V])."""

    tokens: list[int]
    logits: np.ndarray


def forced_rows(model, params, cache, policy, start_pos: int, inputs) -> list[np.ndarray]:
    """Logits after feeding each of `inputs` (positions start_pos, start_pos + 1, ...)."""
    rows = []
    for step, token in enumerate(inputs):
        logits, cache = model.decode_step(params, int(token), start_pos + step, cache, policy)
        rows.append(np.asarray(logits))
    return rows


def teacher_forced(model, params, logits, cache, policy, start_pos: int, tokens) -> np.ndarray:
    """Logits [len(tokens), V] predicting each of `tokens` given the ones before it
    (`logits`: the prefill's, predicting tokens[0])."""
    return np.stack([np.asarray(logits)] +
                    forced_rows(model, params, cache, policy, start_pos, tokens[:-1]))


def greedy(model, params, logits, cache, policy, start_pos: int, max_new_tokens: int,
           stop_ids) -> Reference:
    tokens, rows = [], []
    stops = set(int(s) for s in stop_ids)
    for step in range(max_new_tokens):
        rows.append(np.asarray(logits))
        token = int(np.argmax(rows[-1]))
        tokens.append(token)
        if token in stops or step + 1 == max_new_tokens:
            break
        logits, cache = model.decode_step(params, token, start_pos + step, cache, policy)
    return Reference(tokens, np.stack(rows))


def compare_greedy(model, params, logits, cache, policy, start_pos: int, ref: Reference,
                   max_new_tokens: int, stop_ids, agree_tokens: int) -> dict:
    """Greedy run of `policy` scored against the reference (see the module docstring)."""
    stops = set(int(s) for s in stop_ids)
    n = min(agree_tokens, len(ref.tokens))
    kls: list[float] = []
    tokens: list[int] = []
    fork = None
    for step in range(max_new_tokens):
        row = np.asarray(logits)
        if fork is None and 0 < step < n:
            kls.append(float(metrics.kl_divergence(ref.logits[step], row)))
        token = int(np.argmax(row))
        tokens.append(token)
        if fork is None and step + 1 < n and token != ref.tokens[step]:
            fork = (step, jax.tree_util.tree_map(jnp.copy, cache))
        if token in stops or step + 1 == max_new_tokens:
            break
        logits, cache = model.decode_step(params, token, start_pos + step, cache, policy)
    if fork is not None:
        step, tf_cache = fork
        forced = forced_rows(model, params, tf_cache, policy, start_pos + step,
                             ref.tokens[step:n - 1])
        kls.extend(float(metrics.kl_divergence(ref.logits[step + 1 + i], row))
                   for i, row in enumerate(forced))
    exact, prefix = metrics.greedy_agreement(ref.tokens, tokens, agree_tokens)
    return {"tokens": tokens, "agree": exact, "agree_prefix": prefix,
            "kl": float(np.mean(kls)) if kls else 0.0}


def compare_forced(model, params, logits, cache, policy, start_pos: int, ref: Reference) -> dict:
    """Teacher-forced run on the reference tokens: perplexity, KL and argmax agreement."""
    rows = teacher_forced(model, params, logits, cache, policy, start_pos, ref.tokens)
    logp = metrics.log_softmax(rows)
    nll = -logp[np.arange(len(ref.tokens)), ref.tokens]
    return {"ppl": float(math.exp(nll.mean())),
            "kl": float(np.mean(metrics.kl_divergence(ref.logits, rows))),
            "agree": float(np.mean(rows.argmax(-1) == ref.logits.argmax(-1)))}


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


def check_policy(policy, prompt_len: int, aux) -> None:
    """Raise ValueError when the policy's configuration cannot serve this prompt length (e.g.
    a budget smaller than its always-selected clusters) or this bucket."""
    check = getattr(policy, "check_prompt", None)
    if check is not None:
        check(prompt_len)
    check = getattr(policy, "check_bucketed", None)
    if check is not None and aux.length is not None:
        check(prompt_len, aux.min_length, aux.prompt_len)


def evaluate_policies(loaded, sample, policies, *, max_new_tokens: int, agree_tokens: int,
                      with_mechanism: bool, bucket: tuple[int, int] | None = None) -> list[dict]:
    """Every (label, budget, policy) on one prefill of `sample` -> one record each.
    bucket: (smallest length, capacity) to pad the prompt to (one compilation per bucket)."""
    from runtime.generate import prefill_prompt
    from mpcache_jax.policy import FULL
    model, params, tok = loaded.model, loaded.params, loaded.tokenizer
    forced = sample.metric == "ppl"
    steps = len(sample.target_ids) if forced else max_new_tokens
    need_queries = any(p.needs_queries for _, _, p in policies)
    common.reset_peak_rss()      # the reference's window: prefill + full's decoding
    logits, dense, aux = prefill_prompt(model, params, sample.prompt_ids, steps, need_queries,
                                        bucket=bucket)
    T = len(sample.prompt_ids)
    prefill_peak = common.peak_rss_mb()
    reference_cache = apply_policy(FULL, dense, aux, steps)
    if forced:
        ref = Reference(list(sample.target_ids),
                        teacher_forced(model, params, logits, reference_cache, FULL, T,
                                       sample.target_ids))
        logp = metrics.log_softmax(ref.logits)
        ref_score = float(math.exp(-logp[np.arange(len(ref.tokens)), ref.tokens].mean()))
        ref_text = ""
    else:
        ref = greedy(model, params, logits, reference_cache, FULL, T, steps, tok.stop_ids)
        ref_text = tok.decode(ref.tokens)
        ref_score = metrics.score(sample.metric, ref_text, sample.answers)
    step = None if forced else answer_step(tok, ref.tokens, sample.answers)
    reference_peak = common.peak_rss_mb()
    records = []
    for label, budget, policy in policies:
        start = time.perf_counter()
        common.reset_peak_rss()  # this policy's window: its compression + decoding
        base = {"task": sample.task, "sample_id": sample.sample_id, "policy": label,
                "budget": budget, "metric": sample.metric, "prompt_tokens": T,
                "answers": sample.answers, "full_score": ref_score, **sample.meta}
        try:
            check_policy(policy, T, aux)
        except ValueError as err:   # this configuration cannot serve this prompt length
            records.append({**base, "skipped": str(err)})
            continue
        if policy is FULL or policy.name == "full":
            result = {"score": ref_score, "output": ref_text, "agree": 1.0, "agree_prefix": 1.0,
                      "kl": 0.0, "peak_rss_mb": reference_peak}
        else:
            cache = apply_policy(policy, dense, aux, steps)
            if forced:
                run = compare_forced(model, params, logits, cache, policy, T, ref)
                result = {"score": run["ppl"], "output": "", "agree": run["agree"],
                          "agree_prefix": run["agree"], "kl": run["kl"]}
            else:
                run = compare_greedy(model, params, logits, cache, policy, T, ref, steps,
                                     tok.stop_ids, agree_tokens)
                text = tok.decode(run["tokens"])
                result = {"score": metrics.score(sample.metric, text, sample.answers),
                          "output": text, "agree": run["agree"],
                          "agree_prefix": run["agree_prefix"], "kl": run["kl"]}
        # A run of this policy alone: the shared prefill's peak or its own, whichever is higher.
        result.setdefault("peak_rss_mb", max(prefill_peak, common.peak_rss_mb()))
        record = {**base, **result, "decode_s": round(time.perf_counter() - start, 3)}
        if (with_mechanism and sample.answer_spans and not forced and
                analysis.supports_mechanism(policy)):
            record["mechanism"] = mechanism(model, params, policy, dense, aux, logits, T, ref,
                                            step, sample.answer_spans, steps)
        records.append(record)
    return records
