"""Autoregressive generation with a fixed-capacity KV cache and any attention policy."""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

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
    """Jitted `policy.compress` (one compilation per policy, prompt length and budget)."""
    return policy.compress(cache, aux, max_new_tokens)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]          # generated ids (stop token included if one was produced)
    prompt_len: int
    stopped: bool              # True when a stop id ended generation early
    step_logits: list[np.ndarray] | None = None  # logits that produced each token (if kept)


def generate(model, params, prompt_ids: Sequence[int], *, max_new_tokens: int,
             policy: AttentionPolicy = FULL, sampling: SamplingConfig = SamplingConfig(),
             stop_ids: Sequence[int] = (), keep_logits: bool = False,
             progress: bool = False) -> GenerationResult:
    """Prefill the prompt, let `policy` compress the cache once, then decode token by token."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
    prompt = list(prompt_ids)
    T = len(prompt)
    if T + max_new_tokens > model.cfg.max_position:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceed the model's "
                         f"context of {model.cfg.max_position} positions")
    cache = model.init_cache(T + max_new_tokens)
    logits, cache, aux = model.prefill(params, prompt, cache, return_queries=policy.needs_queries)
    cache = compress_cache(policy, cache, aux, max_new_tokens)

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
            logits, cache = model.decode_step(params, token, T + step, cache, policy)
    return GenerationResult(tokens=tokens, prompt_len=T, stopped=stopped,
                            step_logits=kept if keep_logits else None)
