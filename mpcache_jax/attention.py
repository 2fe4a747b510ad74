"""Attention math shared by prefill, dense decode and every eviction policy.

Everything here is written so that the same function compiles for XLA and for SPU:
masks are public 0/1 arrays applied by multiplication, and the softmax never feeds a
very negative number into `exp` (SPU's fixed-point exp returns garbage below about -1000).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mpcache_jax import primitives as P

# Logit given to masked slots after max-subtraction: exp(-100) is 0 in float32 after the
# multiplication by the mask, and is a value SPU's fixed-point exp handles.
MASK_LOGIT = -100.0
# Stand-in for "minus infinity" when taking the row max; never exponentiated.
MAX_FILL = -1e4
# How the softmax divides by the row sum: "reciprocal" inverts each row sum once and
# multiplies; "divide" divides element by element, as jax.nn.softmax does (under SPU that
# computes a reciprocal per entry: ~2x the communication of a whole decode step at 2048 tokens).
SOFTMAX_NORMALIZE = ("reciprocal", "divide")


def max_rounds(n: int) -> int:
    """Comparison rounds SPU's reduction spends on a max over n entries: one per halving, and
    one more for each odd remainder it carries (floor(log2 n) + popcount(n) - 1; measured under
    ABY3: 255 entries 151 messages, 256 entries 87)."""
    return max(0, n.bit_length() - 1 + bin(n).count("1") - 1)


def reduce_max(x: jax.Array, axis: int = -1) -> jax.Array:
    """Max over `axis`, keepdims. When padding the axis with MAX_FILL up to a power of two
    takes fewer rounds of SPU's reduction than its odd remainders would (`max_rounds`), the
    entries are padded first: the same value, 3 to 5 rounds fewer for lengths such as 213 or
    828 (a public constant costs nothing to append)."""
    n = x.shape[axis]
    padded = 1 << max(0, (n - 1).bit_length())
    if max_rounds(padded) < max_rounds(n):
        widths = [(0, 0)] * x.ndim
        widths[axis % x.ndim] = (0, padded - n)
        x = jnp.pad(x, widths, constant_values=MAX_FILL)
    return jnp.max(x, axis=axis, keepdims=True)


def masked_softmax(scores: jax.Array, valid: jax.Array, axis: int = -1,
                   normalize: str = "reciprocal") -> jax.Array:
    """Softmax over `axis` restricted to entries where `valid` is 1.

    scores: any shape; valid: 0/1 (float, integer or bool) broadcastable to `scores`. Rows
    with no valid entry return all zeros. Only linear operations involve the mask, so a
    public mask costs nothing under MPC, and an integer mask (also a secret one, e.g. gathered
    by a one-hot) needs no fixed-point truncation. `normalize`: one of SOFTMAX_NORMALIZE.
    """
    if valid.dtype == jnp.bool_:
        valid = valid.astype(jnp.int32)
    row_max = reduce_max(scores * valid + MAX_FILL * (1 - valid), axis=axis)
    row_max = jax.lax.stop_gradient(row_max)
    shifted = (scores - row_max) * valid + MASK_LOGIT * (1 - valid)
    weights = jnp.exp(shifted) * valid
    denom = jnp.sum(weights, axis=axis, keepdims=True)
    denom = jnp.where(denom > 0, denom, 1.0)
    if normalize == "divide":
        return weights / denom
    if normalize != "reciprocal":
        raise ValueError(f"normalize={normalize!r}; use one of {SOFTMAX_NORMALIZE}")
    return weights * (1.0 / denom)


def grouped_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """q / sqrt(d) with the query heads grouped by KV head (GQA): q: [H, ...d] ->
    [H_kv, G, ...d], G = H // H_kv consecutive query heads sharing a KV head. Scaling q rather
    than the scores: under MPC one truncation per query entry instead of one per score."""
    return (q.reshape((kv_heads, q.shape[0] // kv_heads) + q.shape[1:])
            * (1.0 / math.sqrt(q.shape[-1])))


def grouped_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """Scaled dot products q . k / sqrt(d), with the query heads grouped by KV head (GQA).

    q: [H, d] or [H, T, d]; k: [H_kv, S, d] -> [H_kv, G, S] or [H_kv, G, T, S], where
    G = H // H_kv consecutive query heads share a KV head.
    """
    return jnp.einsum("kg...d,ksd->kg...s", grouped_queries(q, k.shape[0]), k)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                     normalize: str = "reciprocal") -> jax.Array:
    """Single-token grouped-query attention over a key/value buffer.

    q: [H, d]; k, v: [H_kv, S, d]; valid: [S] or [H_kv, S] (1 = slot holds a token to attend to).
    Returns [H, d].
    """
    scores = grouped_scores(q, k)
    if valid.ndim == 1:
        valid = valid[None, None, :]
    else:
        valid = valid[:, None, :]
    probs = masked_softmax(scores, valid, normalize=normalize)
    # Not a block-diagonal 2-D matmul (P.batched_matmul): measured under ABY3 at T = 2048
    # (llama2-d1024, 2 layers) it saves 35% of the messages but multiplies the parties'
    # local compute by ~10 (36 s instead of 3-6 s per step).
    out = jnp.einsum("kgs,ksd->kgd", probs, v)
    return out.reshape(q.shape)


# Query rows per block of the models' causal prefill attention (see causal_attention).
PREFILL_BLOCK = 256
# Above this many causal score elements (float32: 16 GiB) a prompt's unwindowed blocks run as
# one loop over full-width key rows instead of unrolled triangle blocks (see causal_attention).
LOOPED_SCORE_ELEMENTS = 1 << 32
# Plaintext (XLA) prompts longer than this, without a window, attend in tiles with an online
# softmax (see _tiled_causal_attention).
TILED_MIN_TOKENS = 2 * PREFILL_BLOCK
# Tiles (query rows, keys): on a CPU small enough for a tile's scores to stay in its cache; on
# an accelerator few and large, since each tile costs a handful of kernel launches.
CPU_TILE = (256, 256)
ACCELERATOR_TILE = (2048, 2048)
# Masked scores in a tile (plaintext only: never reaches SPU's exp).
MAX_FILL_TILE = -1e30


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     block: int | None = None, window: int | None = None) -> jax.Array:
    """Full causal self-attention over a prompt.

    q: [H, T, d]; k, v: [H_kv, T, d] -> out [H, T, d]. window: None (every earlier token), or
    a sliding window: query i attends to keys i - window + 1 .. i only.

    Queries go in blocks of `block` rows (None: one block), each attending only to the keys
    up to its last row: static slices, so the same function compiles for SPU, where the masked
    upper triangle would otherwise cost as much as the rest (scores, row max, exp). With n
    blocks the score work is (n + 1) / 2n of T x T (a 1k-token prompt in blocks of 256: 62%);
    the blocks' softmaxes are separate calls, so the messages of that part grow n-fold.
    The result equals one block's up to float summation order (masked entries are exact zeros).
    With a window, a block also skips the keys before its first row's window (static slices);
    the full blocks whose window lies wholly inside the prompt all have one shape, block x
    (block + window - 1), and run as one loop body (`lax.map` over their public start rows)
    instead of one unrolled copy each: the same arithmetic on the same shapes, compiled once.
    Inside a whole model XLA may fuse it differently than the unrolled blocks (float noise).
    In plaintext (XLA, not `P.tracing_for_mpc()`) a prompt of more than TILED_MIN_TOKENS
    without a window goes through `_tiled_causal_attention` instead: the same causal triangle
    in tiles (CPU_TILE, ACCELERATOR_TILE), no block's scores held whole. Under MPC, past
    LOOPED_SCORE_ELEMENTS causal scores (H x T x T / 2: llama2-d1024 from 16k tokens), the
    blocks run as one loop over full-width keys (`_looped_causal_attention`), memory bounded
    at twice the score work.
    """
    H, T, d = q.shape
    block = T if block is None else min(block, T)
    starts = range(0, T, block)
    if window is None and not P.tracing_for_mpc() and T > TILED_MIN_TOKENS:
        rows, keys = CPU_TILE if _compiling_for_cpu() else ACCELERATOR_TILE
        return _tiled_causal_attention(q, k, v, min(rows, T), min(keys, T))
    if window is None and H * T * (T + block) // 2 > LOOPED_SCORE_ELEMENTS:
        return _looped_causal_attention(q, k, v, block)

    def unrolled(start):
        stop = min(start + block, T)
        first = 0 if window is None else max(0, start - window + 1)     # oldest key in reach
        return _attention_block(q[:, start:stop], k[:, first:stop], v[:, first:stop],
                                start, first, window)
    # Full blocks whose window starts at or after the prompt's first token: one shape.
    uniform = ([] if window is None else
               [s for s in starts if s >= window - 1 and s + block <= T])
    if len(uniform) < 2:
        outs = [unrolled(s) for s in starts]
    else:
        width = block + window - 1

        def looped(start):                     # start: int32 [] (public)
            first = start - window + 1
            return _attention_block(jax.lax.dynamic_slice_in_dim(q, start, block, axis=1),
                                    jax.lax.dynamic_slice_in_dim(k, first, width, axis=1),
                                    jax.lax.dynamic_slice_in_dim(v, first, width, axis=1),
                                    start, first, window)
        middle = jax.lax.map(looped, jnp.asarray(uniform, jnp.int32))  # [n, H, block, d]
        middle = jnp.moveaxis(middle, 0, 1).reshape(H, len(uniform) * block, d)
        outs = ([unrolled(s) for s in starts if s < uniform[0]] + [middle]
                + [unrolled(s) for s in starts if s > uniform[-1]])
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _looped_causal_attention(q, k, v, block: int) -> jax.Array:
    """causal_attention of a very long prompt without a window: the query blocks as one loop
    (`lax.map` over their public start rows), each scoring every key with the causal mask.
    Twice the triangle's score work, but one block's scores alive at a time: the unrolled
    blocks are independent, and a scheduler that runs them side by side holds them all
    (llama2-d1024 at 32768 tokens: 69 GB of scores per layer). q: [H, T, d], block <= T; a
    last partial block is computed as the block ending at row T, its new rows kept."""
    H, T, d = q.shape
    n = -(-T // block)
    starts = [i * block for i in range(n - 1)] + [T - block]

    def one(start):                            # start: int32 [] (public)
        return _attention_block(jax.lax.dynamic_slice_in_dim(q, start, block, axis=1), k, v,
                                start, 0, None)
    out = jnp.moveaxis(jax.lax.map(one, jnp.asarray(starts, jnp.int32)), 0, 1)  # [H, n, b, d]
    head = out[:, :n - 1].reshape(H, (n - 1) * block, d)
    return jnp.concatenate([head, out[:, n - 1, (n - 1) * block - starts[-1]:]], axis=1)


def _compiling_for_cpu() -> bool:
    """Whether the program being traced runs on a CPU: `jax.default_device`'s platform where
    one is set (a CPU run inside a GPU process), else the default backend's."""
    device = jax.config.jax_default_device
    platform = device if isinstance(device, str) else getattr(device, "platform", None)
    return (platform or jax.default_backend()) == "cpu"


