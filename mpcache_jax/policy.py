"""The attention seam: how a decode step reads and updates each layer's KV cache.

The model computes q/k/v for the new token in every layer and hands them to
`policy.attend`; the policy appends the new token to its per-layer state, decides which
cached tokens take part, and returns the attention output. `full` and every eviction
policy are therefore the same model program with a different (static, hashable) policy.

A policy's life cycle:
  cache = policy.compress(dense_prefill_cache, aux, max_new_tokens)   # once after prefill
  carry = policy.init_carry()                                         # per decode step
  out, state_l, carry = policy.attend(l, q, k_new, v_new, cache[l], carry)  # per layer
`carry` flows from layer to layer inside one decode step (cross-layer index sharing).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax

from mpcache_jax import attention
from mpcache_jax.cache import KVCache, LayerKV, append_token


@flax.struct.dataclass
class PrefillAux:
    """What prefill exposes to policies besides the dense cache.

    queries: per layer [H, T, d] post-RoPE prompt queries (None unless prefill was asked
    for them); prompt_len: static T, the number of prompt slots. Bucketed prompts (padded to
    a bucket, `mpcache_jax.extent`): length = the int32 number of real tokens (a public
    runtime value <= prompt_len), min_length = the smallest length the bucket holds.
    normalized_keys: the model RMS-normalizes every key over its head dimension (QK-norm, as
    Gemma 3): a key's norm then comes from a learned scale, not from the token.
    """

    queries: tuple[jax.Array, ...] | None
    prompt_len: int = flax.struct.field(pytree_node=False)
    length: jax.Array | None = None
    min_length: int = flax.struct.field(pytree_node=False, default=1)
    normalized_keys: bool = flax.struct.field(pytree_node=False, default=False)


@dataclasses.dataclass(frozen=True)
class AttentionPolicy:
    """Dense attention over every cached token (the `full` policy) and the policy interface."""

    name: str = "full"
    # Whether compress() needs the prompt queries from prefill (static eviction scores).
    needs_queries: bool = dataclasses.field(default=False, repr=False)
    # True only for `no_cache`: decode by recomputing the whole sequence (cost comparisons).
    recomputes: bool = dataclasses.field(default=False, repr=False)
    # Softmax normalisation of decode-step attention (attention.SOFTMAX_NORMALIZE); only the
    # MPC cost changes ("divide" is jax.nn.softmax's form, for cost comparisons).
    softmax: str = "reciprocal"

    def __post_init__(self):
        if self.softmax not in attention.SOFTMAX_NORMALIZE:
            raise ValueError(f"softmax={self.softmax!r}; use one of {attention.SOFTMAX_NORMALIZE}")

    def compress(self, cache: KVCache, aux: PrefillAux, max_new_tokens: int) -> KVCache:
        """Turn the dense prefill cache into this policy's decode cache."""
        for layer in cache:
            free = layer.capacity - aux.prompt_len
            if free < max_new_tokens:
                raise ValueError(
                    f"the prefill cache has room for {free} new tokens but {max_new_tokens} were "
                    "requested; allocate capacity >= prompt length + max_new_tokens")
        return cache

    @property
    def tables(self) -> dict:
        """This policy's own memo of what it computes per prompt length (counts a bucketed
        prompt reads from public tables, layouts): it lives and dies with the policy, so a run
        that builds many policies does not grow a process-wide cache."""
        memo = self.__dict__.get("_tables")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_tables", memo)
        return memo

    def memo(self, key, compute):
        """compute(), kept in `tables` under key."""
        tables = self.tables
        if key not in tables:
            tables[key] = compute()
        return tables[key]

    # --- what the runtime and the harnesses ask every policy (defaults: no limits) --------------
    def check_prompt(self, prompt_len: int) -> None:
        """Raise ValueError saying what to change when this configuration cannot serve a
        prompt of `prompt_len` tokens (a budget smaller than what the policy always keeps).
        Called before any work: by the runtime for a bucketed prompt's real length, by the
        harnesses and the node-config check for every length they will run."""

    def check_bucketed(self, length: int, low: int, capacity: int) -> None:
        """Raise ValueError when prompts padded to a bucket of [low, capacity] slots cannot
        share this policy's program (a layout that changes inside the bucket)."""

    def ranked_rows(self, prompt_len: int, num_kv_heads: int) -> tuple[int, int] | None:
        """(rows, candidates of the longest row) one layer's selection ranks per decode step,
        for cost runs choosing a top-k method; None: no ranking, or one over every prompt
        token per KV head."""
        return None

    @property
    def reuses(self) -> bool:
        """Whether decode steps reuse a selection gathered on an earlier step (its working set
        must fit the prompt: `check_prompt`)."""
        return False

    def free_slots(self, cache: KVCache) -> int:
        """How many more tokens the decode cache can take (host-side check before a step)."""
        layer = cache[0]
        return int(layer.capacity - layer.length)

    def init_carry(self) -> Any:
        """Cross-layer state at the start of a decode step (None: nothing shared yet)."""
        return None

    def attend(self, layer: int, q: jax.Array, k_new: jax.Array, v_new: jax.Array,
               state: LayerKV, carry: Any) -> tuple[jax.Array, Any, Any]:
        """q: [H, d]; k_new, v_new: [H_kv, d]. Returns (out [H, d], new state, carry)."""
        state = append_token(state, k_new, v_new)
        return (attention.decode_attention(q, state.k, state.v, state.valid(), self.softmax),
                state, carry)


FULL = AttentionPolicy()


@dataclasses.dataclass(frozen=True)
class NoCache(AttentionPolicy):
    """No KV cache: every decode step recomputes the whole sequence (Table 8 of the MPCache
    paper). Its outputs equal `full`; cost harnesses see `recomputes` and run a full forward
    over prompt + generated tokens per step instead of a cached decode step."""

    name: str = "no_cache"
    recomputes: bool = dataclasses.field(default=True, repr=False)
