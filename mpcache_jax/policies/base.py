"""Shared machinery of policies that evict prompt tokens once, at prefill.

Layout of a pruned layer: the kept prompt tokens in a static-size region (`k`, `v`, `valid`)
followed by a region for the tokens generated after prefill (`new`, a dense LayerKV).
Budget rule used by every policy: a decode step attends to at most `budget` prompt tokens
plus every token generated since prefill (`primitives.budget_tokens`: a ratio of the prompt,
a token count, or a ratio with a floor in tokens, `primitives.Budget`).

Prompt lengths are static ints or, for bucketed prompts, public runtime values: every count
that depends on the prompt length T is written as a function of an int and evaluated through
`mpcache_jax.extent.Extent` (`count` for the value, `bound` for static shapes).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import attention
from mpcache_jax import extent as E
from mpcache_jax import primitives as P
from mpcache_jax.cache import (LayerKV, append_token, empty_layer, nested_field,
                               public_field, secret_field)
from mpcache_jax.policy import AttentionPolicy, PrefillAux


@flax.struct.dataclass
class PrunedLayer:
    """k, v: [H_kv, S, d] kept prompt tokens (S static, padded); valid: [H_kv, S] 0/1;
    new: LayerKV [H_kv, max_new, d] of generated tokens; extras: policy-specific pytree;
    working: the selected prompt tokens gathered at the last refresh (`WorkingSet`, policies
    that reuse a selection over several decode steps) or None;
    prompt_len, kept: static prompt slots T and number of kept prompt tokens (for a bucketed
    prompt: the bucket's capacity and the largest kept count; `length` is then the int32
    number of real prompt tokens and `low` the bucket's smallest length)."""

    k: jax.Array = secret_field()
    v: jax.Array = secret_field()
    valid: jax.Array = secret_field()
    new: LayerKV = nested_field()
    extras: Any = secret_field(default=None)
    prompt_len: int = flax.struct.field(pytree_node=False, default=0)
    kept: int = flax.struct.field(pytree_node=False, default=0)
    length: jax.Array | None = public_field(default=None)
    low: int = flax.struct.field(pytree_node=False, default=1)
    working: "WorkingSet | None" = nested_field(default=None)

    def extent(self) -> E.Extent:
        """The prompt's extent (static or runtime length)."""
        if self.length is None:
            return E.Extent(self.prompt_len, self.prompt_len)
        return E.Extent(self.prompt_len, self.length, self.low)


def validate_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float, P.Budget)):
        raise ValueError(f"budget={budget!r} must be a ratio in (0, 1], a token count or a "
                         "primitives.Budget (a ratio with a floor in tokens)")
    P.budget_tokens(budget, 1 << 30)  # raises with a clear message when out of range


def prompt_kv(layer: LayerKV, prompt_len: int) -> tuple[jax.Array, jax.Array]:
    """The prompt's keys/values [H_kv, T, d] from a dense prefill cache (T prompt slots)."""
    return layer.k[:, :prompt_len], layer.v[:, :prompt_len]


# The most score elements (float32) a vote scores at once: a longer voting window is scored in
# blocks of query rows (llama2-d1024's 20% window at 32768 tokens would otherwise hold
# 32 x 6554 x 32768 scores, 27 GB, per layer). Below it the one-block program is unchanged.
VOTE_BLOCK_ELEMENTS = 1 << 28


