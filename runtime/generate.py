"""Autoregressive generation with a fixed-capacity KV cache and any attention policy."""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax.cache import policy_layers, with_policy_layers
from mpcache_jax.policy import FULL, AttentionPolicy, PrefillAux


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; otherwise softmax(logits / temperature) restricted to the top-p mass."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample_token(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits: [V] -> int32 token id."""
    if temperature == 0.0:
        return jnp.argmax(logits).astype(jnp.int32)
    probs = jax.nn.softmax(logits / temperature)
    order = jnp.argsort(-probs)
    sorted_probs = probs[order]
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    keep_sorted = (jnp.cumsum(sorted_probs) - sorted_probs) < top_p
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    masked = jnp.where(keep, jnp.log(probs + 1e-30), -jnp.inf)
    return jax.random.categorical(key, masked).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("policy", "max_new_tokens"))
def compress_cache(policy: AttentionPolicy, cache, aux: PrefillAux, max_new_tokens: int):
    """Jitted `policy.compress` (one compilation per policy, prompt length and budget) of the
    layers the policy manages (`cache.policy_layers`: a model's sliding-window layers keep
    their ring buffers)."""
    return with_policy_layers(cache, policy.compress(policy_layers(cache), aux, max_new_tokens))


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]          # generated ids (stop token included if one was produced)
    prompt_len: int
    stopped: bool              # True when a stop id ended generation early
    step_logits: list[np.ndarray] | None = None  # logits that produced each token (if kept)


def apply_policy(policy: AttentionPolicy, cache, aux: PrefillAux, max_new_tokens: int):
    """The policy's decode cache from a dense prefill cache, never aliasing `cache`.

    Decode steps donate their cache argument; a policy that keeps the dense cache as it is
    (`full`) gets a copy, so the prefill cache can serve further policies.
    """
    if aux.length is not None:  # bucketed: the policy checks the real length here
        check = getattr(policy, "check_prompt", None)
        if check is not None:
            check(int(aux.length))
        check = getattr(policy, "check_bucketed", None)
        if check is not None:
            check(int(aux.length), aux.min_length, aux.prompt_len)
    out = compress_cache(policy, cache, aux, max_new_tokens)
    in_leaves = {id(x) for x in jax.tree_util.tree_leaves(cache)}
    if any(id(x) in in_leaves for x in jax.tree_util.tree_leaves(out)):
        out = jax.tree_util.tree_map(jnp.copy, out)
    return out


# Token id written into the padding of a bucketed prompt (never attended: causal attention
# keeps it away from the real tokens, and decoding overwrites it).
PAD_ID = 0


def bucket_of(length: int, edges: Sequence[int]) -> tuple[int, int]:
    """(smallest length, capacity) of the bucket holding a prompt of `length` tokens: the
    first edge >= length; its smallest length is one more than the edge below."""
    edges = sorted(set(int(e) for e in edges))
    for i, edge in enumerate(edges):
        if length <= edge:
            return (edges[i - 1] + 1 if i else 1), edge
    raise ValueError(f"a prompt of {length} tokens is longer than the largest bucket "
                     f"({edges[-1]}); add a larger bucket edge")


def prefill_prompt(model, params, prompt_ids: Sequence[int], max_new_tokens: int,
                   return_queries: bool = False, bucket: tuple[int, int] | None = None):
    """Prefill into a dense cache with room for `max_new_tokens` more -> (logits, cache, aux).

    bucket: (smallest length, capacity) to pad the prompt to `capacity` slots with its length
    as a runtime value (one compilation of prefill, compress and decode per bucket; the
    result equals the unpadded run's up to float rounding)."""
    T = len(prompt_ids)
    capacity = T if bucket is None else bucket[1]
    if bucket is not None and not bucket[0] <= T <= capacity:
        raise ValueError(f"a prompt of {T} tokens is outside its bucket [{bucket[0]}, {capacity}]")
    if capacity + max_new_tokens > model.cfg.max_position:
        raise ValueError(f"prompt ({capacity}) + max_new_tokens ({max_new_tokens}) exceed the "
                         f"model's context of {model.cfg.max_position} positions")
    cache = model.init_cache(capacity + max_new_tokens)
    if bucket is None:
        return model.prefill(params, list(prompt_ids), cache, return_queries=return_queries)
    padded = list(prompt_ids) + [PAD_ID] * (capacity - T)
    return model.prefill(params, padded, cache, return_queries=return_queries, length=T,
                         min_length=bucket[0])


def decode_tokens(model, params, logits, cache, *, policy: AttentionPolicy, start_pos: int,
                  max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                  stop_ids: Sequence[int] = (), keep_logits: bool = False,
                  progress: bool = False) -> GenerationResult:
    """Sample up to `max_new_tokens` tokens; `logits` are the prompt's last-position logits."""
    key = jax.random.PRNGKey(sampling.seed)
    tokens: list[int] = []
    kept: list[np.ndarray] = []
    stops = set(int(s) for s in stop_ids)
    steps = range(max_new_tokens)
    if progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc="decode", unit="tok", leave=False)
    stopped = False
    for step in steps:
        key, sub = jax.random.split(key)
        if keep_logits:
            kept.append(np.asarray(logits))
        token = int(sample_token(logits, sub, sampling.temperature, sampling.top_p))
        tokens.append(token)
        if token in stops:
            stopped = True
            break
        if step + 1 < max_new_tokens:
            logits, cache = model.decode_step(params, token, start_pos + step, cache, policy)
    return GenerationResult(tokens=tokens, prompt_len=start_pos, stopped=stopped,
                            step_logits=kept if keep_logits else None)


def continuation_nll(model, params, logits, cache, *, policy: AttentionPolicy, start_pos: int,
                     target_ids: Sequence[int]) -> np.ndarray:
    """Teacher-forced negative log-likelihood [len(target_ids)] of a continuation."""
    nll = []
    for step, token in enumerate(target_ids):
        row = np.asarray(logits, np.float64)
        row = row - row.max()
        nll.append(float(np.log(np.exp(row).sum()) - row[int(token)]))
        if step + 1 < len(target_ids):
            logits, cache = model.decode_step(params, int(token), start_pos + step, cache, policy)
    return np.asarray(nll)


def generate(model, params, prompt_ids: Sequence[int], *, max_new_tokens: int,
             policy: AttentionPolicy = FULL, sampling: SamplingConfig = SamplingConfig(),
             stop_ids: Sequence[int] = (), keep_logits: bool = False,
             progress: bool = False) -> GenerationResult:
    """Prefill the prompt, let `policy` compress the cache once, then decode token by token."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
    logits, cache, aux = prefill_prompt(model, params, prompt_ids, max_new_tokens,
                                        return_queries=policy.needs_queries)
    cache = apply_policy(policy, cache, aux, max_new_tokens)
    return decode_tokens(model, params, logits, cache, policy=policy, start_pos=len(prompt_ids),
                         max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                         keep_logits=keep_logits, progress=progress)