def _tiled_causal_attention(q, k, v, q_block: int, k_block: int) -> jax.Array:
    """causal_attention in plaintext: tiles of q_block query rows x k_block keys with an online
    softmax (a running row max, sum and weighted values, rescaled when the max grows), each
    query block visiting only the key blocks up to its last row. A tile's scores
    (H x q_block x k_block floats) stay in the processor's cache, where whole-width blocks
    stream theirs through memory several times (row max, exp, sum, products): on 2 CPU cores
    ~1.4x faster at 8192 tokens (SmolLM2's heads), memory bounded at any length, the
    triangle's score work only.
    Not for MPC: the running max would add a comparison round and a reciprocal per tile.
    Equal to the blocked softmax up to float summation order.

    q: [H, T, d]; k, v: [H_kv, T, d] -> [H, T, d]. Rows and keys past T (padding to whole
    tiles) are masked or dropped.
    """
    H, T, d = q.shape
    Hkv = k.shape[0]
    G = H // Hkv
    rows_total = -(-T // q_block) * q_block
    keys_total = -(-T // k_block) * k_block
    qg = jnp.pad(grouped_queries(q, Hkv), ((0, 0), (0, 0), (0, rows_total - T), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, keys_total - T), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, keys_total - T), (0, 0)))

    def query_block(start):                    # start: int32 [] (public)
        qb = jax.lax.dynamic_slice_in_dim(qg, start, q_block, axis=2)   # [H_kv, G, rows, d]
        rows = start + jnp.arange(q_block)

        def key_block(j, carry):
            row_max, row_sum, acc = carry
            kb = jax.lax.dynamic_slice_in_dim(k, j * k_block, k_block, axis=1)
            vb = jax.lax.dynamic_slice_in_dim(v, j * k_block, k_block, axis=1)
            scores = jnp.einsum("kgtd,ksd->kgts", qb, kb)
            keys = j * k_block + jnp.arange(k_block)
            scores = jnp.where(keys[None, :] <= rows[:, None], scores, MAX_FILL_TILE)
            new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
            weights = jnp.exp(scores - new_max[..., None])
            rescale = jnp.exp(row_max - new_max)
            return (new_max, row_sum * rescale + jnp.sum(weights, axis=-1),
                    acc * rescale[..., None] + jnp.einsum("kgts,ksd->kgtd", weights, vb))
        # Key block 0 holds every row's first key, so after it each row's max is a real score
        # and a masked entry's weight is exp(MAX_FILL_TILE - max) = 0.
        init = (jnp.full((Hkv, G, q_block), MAX_FILL_TILE, q.dtype),
                jnp.zeros((Hkv, G, q_block), q.dtype), jnp.zeros((Hkv, G, q_block, d), q.dtype))
        n_keys = jnp.minimum((start + q_block + k_block - 1) // k_block, keys_total // k_block)
        _, row_sum, acc = jax.lax.fori_loop(0, n_keys, key_block, init)
        return acc / row_sum[..., None]

    out = jax.lax.map(query_block, jnp.arange(0, rows_total, q_block, dtype=jnp.int32))
    return jnp.moveaxis(out, 0, 2).reshape(H, rows_total, d)[:, :T]


def _attention_block(q, k, v, start, first, window):
    """Causal attention of a block of query rows to its keys.

    q: [H, rows, d], the prompt's rows from `start`; k, v: [H_kv, keys, d], its keys from
    `first` (the oldest any row reaches) -> [H, rows, d]. start, first: ints, or int32 []
    traced (the loop of causal_attention)."""
    H, rows_n, d = q.shape
    scores = grouped_scores(q, k)                                  # [H_kv, G, rows, keys]
    rows = start + jnp.arange(rows_n)[:, None]
    keys = first + jnp.arange(k.shape[1])[None, :]
    causal = keys <= rows
    if window is not None:
        causal = causal & (keys > rows - window)
    probs = masked_softmax(scores, causal.astype(q.dtype))
    return jnp.einsum("kgts,ksd->kgtd", probs, v).reshape(H, rows_n, d)