def window_attention_mass(q: jax.Array, k: jax.Array, window, reduce: str = "sum",
                          extent: E.Extent | None = None, window_max: int | None = None,
                          block_elements: int | None = None) -> jax.Array:
    """Attention the last `window` prompt queries give each key, summed (or maxed) over them.

    q: [H, T, d]; k: [H_kv, T, d] -> [H_kv, G, T] (causal within the prompt). For a bucketed
    prompt (`extent` with a runtime length) `window` is an int32 scalar <= window_max: the
    window_max queries ending at the last real token are scored and the earlier ones masked.
    When H x rows x T exceeds `block_elements` (default VOTE_BLOCK_ELEMENTS) the rows go in
    blocks (a `lax.scan`, the sum or max carried): the same result up to float summation
    order, in bounded memory.
    """
    H, T, _ = q.shape
    block_elements = VOTE_BLOCK_ELEMENTS if block_elements is None else block_elements
    static = extent is None or extent.static
    rows_max = window if static else window_max
    per_block = max(1, block_elements // (H * T))
    if rows_max > per_block:
        end = T if static else extent.length
        return _blocked_window_mass(q, k, window, reduce, end, rows_max, per_block)
    if static:
        logits = attention.grouped_scores(q[:, T - window:], k)      # [H_kv, G, W, T]
        positions = np.arange(T - window, T)[:, None]
        causal = (np.arange(T)[None, :] <= positions).astype(np.float32)
        probs = attention.masked_softmax(logits, causal)
    else:
        start = jnp.maximum(extent.length - window_max, 0)
        rows = jax.lax.dynamic_slice_in_dim(q, start, window_max, axis=1)
        positions = (start + jnp.arange(window_max))[:, None]
        causal = jnp.arange(T)[None, :] <= positions
        counted = (positions >= extent.length - window) & (positions < extent.length)
        probs = attention.masked_softmax(attention.grouped_scores(rows, k), causal)
        probs = probs * counted.astype(probs.dtype)
    return jnp.max(probs, axis=2) if reduce == "max" else jnp.sum(probs, axis=2)


def _blocked_window_mass(q, k, window, reduce, end, rows_max: int, per_block: int):
    """window_attention_mass over the rows [end - rows_max, end) in equal blocks of at most
    `per_block` rows. end, window: ints or int32 [] (public). A block's nominal rows are
    [first, first + rows); the first block may start before row 0, where dynamic_slice
    shifts it: rows outside the nominal range, or before end - window, count for nothing."""
    T = q.shape[1]
    blocks = -(-rows_max // per_block)
    rows = -(-rows_max // blocks)
    keys = jnp.arange(T)[None, :]

    def body(acc, index):
        first = end - blocks * rows + index * rows                  # nominal first row
        taken = jnp.clip(first, 0, T - rows)                        # where dynamic_slice reads
        positions = (taken + jnp.arange(rows))[:, None]
        counted = ((positions >= first) & (positions < first + rows)
                   & (positions >= end - window) & (positions < end))
        probs = attention.masked_softmax(
            attention.grouped_scores(jax.lax.dynamic_slice_in_dim(q, taken, rows, axis=1), k),
            keys <= positions)
        probs = probs * counted.astype(probs.dtype)
        part = jnp.max(probs, axis=2) if reduce == "max" else jnp.sum(probs, axis=2)
        return (jnp.maximum(acc, part) if reduce == "max" else acc + part), None

    H_kv = k.shape[0]
    init = jnp.zeros((H_kv, q.shape[0] // H_kv, T), q.dtype)
    return jax.lax.scan(body, init, jnp.arange(blocks))[0]


def keep_by_mask(k: jax.Array, v: jax.Array, keep: jax.Array, count, capacity: int):
    """Compact the kept tokens (in prompt order) into a region of `capacity` >= count slots.

    k, v: [H_kv, T, d]; keep: [T] or [H_kv, T] 0/1 with exactly `count` ones (count: an int,
    or an int32 scalar <= capacity for a bucketed prompt).
    Returns (k [H_kv, capacity, d], v, valid [H_kv, capacity]).
    """
    Hkv, T, d = k.shape
    if not isinstance(count, (int, np.integer)):
        onehot = P.mask_onehot(jnp.broadcast_to(keep, (Hkv, T)).astype(k.dtype), capacity)
        valid = E.iota_lt(capacity, count).astype(k.dtype)
        return (P.gather_rows(onehot, k), P.gather_rows(onehot, v),
                jnp.broadcast_to(valid, (Hkv, capacity)))
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


def _layer_counts(policy, num_layers: int, prompt_len: int) -> tuple[int, ...]:
    return policy.memo(("layer_counts", num_layers, prompt_len),
                       lambda: tuple(policy.kept_counts(num_layers, prompt_len)))


def new_region(like: LayerKV, max_new_tokens: int) -> LayerKV:
    Hkv, _, d = like.k.shape
    return empty_layer(Hkv, max(1, max_new_tokens), d, like.k.dtype)


def attend_with_new(q, k_sel, v_sel, valid_sel, new: LayerKV, normalize: str = "reciprocal"
                    ) -> jax.Array:
    """Attention over selected prompt tokens plus all generated tokens. q: [H, d] -> [H, d]."""
    k_all = jnp.concatenate([k_sel, new.k], axis=1)
    v_all = jnp.concatenate([v_sel, new.v], axis=1)
    valid = jnp.concatenate([valid_sel, jnp.broadcast_to(new.valid(), (k_sel.shape[0], new.capacity))],
                            axis=1)
    return attention.decode_attention(q, k_all, v_all, valid, normalize)


def attend_selected(q, k, v, valid, new: LayerKV, onehot, cluster_size: int, start: int = 0,
                    stop: int | None = None, normalize: str = "reciprocal",
                    scores_all: jax.Array | None = None) -> jax.Array:
    """Attention over the clusters `onehot` picks from slots [start, stop) of a prompt region,
    every other prompt slot, and all generated tokens. q: [H, d] -> [H, d]. scores_all:
    grouped_scores(q, [k; new.k]) when the caller has them already.

    k, v: [H_kv, S, d]; valid: [S] or [1 or H_kv, S] (public); onehot: [H_kv, n, C] 0/1 over the
    C = (stop - start) / cluster_size clusters (integer: no conversion under MPC), or
    [1, n, C]: one selection shared by every head; or a hierarchical selection as its levels'
    one-hots (`primitives.chain_pick`), which picks and puts back without composing them.
    Equals gathering the picked keys/values (`gather_clusters`) and attending to them, but the
    one-hot multiplies the attention scores ([H_kv, G, S]) and scatters the probabilities back
    instead of moving keys and values ([H_kv, S, d]): under MPC a secret one-hot product costs
    one reshare per output element, so this is d / G times less communication. The softmax
    still runs over the n * cluster_size picked slots only.
    """
    Hkv, S, _ = k.shape
    stop = S if stop is None else stop
    s = cluster_size
    chain = P.as_chain(onehot)
    n, C = P.chain_shape(chain)
    if C * s != stop - start:
        raise ValueError(f"{C} clusters of {s} do not tile slots [{start}, {stop})")
    # One score matmul and one value matmul over prompt slots and generated tokens together.
    # (Scoring the few generated slots apart instead of copying k and v with them: a
    # block-diagonal product over all heads, measured 0.2 s slower per step at T = 2048 on
    # llama2-d1024, 2 layers: its local work grows with the square of the heads.)
    k_all = jnp.concatenate([k, new.k], axis=1)
    v_all = jnp.concatenate([v, new.v], axis=1)
    if scores_all is None:  # (a caller that selected with the scores passes them in)
        scores_all = attention.grouped_scores(q, k_all)                    # [H_kv, G, S + N]
    scores = scores_all[..., :S]
    G = scores.shape[1]

    # A selection shared by every head ([1, n, C]: one per layer) moves all heads' rows with
    # 2-D matmuls (heads folded into the row width); per-head ones go through batched ones.
    shared = chain[0].shape[0] == 1 and Hkv > 1

    def pick(x):   # [h, g, C * s] -> [H_kv, g, n * s] (h = H_kv, or 1 for the mask)
        h, g = x.shape[:2]
        if shared or h == 1:
            rows = x.reshape(h, g, C, s).transpose(2, 0, 1, 3).reshape(1, C, h * g * s)
            out = P.chain_pick(chain, rows)                                 # [R, n, h * g * s]
            out = out.reshape(-1, n, h, g, s).transpose(0, 2, 3, 1, 4)      # [R, h, g, n, s]
            return jnp.broadcast_to(out.reshape(-1, g, n * s), (Hkv, g, n * s))
        rows = x.reshape(h, g, C, s).transpose(0, 2, 1, 3).reshape(h, C, g * s)
        out = P.chain_pick(chain, rows)                                     # [H_kv, n, g * s]
        return out.reshape(Hkv, n, g, s).transpose(0, 2, 1, 3).reshape(Hkv, g, n * s)

    def put_back(x):   # [H_kv, G, n * s] -> [H_kv, G, C * s], zeros where nothing was picked
        if shared:
            rows = x.reshape(Hkv, G, n, s).transpose(2, 0, 1, 3).reshape(1, n, Hkv * G * s)
            out = P.chain_put(chain, rows)                                  # [1, C, H_kv * G * s]
            return out.reshape(C, Hkv, G, s).transpose(1, 2, 0, 3).reshape(Hkv, G, C * s)
        rows = x.reshape(Hkv, G, n, s).transpose(0, 2, 1, 3).reshape(Hkv, n, G * s)
        out = P.chain_put(chain, rows)                                      # [H_kv, C, G * s]
        return out.reshape(Hkv, C, G, s).transpose(0, 2, 1, 3).reshape(Hkv, G, C * s)

    # A valid row shared by every head ([S] or [1, S]) is picked once, not once per head.
    valid = jnp.asarray(valid)
    valid = (valid if valid.ndim == 2 else valid[None])[:, None, :]           # [1 or H_kv, 1, S]
    if not jnp.issubdtype(valid.dtype, jnp.integer):
        valid = valid > 0.5          # public: a free comparison
    valid = valid.astype(jnp.int32)
    whole = lambda x: jnp.broadcast_to(x, (Hkv,) + x.shape[1:])
    new_valid = jnp.broadcast_to(new.valid().astype(jnp.int32), (Hkv, 1, new.capacity))
    parts_scores = [scores[..., :start], pick(scores[..., start:stop]), scores[..., stop:],
                    scores_all[..., S:]]
    parts_valid = [whole(valid[..., :start]), pick(valid[..., start:stop]),
                   whole(valid[..., stop:]), new_valid]
    sizes = np.cumsum([x.shape[-1] for x in parts_scores])[:-1]
    probs = attention.masked_softmax(jnp.concatenate(parts_scores, -1),
                                     jnp.concatenate(parts_valid, -1), normalize=normalize)
    head, picked, tail, p_new = jnp.split(probs, sizes, axis=-1)
    p_all = jnp.concatenate([head, put_back(picked), tail, p_new], axis=-1)  # [H_kv, G, S + N]
    return jnp.einsum("kgs,ksd->kgd", p_all, v_all).reshape(q.shape)


def attend_masked(q, k, v, valid, new: LayerKV, mask, cluster_size: int, start: int,
                  stop: int, normalize: str = "reciprocal") -> jax.Array:
    """`attend_selected` from the selection mask itself, for plaintext (XLA) runs: the clusters
    `mask` marks in slots [start, stop), every other valid prompt slot and the generated
    tokens, as one masked softmax over the whole cache. The same attention up to float
    summation order, in O(S) work per head instead of the one-hot's O(n S) (LongCache at 8192
    tokens: a [819, 8192] one-hot per KV head, layer and step). Under MPC the one-hot stays:
    a secret mask cannot select without it.

    q: [H, d]; k, v: [H_kv, S, d]; valid: [S] or [1 or H_kv, S] 0/1 (public); mask: [H_kv, C]
    0/1 over the C = (stop - start) / cluster_size clusters -> [H, d]."""
    Hkv, S, _ = k.shape
    if mask.shape[-1] * cluster_size != stop - start:
        raise ValueError(f"{mask.shape[-1]} clusters of {cluster_size} do not tile slots "
                         f"[{start}, {stop})")
    valid = jnp.asarray(valid)
    valid = jnp.broadcast_to(valid if valid.ndim == 2 else valid[None], (Hkv, S)) > 0.5
    picked = jnp.repeat(mask > 0, cluster_size, axis=-1)                  # [H_kv, stop - start]
    prompt = jnp.concatenate([valid[:, :start], valid[:, start:stop] & picked,
                              valid[:, stop:]], axis=-1)
    return attend_with_new(q, k, v, prompt.astype(k.dtype), new, normalize)


@flax.struct.dataclass
class WorkingSet:
    """The prompt tokens decode steps attend to between two selections (temporal reuse): a
    selection gathers them once into a compact buffer, and the steps until the next one attend
    to it and to the generated tokens, never to the whole prompt region.

    k, v: [H_kv, n, d] the selected tokens' keys/values; valid: int32 [R, n] 0/1 (rows past a
    runtime count, or padding slots, are 0); slot: int32 [R, n] the prompt-region slot each
    row was gathered from. R = 1 (one selection shared by the heads) or H_kv. Under MPC
    everything here is secret: it was gathered with a secret one-hot.
    """

    k: jax.Array = secret_field()
    v: jax.Array = secret_field()
    valid: jax.Array = secret_field()
    slot: jax.Array = secret_field()

    def attended_slots(self, num_kv_heads: int, region: int) -> jax.Array:
        """0/1 int32 [H_kv, region]: the prompt-region slots this working set holds."""
        hit = (self.slot[..., None] == jnp.arange(region)) & (self.valid[..., None] > 0)
        held = jnp.max(hit.astype(jnp.int32), axis=-2)
        return jnp.broadcast_to(held, (num_kv_heads, region))


def empty_working_set(num_kv_heads: int, rows: int, tokens: int, head_dim: int,
                      dtype=jnp.float32) -> WorkingSet:
    """A working set of `tokens` empty rows ([H_kv, tokens, d] zeros; `rows` selection rows)."""
    zeros = jnp.zeros((num_kv_heads, tokens, head_dim), dtype)
    empty = jnp.zeros((rows, tokens), jnp.int32)
    return WorkingSet(zeros, zeros, empty, empty)


def gather_working_set(chain, k: jax.Array, v: jax.Array, valid: jax.Array,
                       cluster_size: int) -> WorkingSet:
    """Gather the clusters a selection picks into a `WorkingSet`.

    chain: a selection over the C = S / cluster_size clusters of the region
    (`primitives.chain_pick`: its levels' one-hots, [R, n, C] composed); k, v: [H_kv, S, d];
    valid: [S] or [R', S] 0/1 (public). Keys and values go through the chain together, one
    one-hot product per level; a selection shared by the heads (R = 1) moves every head's
    rows at once (heads folded into the row width). The valid mask and slot numbers go
    through the same one-hots as a public operand (a local product under MPC).
    """
    Hkv, S, d = k.shape
    chain = P.as_chain(chain)
    n, C = P.chain_shape(chain)
    if C * cluster_size != S:
        raise ValueError(f"{C} clusters of {cluster_size} do not tile a region of {S} slots")
    rows = chain[0].shape[0]
    kv = jnp.concatenate([k, v], axis=-1)                                    # [H_kv, S, 2d]
    if rows == 1 and Hkv > 1:
        wide = kv.transpose(1, 0, 2).reshape(1, S, Hkv * 2 * d)
        picked = P.chain_pick(chain, wide).reshape(n * cluster_size, Hkv, 2 * d)
        picked = picked.transpose(1, 0, 2)                                   # [H_kv, n*s, 2d]
    else:
        picked = P.chain_pick(chain, kv)                                     # [H_kv, n*s, 2d]
    valid = jnp.asarray(valid)
    valid = valid if valid.ndim == 2 else valid[None]
    if not jnp.issubdtype(valid.dtype, jnp.integer):
        valid = valid > 0.5            # public: a free comparison
    slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), valid.shape)
    public = jnp.stack([valid.astype(jnp.int32), slots], axis=-1)            # [R', S, 2]
    meta = P.chain_pick(chain, public)                                       # [R, n*s, 2]
    return WorkingSet(picked[..., :d], picked[..., d:], meta[..., 0], meta[..., 1])


def attend_working_set(q: jax.Array, working: WorkingSet, new: LayerKV,
                       normalize: str = "reciprocal") -> jax.Array:
    """Attention over a working set plus every generated token. q: [H, d] -> [H, d]."""
    Hkv, n, _ = working.k.shape
    valid = jnp.concatenate([
        jnp.broadcast_to(working.valid, (Hkv, n)),
        jnp.broadcast_to(new.valid().astype(jnp.int32), (Hkv, new.capacity))], axis=1)
    return attention.decode_attention(q, jnp.concatenate([working.k, new.k], axis=1),
                                      jnp.concatenate([working.v, new.v], axis=1), valid,
                                      normalize)


@dataclasses.dataclass(frozen=True)
class LayerBudget:
    """How many prompt tokens each layer keeps, when layers differ: a component a prompt
    eviction policy holds (`layer_budget`) around its own scoring, as kvpress wraps a press in
    per-layer compression ratios. Counts are static ints whose mean is at most the budget;
    each layer's region then has exactly its own count of slots (the cache is a tuple, so
    layers may differ in shape). Frozen and hashable: it is part of the policy's identity."""

    def counts(self, num_layers: int, prompt_len: int, budget: int) -> tuple[int, ...]:
        """budget: tokens per layer on average (the policy's budget at this prompt length)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class GivenCounts(LayerBudget):
    """Fixed counts, one per layer (e.g. another implementation's kept counts to compare)."""

    per_layer: tuple[int, ...] = ()

    def counts(self, num_layers, prompt_len, budget):
        if len(self.per_layer) != num_layers:
            raise ValueError(f"{len(self.per_layer)} layer counts for {num_layers} layers")
        return tuple(min(prompt_len, c) for c in self.per_layer)


@dataclasses.dataclass(frozen=True)
class PromptEvictionPolicy(AttentionPolicy):
    """Keep `budget` prompt tokens per layer, chosen once at prefill by `keep_scores`.

    Subclasses define `keep_scores` (and optionally `forced_keep`); decoding attends to the
    kept tokens plus every generated token. layer_budget: per-layer counts instead of the
    budget in every layer (a `LayerBudget`: PyramidKV's pyramid, PrefixKV's calibrated curves).
    """

    # A family's hooks: what a policy of it must write (REQUIRED_HOOKS) and may write (HOOKS).
    # Every other method is shared machinery (`policies.seam_violations` checks a class).
    REQUIRED_HOOKS = ("keep_scores",)
    HOOKS = REQUIRED_HOOKS + ("forced_keep", "compress_carry", "check_prompt")
    # Whether the family's machinery serves per-layer counts (a `layer_budget`); a family
    # whose later steps assume one budget in every layer says False.
    PER_LAYER_BUDGET = True

    budget: float | int | P.Budget = 0.1
    topk_method: str = "lax"
    layer_budget: LayerBudget | None = None

    def __post_init__(self):
        super().__post_init__()
        validate_budget(self.budget)
        if self.topk_method not in P.TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r}; use one of {P.TOPK_METHODS}")
        if self.layer_budget is not None and not isinstance(self.layer_budget, LayerBudget):
            raise ValueError(f"layer_budget={self.layer_budget!r} must be a LayerBudget "
                             "(mpcache_jax.policies.base)")
        if self.layer_budget is not None and not self.PER_LAYER_BUDGET:
            raise ValueError(f"{self.name} keeps one budget in every layer (its decode steps "
                             "assume it): drop layer_budget")

    # --- what subclasses say ---------------------------------------------------------------
    def keep_scores(self, layer: int, q, k, extent: E.Extent, carry) -> tuple[jax.Array, Any]:
        """Scores [T] or [H_kv, T] (higher = keep) for one layer's prompt slots (padding slots
        of a bucketed prompt are never kept, whatever their score)."""
        raise NotImplementedError

    def forced_keep(self, extent: E.Extent, count) -> np.ndarray | jax.Array | None:
        """[T] 0/1 mask of tokens always kept, or None."""
        return None

    def keep_mask(self, layer: int, q, k, extent: E.Extent, count, bound: int, forced, carry
                  ) -> tuple[jax.Array, Any]:
        """0/1 mask [T] or [H_kv, T] with exactly `count` ones (<= `bound`, static): the top
        `keep_scores` (forced tokens first). Override to select at another granularity."""
        scores, carry = self.keep_scores(layer, q, k, extent, carry)
        valid = None if extent.static else extent.valid()
        return P.topk_mask(scores, count, forced=forced, valid=valid, method=self.topk_method,
                           k_max=bound), carry

    def compress_carry(self, cache, aux: PrefillAux) -> Any:
        """Initial carry of the per-layer keep_scores/keep_mask loop (None by default; a policy
        that ranks with statistics of every layer computes them here)."""
        return None

    # --- shared machinery ------------------------------------------------------------------
    def kept_count(self, prompt_len: int) -> int:
        return P.budget_tokens(self.budget, prompt_len)

    def kept_counts(self, num_layers: int, prompt_len: int) -> tuple[int, ...]:
        """Prompt tokens kept by each layer: the layer budget's counts, else the same count
        everywhere."""
        if self.layer_budget is not None:
            return tuple(self.layer_budget.counts(num_layers, prompt_len,
                                                  P.budget_tokens(self.budget, prompt_len)))
        return (self.kept_count(prompt_len),) * num_layers

    def layer_count(self, extent: E.Extent, num_layers: int, layer: int):
        """(count, static bound) of the prompt tokens `layer` keeps."""
        fn = lambda t: _layer_counts(self, num_layers, t)[layer]
        key = (self, "kept", num_layers, layer)
        return extent.count(fn, key), extent.bound(fn, key)

    def region_capacity(self, prompt_len: int, count: int) -> int:
        """Slots of a layer's kept-token region holding `count` tokens (>= count)."""
        return count

    def check_prompt(self, prompt_len: int) -> None:
        """Raise a clear error when this configuration cannot serve a prompt of this length."""

    def prompt_keep(self, cache, aux: PrefillAux) -> list[tuple[jax.Array, Any, int]]:
        """Static eviction of every layer: [(keep mask [T] or [H_kv, T] with `count` ones,
        count, static bound of count)] (what `compress` keeps; also read by analysis tools)."""
        extent = E.of(aux)
        if extent.static:
            self.check_prompt(extent.length)
        if self.needs_queries and aux.queries is None:
            raise ValueError(f"policy {self.name!r} scores tokens with the prompt queries: call "
                             "prefill(..., return_queries=True)")
        carry = self.compress_carry(cache, aux)
        out = []
        for index, layer in enumerate(cache):
            count, bound = self.layer_count(extent, len(cache), index)
            k, _ = prompt_kv(layer, extent.capacity)
            if extent.static and count == extent.length:
                keep = jnp.ones((extent.capacity,), k.dtype)
            else:
                q = aux.queries[index] if aux.queries is not None else None
                keep, carry = self.keep_mask(index, q, k, extent, count, bound,
                                             self.forced_keep(extent, count), carry)
            out.append((keep, count, bound))
        return out

    def compress(self, cache, aux: PrefillAux, max_new_tokens: int):
        extent = E.of(aux)
        length = None if extent.static else extent.length
        out = []
        for layer, (keep, count, bound) in zip(cache, self.prompt_keep(cache, aux)):
            k, v = prompt_kv(layer, extent.capacity)
            capacity = self.region_capacity(extent.capacity, bound)
            kept_k, kept_v, valid = keep_by_mask(k, v, keep, count, capacity)
            out.append(PrunedLayer(kept_k, kept_v, valid, new_region(layer, max_new_tokens),
                                   self.layer_extras(kept_k, valid), prompt_len=extent.capacity,
                                   kept=bound, length=length, low=extent.low))
        return tuple(out)

    def layer_extras(self, kept_k, valid) -> Any:
        return None

    def free_slots(self, cache) -> int:
        new = cache[0].new
        return int(new.capacity - new.length)

    def attend(self, layer, q, k_new, v_new, state: PrunedLayer, carry):
        new = append_token(state.new, k_new, v_new)
        out = attend_with_new(q, state.k, state.v, state.valid, new, self.softmax)
        return out, state.replace(new=new), carry

    def attended_slots(self, layer, q, state: PrunedLayer, carry) -> jax.Array:
        """0/1 [H_kv, S]: the kept-region slots this decode step attends to (analysis; every
        kept token for a prefill-only policy)."""
        return (state.valid > 0.5).astype(jnp.int32)

    def attended_shape(self, state: PrunedLayer) -> tuple[int, ...]:
        """The shape of `attended_slots` for this layer state: [H_kv, S] (analysis)."""
        return tuple(state.valid.shape)


@dataclasses.dataclass(frozen=True)
class StreamingLLM(PromptEvictionPolicy):
    """Attention sinks + the most recent prompt tokens (StreamingLLM, 4 sinks)."""

    name: str = "streaming_llm"
    num_sinks: int = 4

    def keep_scores(self, layer, q, k, extent, carry):
        return jnp.arange(extent.capacity, dtype=k.dtype), carry  # public: most recent first

    def forced_keep(self, extent, count):
        return E.iota_lt(extent.capacity, jnp.minimum(self.num_sinks, count)
                         if not extent.static else min(self.num_sinks, count))


# --- decode-time eviction (H2O, TOVA) ------------------------------------------------------

@flax.struct.dataclass
class EvictingLayer:
    """A fixed buffer of S slots where kept prompt tokens and generated tokens compete.

    k, v: [H_kv, S, d]; valid: [H_kv, S] 0/1; score: [H_kv, S] the policy's eviction statistic
    (higher = keep); pos: [H_kv, S] absolute positions (float, -1 in empty slots);
    seen: int32 [] tokens seen so far (prompt + generated) = position of the next token.
    """

    k: jax.Array = secret_field()
    v: jax.Array = secret_field()
    valid: jax.Array = secret_field()
    score: jax.Array = secret_field()
    pos: jax.Array = secret_field()
    seen: jax.Array = secret_field()
    prompt_len: int = flax.struct.field(pytree_node=False, default=0)
    # Bucketed prompts: the int32 real prompt length, the bucket's smallest length, and
    # usable [H_kv, S] 0/1 (the slots a prompt of this length may fill: the buffer is sized
    # for the bucket's longest prompt).
    length: jax.Array | None = public_field(default=None)
    low: int = flax.struct.field(pytree_node=False, default=1)
    usable: jax.Array | None = secret_field(default=None)

    def extent(self) -> E.Extent:
        if self.length is None:
            return E.Extent(self.prompt_len, self.prompt_len)
        return E.Extent(self.prompt_len, self.length, self.low)


def attention_with_probs(q, k, v, valid, normalize: str = "reciprocal"
                         ) -> tuple[jax.Array, jax.Array]:
    """decode_attention that also returns the weights. q: [H, d]; k, v: [H_kv, S, d];
    valid: [H_kv, S] -> (out [H, d], probs [H_kv, G, S])."""
    probs = attention.masked_softmax(attention.grouped_scores(q, k), valid[:, None, :],
                                     normalize=normalize)
    out = jnp.einsum("kgs,ksd->kgd", probs, v)
    return out.reshape(q.shape), probs


def write_onehot(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """Overwrite the slot marked by a one-hot (or all-zero) row. buf: [H_kv, S] or
    [H_kv, S, d]; slot: [H_kv, S]; value: [H_kv] or [H_kv, d]. Masked blend, no indexing."""
    if buf.ndim == 3:
        slot, value = slot[..., None], value[:, None, :]
    else:
        value = value[:, None]
    return buf * (1.0 - slot) + slot * value


@dataclasses.dataclass(frozen=True)
class DecodeEvictionPolicy(PromptEvictionPolicy):
    """Evict at prefill to `budget` prompt tokens, then keep evicting while decoding.

    Buffer and budget rule: the layer holds S = B + W slots, B = budget tokens, W =
    min(max_new_tokens, decode_window) slots for generated tokens (all of them when
    decode_window is None or the budget covers the whole prompt: budget 100% = no eviction).
    A decode step attends to the buffer plus the new token, then keeps the best S of those
    S + 1 (an empty slot is filled first). Prompt tokens only ever leave the buffer, so a step
    attends to at most B prompt tokens and at most B + t tokens in all at step t (never more
    than a prefill-only policy, which attends to B + t).
    Subclasses define keep_scores (prefill, also the initial statistic), step_scores and
    evictable.
    """

    REQUIRED_HOOKS = ("keep_scores", "step_scores")
    HOOKS = REQUIRED_HOOKS + ("forced_keep", "evictable")
    PER_LAYER_BUDGET = False

    decode_window: int | None = 16

    def __post_init__(self):
        super().__post_init__()
        if self.decode_window is not None and (isinstance(self.decode_window, bool) or
                                               not isinstance(self.decode_window, int) or
                                               self.decode_window < 0):
            raise ValueError(f"decode_window={self.decode_window!r} must be an int >= 0 (slots "
                             "for generated tokens beyond the budget) or None (all of them)")

    def step_scores(self, previous: jax.Array, probs: jax.Array) -> jax.Array:
        """New statistic [H_kv, S+1] from the previous one (0 for the new token) and this
        step's attention probs [H_kv, G, S+1]."""
        raise NotImplementedError

    def evictable(self, pos: jax.Array, position: jax.Array, budget: int) -> jax.Array:
        """0/1 [H_kv, S+1]: which tokens may be dropped (pos: their positions; position: the
        new token's)."""
        return jnp.ones_like(pos)

    def buffer_window(self, extent: E.Extent, max_new_tokens: int) -> int:
        """Slots for generated tokens beyond the kept prompt tokens (static)."""
        if self.decode_window is None:
            return max_new_tokens
        # (a one-token prompt, which any ratio budget covers whole, is left out of a bucket)
        lengths = ([extent.length] if extent.static else
                   range(max(extent.low, 2), extent.capacity + 1))
        prunes = {self.kept_count(t) < t for t in lengths}
        if len(prunes) > 1:
            raise ValueError(f"policy {self.name!r}: the bucket [{extent.low}, {extent.capacity}] "
                             "holds prompts that the budget covers whole and prompts it prunes; "
                             "use narrower buckets")
        return min(max_new_tokens, self.decode_window) if prunes.pop() else max_new_tokens

    def compress(self, cache, aux: PrefillAux, max_new_tokens: int):
        extent = E.of(aux)
        if self.needs_queries and aux.queries is None:
            raise ValueError(f"policy {self.name!r} scores tokens with the prompt queries: call "
                             "prefill(..., return_queries=True)")
        T = extent.capacity
        key = (self, "kept")
        count, bound = extent.count(self.kept_count, key), extent.bound(self.kept_count, key)
        window = self.buffer_window(extent, max_new_tokens)
        slots = bound + window
        forced = self.forced_keep(extent, count)
        prompt_valid = None if extent.static else extent.valid()
        carry = self.compress_carry(cache, aux)
        out = []
        for index, layer in enumerate(cache):
            k, v = prompt_kv(layer, T)
            Hkv = k.shape[0]
            q = aux.queries[index] if aux.queries is not None else None
            scores, carry = self.keep_scores(index, q, k, extent, carry)
            scores = jnp.broadcast_to(scores, (Hkv, T))
            keep = P.topk_mask(scores, count, forced=forced, valid=prompt_valid,
                               method=self.topk_method, k_max=bound)
            onehot = P.mask_onehot(keep, bound)                             # [H_kv, bound, T]
            positions = jnp.broadcast_to(jnp.arange(T, dtype=k.dtype), (Hkv, T))
            stats = jnp.stack([scores, positions], axis=-1)                 # [H_kv, T, 2]
            kept_k, kept_v, kept_stats = (P.gather_rows(onehot, x) for x in (k, v, stats))
            pad = slots - bound
            pad3 = ((0, 0), (0, pad), (0, 0))
            valid = jnp.pad(jnp.broadcast_to(E.iota_lt(bound, count), (Hkv, bound)).astype(k.dtype),
                            ((0, 0), (0, pad)))
            pos = jnp.pad(kept_stats[..., 1], ((0, 0), (0, pad)), constant_values=-1.0)
            usable = None
            if not extent.static:
                pos = pos * valid - (1.0 - valid)       # empty slots at -1
                usable = jnp.broadcast_to(E.iota_lt(slots, count + window), (Hkv, slots))
            out.append(EvictingLayer(
                jnp.pad(kept_k, pad3), jnp.pad(kept_v, pad3), valid,
                jnp.pad(kept_stats[..., 0], ((0, 0), (0, pad))), pos,
                jnp.asarray(extent.length, jnp.int32), prompt_len=T,
                length=None if extent.static else extent.length, low=extent.low, usable=usable))
        return tuple(out)

    def free_slots(self, cache) -> int:
        return 1 << 30  # a full buffer evicts; it never refuses a token

    def attend(self, layer, q, k_new, v_new, state: EvictingLayer, carry):
        Hkv, S, _ = state.k.shape
        dtype = state.k.dtype
        k_all = jnp.concatenate([state.k, k_new[:, None, :].astype(dtype)], axis=1)
        v_all = jnp.concatenate([state.v, v_new[:, None, :].astype(dtype)], axis=1)
        ones = jnp.ones((Hkv, 1), dtype)
        valid_all = jnp.concatenate([state.valid, ones], axis=1)
        out, probs = attention_with_probs(q, k_all, v_all, valid_all, self.softmax)
        position = state.seen.astype(dtype)
        score_all = self.step_scores(jnp.concatenate([state.score, 0.0 * ones], axis=1), probs)
        pos_all = jnp.concatenate([state.pos, position * ones], axis=1)
        empty = 1.0 - state.valid if state.usable is None else (1.0 - state.valid) * state.usable
        free = jnp.concatenate([empty, 0.0 * ones], axis=1)
        budget = state.extent().count(self.kept_count, (self, "kept"))
        candidates = jnp.maximum(self.evictable(pos_all, position, budget) * valid_all, free)
        # The dropped token: an empty slot if any (the new token fills it), else the lowest score.
        drop = P.topk_mask(-score_all, 1, valid=candidates, forced=free, method=self.topk_method)
        slot = drop[:, :S]                            # all zero when the new token is dropped
        new_state = state.replace(
            k=write_onehot(state.k, slot, k_new.astype(dtype)),
            v=write_onehot(state.v, slot, v_new.astype(dtype)),
            valid=write_onehot(state.valid, slot, ones[:, 0]),
            score=write_onehot(score_all[:, :S], slot, score_all[:, S]),
            pos=write_onehot(state.pos, slot, position * ones[:, 0]),
            seen=state.seen + 1)
        return out, new_state, carry


def causal_attention_mass(q: jax.Array, k: jax.Array, chunk: int = 128, length=None
                          ) -> jax.Array:
    """Attention every prompt query gives each key, summed over the queries (causal): the
    same as window_attention_mass(q, k, T) without a [T, T] mask or score matrix.

    q: [H, T, d]; k: [H_kv, T, d] -> [H_kv, G, T]. Queries go through a scan in chunks of
    `chunk` rows (the causal mask of a chunk is an iota comparison, so nothing T x T is
    materialized or constant-folded). length: real prompt tokens of a bucketed prompt (the
    queries of padding slots are left out); default T.
    """
    H, T, d = q.shape
    Hkv = k.shape[0]
    real = T if length is None else length
    chunk = min(chunk, T)
    n = -(-T // chunk)
    q = jnp.pad(q, ((0, 0), (0, n * chunk - T), (0, 0)))
    keys = jnp.arange(T)

    def body(total, start):
        rows = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1)          # [H, c, d]
        positions = start + jnp.arange(chunk)
        valid = (keys[None, :] <= positions[:, None]) & (positions[:, None] < real)
        probs = attention.masked_softmax(attention.grouped_scores(rows, k), valid)
        return total + jnp.sum(probs, axis=2), None

    total = jnp.zeros((Hkv, H // Hkv, T), q.dtype)
    return jax.lax.scan(body, total, jnp.arange(n) * chunk)[0]
