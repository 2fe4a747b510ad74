"""H2O (Heavy-Hitter Oracle): keep the tokens with the most accumulated attention plus the most
recent ones, half of the budget each, and keep evicting as tokens are generated.

Prefill: a token's score is the attention it receives summed over every prompt query and over
the query heads of its KV head (one kept set per KV head); the last B - B//2 prompt tokens are
kept as the recent window, the B//2 highest-scoring others as heavy hitters.
Decode: each step adds its attention to the scores; the tokens in the recent window (the newest
B - B//2 positions, the new token included) are never dropped; otherwise the lowest
accumulated score leaves (buffer and budget rule: base.DecodeEvictionPolicy).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mpcache_jax.policies.base import DecodeEvictionPolicy, causal_attention_mass


@dataclasses.dataclass(frozen=True)
class H2O(DecodeEvictionPolicy):
    name: str = "h2o"
    needs_queries: bool = True

    @staticmethod
    def recent_count(budget: int) -> int:
        return budget - budget // 2

    def keep_scores(self, layer, q, k, extent, carry):
        length = None if extent.static else extent.length
        return jnp.sum(causal_attention_mass(q, k, length=length), axis=1), carry   # [H_kv, T]

    def forced_keep(self, extent, count):
        return extent.last_tokens(self.recent_count(count))

    def step_scores(self, previous, probs):
        return previous + jnp.sum(probs, axis=1)

    def evictable(self, pos, position, budget):
        return (pos <= position - self.recent_count(budget)).astype(pos.dtype)


REGISTRY = {"h2o": (H2O, {})}
