"""LongCache (dynamic baseline of MPCache's Table 4 / Figure 10): every decode step, the
cosine similarity of the query with every cached prompt key, token-level top-k per KV head
(no static eviction, no clustering, no positional-embedding separation, as in MPCache's
comparison). Pages of one token in the shared page-selection machinery.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mpcache_jax import primitives as P
from mpcache_jax.policies.quest import PageSelectionPolicy


@dataclasses.dataclass(frozen=True)
class LongCache(PageSelectionPolicy):
    """Score of token j for KV head h: sum over the group's query heads g of cos(q_g, k_j)."""

    name: str = "longcache"
    page_size: int = 1

    def __post_init__(self):
        if self.page_size != 1:
            raise ValueError(f"LongCache selects single tokens: page_size must be 1, got "
                             f"{self.page_size} (for pages use 'quest' or 'arkvale')")
        super().__post_init__()

    def digest(self, layer, k_mid, valid_mid, q, k_prompt, lay, new_capacity):
        return P.unit_rows(k_mid)                                       # [H_kv, T, d]

    def page_scores(self, qg, extras, lay):
        return jnp.einsum("kd,ktd->kt", jnp.sum(P.unit_rows(qg), axis=1), extras)
