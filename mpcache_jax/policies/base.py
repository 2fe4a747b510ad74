"""Shared machinery of policies that evict prompt tokens once, at prefill.

Layout of a pruned layer: the kept prompt tokens in a static-size region (`k`, `v`, `valid`)
followed by a region for the tokens generated after prefill (`new`, a dense LayerKV).
Budget rule used by every policy: a decode step attends to at most `budget` prompt tokens
plus every token generated since prefill.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import attention
from mpcache_jax import primitives as P
from mpcache_jax.cache import LayerKV, append_token, empty_layer
from mpcache_jax.policy import AttentionPolicy, PrefillAux


@flax.struct.dataclass
class PrunedLayer:
    """k, v: [H_kv, S, d] kept prompt tokens (S static, padded); valid: [H_kv, S] 0/1;
    new: LayerKV [H_kv, max_new, d] of generated tokens; extras: policy-specific pytree;
    prompt_len, kept: static prompt length T and number of kept prompt tokens."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    new: LayerKV
    extras: Any = None
    prompt_len: int = flax.struct.field(pytree_node=False, default=0)
    kept: int = flax.struct.field(pytree_node=False, default=0)


def validate_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget={budget!r} must be a ratio in (0, 1] or a token count")
    P.budget_tokens(budget, 1 << 30)  # raises with a clear message when out of range


def prompt_kv(layer: LayerKV, prompt_len: int) -> tuple[jax.Array, jax.Array]:
    """The prompt's keys/values [H_kv, T, d] from a dense prefill cache."""
    return layer.k[:, :prompt_len], layer.v[:, :prompt_len]


def window_attention_mass(q: jax.Array, k: jax.Array, window: int, reduce: str = "sum"
                          ) -> jax.Array:
    """Attention the last `window` prompt queries give each key, summed (or maxed) over them.

    q: [H, T, d]; k: [H_kv, T, d] -> [H_kv, G, T] (causal within the prompt).
    """
    T = k.shape[1]
    logits = attention.grouped_scores(q[:, T - window:], k)          # [H_kv, G, W, T]
    positions = np.arange(T - window, T)[:, None]
    causal = (np.arange(T)[None, :] <= positions).astype(np.float32)
    probs = attention.masked_softmax(logits, causal)
    return jnp.max(probs, axis=2) if reduce == "max" else jnp.sum(probs, axis=2)


def keep_by_mask(k: jax.Array, v: jax.Array, keep: jax.Array, count: int, capacity: int):
    """Compact the kept tokens (in prompt order) into a region of `capacity` >= count slots.

    k, v: [H_kv, T, d]; keep: [T] or [H_kv, T] 0/1 with exactly `count` ones.
    Returns (k [H_kv, capacity, d], v, valid [H_kv, capacity]).
    """
    Hkv, T, d = k.shape
    if count == T:
        kept_k, kept_v = k, v
    else:
        onehot = P.mask_onehot(jnp.broadcast_to(keep, (Hkv, T)).astype(k.dtype), count)
        kept_k, kept_v = P.gather_rows(onehot, k), P.gather_rows(onehot, v)
    pad = capacity - count
    valid = np.concatenate([np.ones(count, np.float32), np.zeros(pad, np.float32)])
    if pad:
        kept_k = jnp.pad(kept_k, ((0, 0), (0, pad), (0, 0)))
        kept_v = jnp.pad(kept_v, ((0, 0), (0, pad), (0, 0)))
    return kept_k, kept_v, jnp.broadcast_to(jnp.asarray(valid, k.dtype), (Hkv, capacity))


def new_region(like: LayerKV, max_new_tokens: int) -> LayerKV:
    Hkv, _, d = like.k.shape
    return empty_layer(Hkv, max(1, max_new_tokens), d, like.k.dtype)


def attend_with_new(q, k_sel, v_sel, valid_sel, new: LayerKV) -> jax.Array:
    """Attention over selected prompt tokens plus all generated tokens. q: [H, d] -> [H, d]."""
    k_all = jnp.concatenate([k_sel, new.k], axis=1)
    v_all = jnp.concatenate([v_sel, new.v], axis=1)
    valid = jnp.concatenate([valid_sel, jnp.broadcast_to(new.valid(), (k_sel.shape[0], new.capacity))],
                            axis=1)
    return attention.decode_attention(q, k_all, v_all, valid)


