"""ArkVale: page-based KV eviction with recall.

Pages of 32 prompt keys are summarised by a bounding volume, either the min/max cuboid or the
cuboid centre +- mean absolute deviation (`bound="mad"`, tighter around the bulk of the page);
a page's importance is sum_i max(q_i hi_i, q_i lo_i). At the end of prefill the last prompt
query keeps the top pages active (the rest are evicted); each decode step re-ranks every page,
so an evicted page whose bound now ranks high is recalled into the active set. With static
shapes the secondary store is the full page table and `active` marks the resident pages.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from mpcache_jax import extent as E
from mpcache_jax import primitives as P
from mpcache_jax.policies.quest import PageSelectionPolicy

BOUNDS = ("cuboid", "mad")


@flax.struct.dataclass
class PageTable:
    """hi, lo: [H_kv, C, d] page bounds; active: [H_kv, C] 0/1 resident pages; recalls:
    [H_kv] pages brought back from the secondary store so far."""

    hi: jax.Array
    lo: jax.Array
    active: jax.Array
    recalls: jax.Array


@dataclasses.dataclass(frozen=True)
class ArkVale(PageSelectionPolicy):
    name: str = "arkvale"
    needs_queries: bool = True
    page_size: int = 32
    bound: str = "cuboid"

    def __post_init__(self):
        super().__post_init__()
        if self.bound not in BOUNDS:
            raise ValueError(f"bound={self.bound!r}; use 'cuboid' (per-channel min/max) or "
                             "'mad' (centre +- mean absolute deviation)")

    def digest(self, layer, k_mid, valid_mid, q, k_prompt, lay, new_capacity):
        bounds = P.cluster_bounds if self.bound == "cuboid" else P.cluster_mad_bounds
        hi, lo = bounds(k_mid, lay.page_size, valid_mid)
        Hkv = k_mid.shape[0]
        zeros = jnp.zeros((Hkv, lay.num_pages), k_mid.dtype)
        table = PageTable(hi, lo, zeros, jnp.zeros((Hkv,), jnp.int32))
        last = q[:, -1] if lay.static else jax.lax.dynamic_index_in_dim(
            q, lay.extent.length - 1, axis=1, keepdims=False)
        last = last.reshape(Hkv, q.shape[0] // Hkv, q.shape[-1])        # last prompt query
        valid = None if lay.static else E.iota_lt(lay.num_pages, lay.pages)
        active = P.topk_mask(self.page_scores(last, table, lay), lay.selected, valid=valid,
                             method=self.topk_method, k_max=lay.selected_max)
        return table.replace(active=active)

    def page_scores(self, qg, extras, lay):
        return P.cluster_scores(qg, extras.hi, extras.lo, mode="mp")

    def after_select(self, state, mask, k_new, lay):
        table = state.extras
        recalled = jnp.sum(mask * (1.0 - table.active), axis=-1).astype(jnp.int32)
        return state.replace(extras=table.replace(active=mask, recalls=table.recalls + recalled))
