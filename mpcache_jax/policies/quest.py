"""Quest (query-aware page selection) and the machinery every per-step selection baseline
shares (ArkVale, InfLLM, LongCache and PQCache subclass `PageSelectionPolicy`; token-level
methods are pages of one token).

Every prompt token stays in the layer state (no eviction at prefill), arranged as
    [ initial | middle, tiled into pages of `page_size` (last page padded) | local ]
The first `num_initial` and the last `local_ratio * budget` prompt tokens are always
attended; each decode step scores the middle pages against the current query and attends to
the top ones (per KV head). Budget: initial + local + selected pages x page_size <= budget
(a partial page counts whole); at a budget covering the prompt every token is attended, which
is exactly `full`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import primitives as P
from mpcache_jax.cache import append_token
from mpcache_jax.policies.base import (PromptEvictionPolicy, PrunedLayer, attend_selected,
                                       attend_with_new, new_region, prompt_kv)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static arrangement of one prompt: token counts of each region and the page budget."""

    prompt_len: int
    initial: int
    local: int
    page_size: int
    num_pages: int   # pages tiling the middle region
    selected: int    # pages attended per step
    full: bool       # the budget covers the prompt: attend to everything

    @property
    def middle(self) -> int:
        return self.prompt_len - self.initial - self.local

    @property
    def padded(self) -> int:
        return self.num_pages * self.page_size