@dataclasses.dataclass(frozen=True)
class PromptEvictionPolicy(AttentionPolicy):
    """Keep `budget` prompt tokens per layer, chosen once at prefill by `keep_scores`.

    Subclasses define `keep_scores` (and optionally `forced_keep`); decoding attends to the
    kept tokens plus every generated token.
    """

    budget: float | int = 0.1
    topk_method: str = "lax"

    def __post_init__(self):
        validate_budget(self.budget)
        if self.topk_method not in P.TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r}; use one of {P.TOPK_METHODS}")

    # --- what subclasses say ---------------------------------------------------------------
    def keep_scores(self, layer: int, q, k, prompt_len: int, carry) -> tuple[jax.Array, Any]:
        """Scores [T] or [H_kv, T] (higher = keep) for one layer's prompt tokens."""
        raise NotImplementedError

    def forced_keep(self, prompt_len: int, count: int) -> np.ndarray | None:
        """Static [T] 0/1 mask of tokens always kept, or None."""
        return None

    def keep_mask(self, layer: int, q, k, prompt_len: int, count: int, forced, carry
                  ) -> tuple[jax.Array, Any]:
        """0/1 mask [T] or [H_kv, T] with exactly `count` ones: the top `keep_scores`
        (forced tokens first). Override to select at another granularity."""
        scores, carry = self.keep_scores(layer, q, k, prompt_len, carry)
        return P.topk_mask(scores, count, forced=forced, method=self.topk_method), carry

    # --- shared machinery ------------------------------------------------------------------
    def kept_count(self, prompt_len: int) -> int:
        return P.budget_tokens(self.budget, prompt_len)

    def region_capacity(self, prompt_len: int) -> int:
        return self.kept_count(prompt_len)

    def check_prompt(self, prompt_len: int) -> None:
        """Raise a clear error when this configuration cannot serve a prompt of this length."""

    def compress(self, cache, aux: PrefillAux, max_new_tokens: int):
        T = aux.prompt_len
        self.check_prompt(T)
        if self.needs_queries and aux.queries is None:
            raise ValueError(f"policy {self.name!r} scores tokens with the prompt queries: call "
                             "prefill(..., return_queries=True)")
        count = self.kept_count(T)
        capacity = self.region_capacity(T)
        forced = self.forced_keep(T, count)
        carry = None
        out = []
        for index, layer in enumerate(cache):
            k, v = prompt_kv(layer, T)
            q = aux.queries[index] if aux.queries is not None else None
            if count == T:
                keep = jnp.ones((T,), k.dtype)
            else:
                keep, carry = self.keep_mask(index, q, k, T, count, forced, carry)
            kept_k, kept_v, valid = keep_by_mask(k, v, keep, count, capacity)
            out.append(PrunedLayer(kept_k, kept_v, valid, new_region(layer, max_new_tokens),
                                   self.layer_extras(kept_k, valid), prompt_len=T, kept=count))
        return tuple(out)

    def layer_extras(self, kept_k, valid) -> Any:
        return None

    def free_slots(self, cache) -> int:
        new = cache[0].new
        return int(new.capacity - new.length)

    def attend(self, layer, q, k_new, v_new, state: PrunedLayer, carry):
        new = append_token(state.new, k_new, v_new)
        out = attend_with_new(q, state.k, state.v, state.valid, new)
        return out, state.replace(new=new), carry


@dataclasses.dataclass(frozen=True)
class StreamingLLM(PromptEvictionPolicy):
    """Attention sinks + the most recent prompt tokens (StreamingLLM, 4 sinks)."""

    name: str = "streaming_llm"
    num_sinks: int = 4

    def keep_scores(self, layer, q, k, prompt_len, carry):
        return jnp.arange(prompt_len, dtype=k.dtype), carry  # public: most recent first

    def forced_keep(self, prompt_len, count):
        forced = np.zeros(prompt_len, np.float32)
        forced[: min(self.num_sinks, count)] = 1.0
        return forced
