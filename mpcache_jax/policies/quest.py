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

from mpcache_jax import extent as E
from mpcache_jax import primitives as P
from mpcache_jax.cache import append_token
from mpcache_jax.policies.base import (PromptEvictionPolicy, PrunedLayer, attend_masked,
                                       attend_selected, attend_with_new, new_region, prompt_kv)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Arrangement of one prompt, [initial | middle: num_pages pages | local], and the page
    budget. Slot counts are static; `middle`, `local`, `selected` (tokens in the middle and
    local regions, pages attended per step) are ints, or int32 scalars for a bucketed prompt,
    whose `extent` then holds the runtime length (the local region's last `local` slots hold
    the prompt's last tokens)."""

    prompt_len: int      # prompt slots (T, or the bucket's capacity)
    initial: int
    local_slots: int
    page_size: int
    num_pages: int       # pages tiling the middle region
    selected_max: int    # static bound of `selected`
    full: bool           # the budget covers the prompt: attend to everything
    middle: Any = 0
    local: Any = 0
    selected: Any = 0
    pages: Any = 0       # pages holding middle tokens (= num_pages for a static prompt)
    extent: Any = None

    @property
    def padded(self) -> int:
        return self.num_pages * self.page_size

    @property
    def static(self) -> bool:
        return self.extent is None or self.extent.static

    def count(self, fn, key):
        """fn(prompt length) for this layout's prompt (`Extent.count`)."""
        if self.extent is None:
            return fn(self.prompt_len)
        return self.extent.count(fn, key)


def _layout(policy, prompt_len: int) -> Layout:
    return policy.memo(("layout", prompt_len), lambda: policy.layout(prompt_len))


@dataclasses.dataclass(frozen=True)
class PageSelectionPolicy(PromptEvictionPolicy):
    """Per-step top pages by `page_scores`; subclasses give `digest` and `page_scores`."""

    REQUIRED_HOOKS = ("digest", "page_scores")
    HOOKS = REQUIRED_HOOKS + ("forced_pages", "after_select", "static_local", "check_layout")
    PER_LAYER_BUDGET = False

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

    def check_layout(self, lay: Layout, prompt_len: int) -> None:
        """Raise a clear error when a pruning layout leaves this policy nothing to select
        (default: every layout that holds a page serves)."""

    # --- shared machinery ------------------------------------------------------------------
    def layout(self, prompt_len: int) -> Layout:
        """The static layout of a prompt of `prompt_len` tokens."""
        T, s = prompt_len, self.page_size
        B = P.budget_tokens(self.budget, T)
        if B >= T:
            C = math.ceil(T / s)
            return Layout(T, 0, 0, s, C, C, True, middle=T, local=0, selected=C, pages=C)
        local = self.static_local(B)
        free = B - self.num_initial - local
        if free < s:
            raise ValueError(
                f"policy {self.name!r}: a budget of {B} prompt tokens (prompt {T}) leaves {free} "
                f"after {self.num_initial} initial and {local} local tokens, less than one page of "
                f"{s}; raise the budget or lower page_size, num_initial or local_ratio")
        C = math.ceil((T - self.num_initial - local) / s)
        lay = Layout(T, self.num_initial, local, s, C, free // s, False,
                     middle=T - self.num_initial - local, local=local, selected=free // s,
                     pages=C)
        self.check_layout(lay, prompt_len)
        return lay

    def layout_of(self, extent: E.Extent) -> Layout:
        """The layout of a prompt of this extent: the static layout, or (bucketed prompt)
        slot counts large enough for every length of the bucket and runtime token counts."""
        if extent.static:
            return dataclasses.replace(_layout(self, int(extent.length)), extent=extent)
        lays = [_layout(self, t) for t in self.bucket_lengths(extent.low, extent.capacity)]
        if not lays:
            raise ValueError(f"policy {self.name!r} serves no prompt length in the bucket "
                             f"[{extent.low}, {extent.capacity}]")
        shapes = {(lay.full, lay.initial) for lay in lays}
        local_slots = max(lay.local_slots for lay in lays)
        if len(shapes) > 1:
            raise ValueError(f"policy {self.name!r}: the bucket [{extent.low}, {extent.capacity}] "
                             "holds prompts with different page layouts; use narrower buckets")
        full, initial = shapes.pop()

        def field(name):
            return extent.count(lambda t: getattr(_layout(self, t), name), (self, "layout", name))
        return Layout(extent.capacity, initial, local_slots, self.page_size,
                      max(lay.num_pages for lay in lays), max(lay.selected for lay in lays), full,
                      middle=field("middle"), local=field("local"), selected=field("selected"),
                      pages=field("num_pages"), extent=extent)

    def bucket_lengths(self, low: int, capacity: int) -> tuple[int, ...]:
        """The prompt lengths of a bucket one program serves: every length the policy accepts,
        except, in a bucket where the budget prunes most lengths, the few short ones it
        covers whole (their layout differs; they run as exact-length programs)."""
        return self.memo(("bucket_lengths", low, capacity),
                         lambda: self._bucket_lengths(low, capacity))

    def _bucket_lengths(self, low: int, capacity: int) -> tuple[int, ...]:
        ok = []
        for t in range(low, capacity + 1):
            try:
                ok.append((t, _layout(self, t).full))
            except ValueError:      # a length this policy refuses (check_prompt says why)
                pass
        pruned = [t for t, full in ok if not full]
        return tuple(pruned if pruned else (t for t, _ in ok))

    def check_bucketed(self, length: int, low: int, capacity: int) -> None:
        if length not in self.bucket_lengths(low, capacity):
            self.check_prompt(length)
            raise ValueError(f"policy {self.name!r}: its budget covers a {length}-token prompt "
                             f"whole, unlike the other prompts of the bucket [{low}, "
                             f"{capacity}]; run it unbucketed (--buckets=)")

    def kept_count(self, prompt_len: int) -> int:
        return prompt_len

    def check_prompt(self, prompt_len: int) -> None:
        self.layout(prompt_len)

    def arrange(self, x: jax.Array, lay: Layout) -> jax.Array:
        """Prompt slots [H_kv, T, ...] -> the layout's [initial | middle pages | local] slots
        (middle padding and, for a bucketed prompt, unused slots hold zeros)."""
        i0, S = lay.initial, lay.padded
        if lay.static:
            i1 = i0 + lay.middle
            pad = [(0, 0), (0, S - lay.middle)] + [(0, 0)] * (x.ndim - 2)
            return jnp.concatenate([x[:, :i0], jnp.pad(x[:, i0:i1], pad), x[:, i1:]], axis=1)
        T, L = lay.prompt_len, lay.local_slots
        room = [(0, 0), (0, max(0, i0 + S - T))] + [(0, 0)] * (x.ndim - 2)
        middle = jnp.pad(x, room)[:, i0:i0 + S]
        middle = middle * E.iota_lt(S, lay.middle).reshape((1, S) + (1,) * (x.ndim - 2))
        # The last L prompt slots (positions below 0 only in unused slots: masked below).
        rows = jnp.clip(lay.extent.length - L + jnp.arange(L), 0, T - 1)
        local = jnp.take(x, rows, axis=1)
        used = (jnp.arange(L) >= L - lay.local).astype(x.dtype)
        return jnp.concatenate([x[:, :i0], middle, local * used.reshape((1, L) + (1,) * (x.ndim - 2))],
                               axis=1)

    def compress(self, cache, aux, max_new_tokens: int):
        extent = E.of(aux)
        if extent.static:
            self.check_prompt(extent.length)
        lay = self.layout_of(extent)
        if self.needs_queries and aux.queries is None:
            raise ValueError(f"policy {self.name!r} scores tokens with the prompt queries: call "
                             "prefill(..., return_queries=True)")
        T, i0 = lay.prompt_len, lay.initial
        valid_mid = E.iota_lt(lay.padded, lay.middle)
        if lay.static:
            valid = np.concatenate([np.ones(i0, np.float32), valid_mid,
                                    np.ones(lay.local_slots, np.float32)])
        else:
            local_valid = jnp.arange(lay.local_slots) >= lay.local_slots - lay.local
            valid = jnp.concatenate([jnp.ones(i0, jnp.float32), valid_mid,
                                     local_valid.astype(jnp.float32)])
        out = []
        for index, layer in enumerate(cache):
            k, v = prompt_kv(layer, T)
            padded = [self.arrange(x, lay) for x in (k, v)]
            new = new_region(layer, max_new_tokens)
            extras = None
            if not lay.full:
                q = aux.queries[index] if aux.queries is not None else None
                k_mid = padded[0][:, i0:i0 + lay.padded]
                extras = self.digest(index, k_mid, jnp.asarray(valid_mid), q, k, lay, new.capacity)
            state_valid = jnp.broadcast_to(jnp.asarray(valid, k.dtype), padded[0].shape[:2])
            out.append(PrunedLayer(padded[0], padded[1], state_valid, new, extras,
                                   prompt_len=T, kept=T,
                                   length=None if extent.static else extent.length,
                                   low=extent.low))
        return tuple(out)

    def select(self, q, state: PrunedLayer, lay: Layout) -> jax.Array:
        """Pages attended this step: integer 0/1 [H_kv, num_pages] with `lay.selected` ones.
        q: [H, d]."""
        Hkv = state.k.shape[0]
        qg = q.reshape(Hkv, q.shape[0] // Hkv, q.shape[-1])
        valid = None if lay.static else E.iota_lt(lay.num_pages, lay.pages)
        return P.topk_mask(self.page_scores(qg, state.extras, lay), lay.selected,
                           forced=self.forced_pages(state, lay), valid=valid,
                           method=self.topk_method, dtype=jnp.int32, k_max=lay.selected_max)

    def attend(self, layer, q, k_new, v_new, state: PrunedLayer, carry):
        new = append_token(state.new, k_new, v_new)
        state = state.replace(new=new)
        lay = self.layout_of(state.extent())

        def dense(state):
            return attend_with_new(q, state.k, state.v, state.valid, new, self.softmax), state

        def selecting(state):
            mask = self.select(q, state, lay)
            # initial tokens + selected pages of the middle + local tokens
            region = (lay.initial, lay.initial + lay.padded)
            if P.tracing_for_mpc():
                onehot = P.mask_onehot(mask, lay.selected_max)               # [H_kv, n, C]
                out = attend_selected(q, state.k, state.v, state.valid, new, onehot,
                                      lay.page_size, *region, self.softmax)
            else:
                out = attend_masked(q, state.k, state.v, state.valid, new, mask, lay.page_size,
                                    *region, self.softmax)
            return out, self.after_select(state, mask.astype(state.k.dtype), k_new, lay)
        if lay.full:
            return (*dense(state), carry)
        if isinstance(layer, (int, np.integer)):      # layers run one after another
            return (*(dense if layer < self.dense_layers else selecting)(state), carry)
        # inside the layer loop the (public) layer number is traced: one branch runs
        return (*jax.lax.cond(layer < self.dense_layers, dense, selecting, state), carry)


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