@dataclasses.dataclass(frozen=True)
class PageSelectionPolicy(PromptEvictionPolicy):
    """Per-step top pages by `page_scores`; subclasses give `digest` and `page_scores`."""

    page_size: int = 16
    num_initial: int = 0
    local_ratio: float = 0.0
    dense_layers: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r} must be a positive integer")
        if self.num_initial < 0 or self.dense_layers < 0:
            raise ValueError(f"num_initial={self.num_initial} and dense_layers="
                             f"{self.dense_layers} must be >= 0")
        if not 0.0 <= self.local_ratio < 1.0:
            raise ValueError(f"local_ratio={self.local_ratio} (share of the budget kept for the "
                             "most recent prompt tokens) must be in [0, 1)")
        if isinstance(self.budget, int):
            self.layout(self.budget + 1)  # a token budget can be checked now

    # --- what subclasses say ---------------------------------------------------------------
    def digest(self, layer: int, k_mid, valid_mid, q, k_prompt, lay: Layout,
               new_capacity: int) -> Any:
        """Per-page summary built once after prefill. k_mid: [H_kv, padded, d]; valid_mid:
        [padded] 0/1; q: [H, T, d] prompt queries (None unless needs_queries); k_prompt:
        [H_kv, T, d] every prompt key."""
        raise NotImplementedError

    def page_scores(self, qg, extras, lay: Layout) -> jax.Array:
        """qg: [H_kv, G, d] current query by GQA group -> [H_kv, num_pages] (higher = attend)."""
        raise NotImplementedError

    def forced_pages(self, state: PrunedLayer, lay: Layout) -> jax.Array | None:
        """0/1 [num_pages] or [H_kv, num_pages] pages always attended this step, or None."""
        return None

    def after_select(self, state: PrunedLayer, mask, k_new, lay: Layout) -> PrunedLayer:
        """Book-keeping after a step selected `mask` [H_kv, num_pages] (default: nothing)."""
        return state

    def static_local(self, budget: int) -> int:
        """Most recent prompt tokens always attended (a fixed slice at the end)."""
        return math.floor(self.local_ratio * budget)

    # --- shared machinery ------------------------------------------------------------------
    def layout(self, prompt_len: int) -> Layout:
        T, s = prompt_len, self.page_size
        B = P.budget_tokens(self.budget, T)
        if B >= T:
            C = math.ceil(T / s)
            return Layout(T, 0, 0, s, C, C, True)
        local = self.static_local(B)
        free = B - self.num_initial - local
        if free < s:
            raise ValueError(
                f"policy {self.name!r}: a budget of {B} prompt tokens (prompt {T}) leaves {free} "
                f"after {self.num_initial} initial and {local} local tokens, less than one page of "
                f"{s}; raise the budget or lower page_size, num_initial or local_ratio")
        C = math.ceil((T - self.num_initial - local) / s)
        return Layout(T, self.num_initial, local, s, C, free // s, False)

    def kept_count(self, prompt_len: int) -> int:
        return prompt_len

    def check_prompt(self, prompt_len: int) -> None:
        self.layout(prompt_len)

    def compress(self, cache, aux, max_new_tokens: int):
        lay = self.layout(aux.prompt_len)
        if self.needs_queries and aux.queries is None:
            raise ValueError(f"policy {self.name!r} scores tokens with the prompt queries: call "
                             "prefill(..., return_queries=True)")
        T, i0, i1 = lay.prompt_len, lay.initial, lay.initial + lay.middle
        pad = lay.padded - lay.middle
        valid_mid = np.concatenate([np.ones(lay.middle, np.float32), np.zeros(pad, np.float32)])
        valid = np.concatenate([np.ones(i0, np.float32), valid_mid, np.ones(lay.local, np.float32)])
        out = []
        for index, layer in enumerate(cache):
            k, v = prompt_kv(layer, T)
            padded = [jnp.concatenate([x[:, :i0], jnp.pad(x[:, i0:i1], ((0, 0), (0, pad), (0, 0))),
                                       x[:, i1:]], axis=1) for x in (k, v)]
            new = new_region(layer, max_new_tokens)
            extras = None
            if not lay.full:
                q = aux.queries[index] if aux.queries is not None else None
                k_mid = padded[0][:, i0:i0 + lay.padded]
                extras = self.digest(index, k_mid, jnp.asarray(valid_mid), q, k, lay, new.capacity)
            state_valid = jnp.broadcast_to(jnp.asarray(valid, k.dtype), padded[0].shape[:2])
            out.append(PrunedLayer(padded[0], padded[1], state_valid, new, extras,
                                   prompt_len=T, kept=T))
        return tuple(out)

    def select(self, q, state: PrunedLayer, lay: Layout) -> jax.Array:
        """Pages attended this step: integer 0/1 [H_kv, num_pages] with `lay.selected` ones.
        q: [H, d]."""
        Hkv = state.k.shape[0]
        qg = q.reshape(Hkv, q.shape[0] // Hkv, q.shape[-1])
        return P.topk_mask(self.page_scores(qg, state.extras, lay), lay.selected,
                           forced=self.forced_pages(state, lay), method=self.topk_method,
                           dtype=jnp.int32)

    def attend(self, layer, q, k_new, v_new, state: PrunedLayer, carry):
        new = append_token(state.new, k_new, v_new)
        state = state.replace(new=new)
        lay = self.layout(state.prompt_len)
        if lay.full or layer < self.dense_layers:
            return attend_with_new(q, state.k, state.v, state.valid, new, self.softmax), state, carry
        mask = self.select(q, state, lay)
        onehot = P.mask_onehot(mask, lay.selected)                       # [H_kv, n, C]
        # initial tokens + selected pages of the middle + local tokens
        out = attend_selected(q, state.k, state.v, state.valid, new, onehot, lay.page_size,
                              lay.initial, lay.initial + lay.padded, self.softmax)
        return out, self.after_select(state, mask.astype(state.k.dtype), k_new, lay), carry


@dataclasses.dataclass(frozen=True)
class Quest(PageSelectionPolicy):
    """Quest: pages of 16 keys summarised by per-channel min/max; page score
    sum_i max(q_i max_i, q_i min_i) (an upper bound of the page's best q . k), summed over the
    query heads of a GQA group; top pages per KV head per step; the first 2 layers dense."""

    name: str = "quest"
    page_size: int = 16
    dense_layers: int = 2

    def digest(self, layer, k_mid, valid_mid, q, k_prompt, lay, new_capacity):
        return P.cluster_bounds(k_mid, lay.page_size, valid_mid)

    def page_scores(self, qg, extras, lay):
        r_max, r_min = extras
        return P.cluster_scores(qg, r_max, r_min, mode="mp")
