"""MPC-friendly building blocks shared by every eviction policy.

Each function is written with comparisons, masks, cumulative sums and matmuls only, so the
same code compiles for XLA and for SPU. Shapes use `...` for any leading batch axes
(KV heads, layers); selections are always 0/1 masks of a static size k.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

TOPK_METHODS = ("lax", "rank")
# Added to / subtracted from scores to force or forbid entries. Larger than any attention score
# or bound we produce, small enough for SPU's fixed point (FM64, 18 fraction bits).
FORCE_SCORE = 1e4
# Fill value of empty slots in cluster bounds (never selected: their clusters are invalid).
EMPTY_BOUND = 1e4


def _adjust(scores, valid, forced):
    if forced is not None:
        scores = scores + FORCE_SCORE * forced.astype(scores.dtype)
    if valid is not None:
        if isinstance(valid, np.ndarray):                  # public constants
            valid = valid.astype(bool)
        if valid.dtype == jnp.bool_:
            # a select, no product: under MPC a product with a 0/1 float costs a truncation
            scores = jnp.where(valid, scores, jnp.asarray(-2.0 * FORCE_SCORE, scores.dtype))
        else:
            valid = valid.astype(scores.dtype)
            scores = scores * valid - 2.0 * FORCE_SCORE * (1.0 - valid)
    return scores


def topk_mask(scores: jax.Array, k, *, valid: jax.Array | None = None,
              forced: jax.Array | None = None, method: str = "lax", dtype=None,
              k_max: int | None = None) -> jax.Array:
    """0/1 mask with exactly k ones per row marking the k largest scores.

    scores: [..., N]; valid, forced: 0/1 broadcastable to scores (forced entries are taken
    first, invalid entries last). Ties go to the lower index, as `lax.top_k` does.
    method="lax": `lax.top_k` + one-hot of the returned indices.
    method="rank": constant depth; rank_i = #{j<i: s_j >= s_i} + #{j>i: s_j > s_i} from one
    batch of N(N-1)/2 comparisons, one per pair i < j (the pair's other order is its
    complement), for all rows at once (no sorting network); keep rank < k. The ranks are
    counted in integers: under MPC, adding up comparison bits needs no fixed-point truncation.
    k: a Python int, or an int32 scalar known at run time (bucketed prompts,
    `mpcache_jax.extent`) with a static upper bound `k_max`; "lax" then keeps the first k of
    lax.top_k's k_max sorted indices (XLA sorts them; SPU's top_k returns an unordered set, so
    secure programs use static k).
    Returns [..., N] of `dtype` (default: the scores' dtype).
    """
    N = scores.shape[-1]
    if method not in TOPK_METHODS:
        raise ValueError(f"unknown top-k method {method!r}; use one of {TOPK_METHODS}")
    dtype = scores.dtype if dtype is None else dtype
    s = _adjust(scores, valid, forced)
    if not isinstance(k, (int, np.integer)):
        if k_max is None or not 0 < k_max <= N:
            raise ValueError(f"a runtime k needs a static bound 0 < k_max <= {N}, got {k_max}")
        if method == "lax":
            _, idx = jax.lax.top_k(s, k_max)
            return _indices_mask(idx, N, dtype, (jnp.arange(k_max) < k).astype(dtype))
        return (_pairwise_rank(s) < k).astype(dtype)
    if not 0 < k <= N:
        raise ValueError(f"top-k needs 0 < k <= {N}, got k={k}")
    if k == N:
        return jnp.ones(s.shape, dtype)
    if method == "lax":
        _, idx = jax.lax.top_k(s, k)
        return _indices_mask(idx, N, dtype)
    return (_pairwise_rank(s) < k).astype(dtype)


def _indices_mask(idx: jax.Array, n: int, dtype, first: jax.Array | None = None) -> jax.Array:
    """[..., k] distinct indices -> [..., n] 0/1 of `dtype`, 1 at the indices (with `first`
    [k] 0/1: only at those of the rows it marks). In plaintext a scatter, k writes per row
    (summing a [k, n] one-hot cost LongCache 50 ms per layer and step at 8192 tokens); under
    MPC, where `lax.top_k`'s indices are secret, the one-hot sum."""
    if tracing_for_mpc():
        onehot = indices_onehot(idx, n, dtype)
        return jnp.sum(onehot if first is None else onehot * first[:, None], axis=-2)
    lead, k = idx.shape[:-1], idx.shape[-1]
    values = jnp.ones((k,), dtype) if first is None else first
    put = jax.vmap(lambda i: jnp.zeros((n,), dtype).at[i].set(values))
    return put(idx.reshape(-1, k)).reshape(lead + (n,))


def topk_onehot(scores: jax.Array, k, k_max: int, *, valid: jax.Array | None = None,
                forced: jax.Array | None = None) -> jax.Array:
    """The k largest scores of each row as an integer one-hot [..., k_max, N], rows in order of
    rank (row r marks the entry of rank r; rows r >= k are zero).

    scores: [..., N]; valid, forced as in `topk_mask` (ties to the lower index); k: an int, or
    an int32 scalar known at run time, <= the static k_max. From the pairwise ranks (one
    batch of N(N-1)/2 comparisons, constant depth) one equality test per (row, entry) gives
    the one-hot directly: under MPC one comparison round fewer than `topk_mask` followed by
    `mask_onehot`, and the selected entries need not come out in index order when what
    follows (a gather into a working set) does not care.
    """
    N = scores.shape[-1]
    if not 0 < k_max <= N:
        raise ValueError(f"top-k one-hot needs 0 < k_max <= {N}, got k_max={k_max}")
    if isinstance(k, (int, np.integer)) and not 0 <= k <= k_max:
        raise ValueError(f"k={k} must lie in [0, k_max={k_max}]")
    rank = _pairwise_rank(_adjust(scores, valid, forced))                    # [..., N]
    rows = jnp.arange(k_max, dtype=jnp.int32)
    onehot = (rank[..., None, :] == rows[:, None]).astype(jnp.int32)       # [..., k_max, N]
    if isinstance(k, (int, np.integer)) and k == k_max:
        return onehot
    return onehot * (rows < k).astype(jnp.int32)[:, None]                   # public rows


def _rows_rolled(s: jax.Array, rows: int) -> jax.Array:
    """[..., N] -> [..., rows, N] with out[r, i] = s[(i + r + 1) mod N]. Tiled, sliced and
    reshaped: static data movement (an index gather is much slower under SPU)."""
    N = s.shape[-1]
    flat = jnp.tile(s, (1,) * (s.ndim - 1) + (rows + 2,))
    band = flat[..., 1:1 + rows * (N + 1)]
    return band.reshape(*s.shape[:-1], rows, N + 1)[..., :N]


def _rows_sheared(m: jax.Array) -> jax.Array:
    """[..., T, N] -> the same shape with out[r, n] = m[r, (n - r - 1) mod N] (row r turned
    right by r + 1), by the same static slicing as `_rows_rolled`."""
    *lead, T, N = m.shape
    flat = jnp.concatenate([m, m], axis=-1).reshape(*lead, T * 2 * N)
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, N)])
    band = flat[..., N - 1:N - 1 + T * (2 * N - 1)]
    return band.reshape(*lead, T, 2 * N - 1)[..., :N]


def _pairwise_rank(s: jax.Array) -> jax.Array:
    """rank_i = #{j<i: s_j >= s_i} + #{j>i: s_j > s_i} for s: [..., N], from one comparison
    per pair. The pairs are laid out as [N // 2, N]: row t pairs entry i with (i + t) mod N,
    which lists every unordered pair once (row N/2 twice for even N: half of it is masked).
    The layout is static slicing and the index patterns are public constants: under MPC it
    costs no communication and no gather."""
    N = s.shape[-1]
    if N == 1:
        return jnp.zeros(s.shape, jnp.int32)
    t = np.arange(1, N // 2 + 1)[:, None]
    i = np.arange(N)[None, :]
    wrap = (i + t) % N < i                # then the pair is ((i + t) mod N, i): partner lower
    keep = (~((2 * t == N) & (i >= N // 2))).astype(np.int32)
    partner = _rows_rolled(s, N // 2)     # [..., N/2, N]: s_(i + t) mod N
    # later_wins = s_hi > s_lo as the sign of one difference, flipped by a public select (a
    # product with a public -1/1 would be a fixed-point product: one truncation per pair).
    diff = partner - s[..., None, :]
    later_wins = (jnp.where(wrap, -diff, diff) > 0).astype(jnp.int32) * keep
    # The lower index gains later_wins, the higher one keep - later_wins (s_lo >= s_hi).
    # Column i of row t holds i's own share ("stay") and its partner's ("move").
    lose = keep - later_wins
    stay = jnp.where(wrap, lose, later_wins)
    move = jnp.where(wrap, later_wins, lose)       # belongs to entry (i + t) mod N
    return jnp.sum(stay + _rows_sheared(move), axis=-2)


# Largest group a tournament max compares at once (`group_max`).
TOURNAMENT_FANIN = 16


def tournament_fanins(size: int, fanin: int = TOURNAMENT_FANIN) -> list[int]:
    """The fan-in of each stage of `group_max`'s tournament over groups of `size` entries
    (a power of two): `fanin` until fewer are left, e.g. 64 -> [16, 4] (fanin 16) or [4, 4, 4]
    (fanin 4). A stage of fan-in f costs (f - 1) / 2 comparisons per entry it ranks and two
    comparison rounds: wide stages save rounds, narrow ones comparisons."""
    if fanin < 2 or fanin & (fanin - 1):
        raise ValueError(f"tournament fan-in {fanin} must be a power of two >= 2")
    fanins, left = [], size
    while left > 1:
        fanins.append(min(left, fanin))
        left //= fanins[-1]
    return fanins


def group_max(x: jax.Array, size: int, per_group: int = 1,
              fanin: int = TOURNAMENT_FANIN) -> jax.Array:
    """Maximum of each run of `size` consecutive entries of the last axis: [..., n * size] ->
    [..., n]; size a power of two. With per_group = r > 1 (a power of two dividing size), the
    maxima of its r runs of size / r: [..., n, r] (what the tournament holds before its last
    stage when that stage's fan-in is r: a top-1 over the r x n partial maxima picks the group
    of the top-1 over the n maxima, one stage sooner).

    In plaintext a reduction. Under MPC (`secure_trace`) a tournament: groups of up to
    `fanin` entries are ranked at once (`_pairwise_rank`: one batch of (f - 1) / 2 comparisons
    per entry), the entry of rank 0 is found by one equality test and kept by an integer x
    fixed-point product. A stage costs two comparison rounds whatever its fan-in, where a
    reduction spends one comparison and one selection per halving: clusters of 64 take 2
    stages instead of 6 levels (measured in docs/results.md, "The default's cost"). The value
    is the same, bit for bit, at every fan-in (one winner per group, ties to the lower
    index)."""
    if size & (size - 1) or size < 1:
        raise ValueError(f"group size {size} must be a power of two")
    if per_group < 1 or per_group & (per_group - 1) or size % per_group:
        raise ValueError(f"per_group={per_group} must be a power of two dividing {size}")
    n = x.shape[-1] // size
    if n * size != x.shape[-1]:
        raise ValueError(f"{x.shape[-1]} entries are not whole groups of {size}")
    run = size // per_group
    if not tracing_for_mpc():
        out = jnp.max(x.reshape(*x.shape[:-1], n * per_group, run), axis=-1)
    else:
        for f in tournament_fanins(run, fanin):
            groups = x.reshape(*x.shape[:-1], -1, f)
            winner = (_pairwise_rank(groups) == 0).astype(jnp.int32)
            # (elementwise, not a batched product: SPU runs a batched dot_general one group at
            # a time, a round each)
            x = jnp.sum(winner * groups, axis=-1)
        out = x
    return out if per_group == 1 else out.reshape(*out.shape[:-1], n, per_group)


def indices_onehot(idx: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """idx: [..., k] int -> [..., k, n] one-hot rows (equality against an iota)."""
    return (idx[..., None] == jnp.arange(n)).astype(dtype)


def mask_onehot(mask: jax.Array, k: int) -> jax.Array:
    """Selection mask with exactly k ones -> [..., k, N] one-hot matrix, rows in index order.
    (A mask with fewer ones gives all-zero rows after the last one: how a runtime count is
    held in a static number of rows.)

    The r-th selected entry is where the prefix count first exceeds r: with
    reached[r, n] = cumsum(mask)[n] > r (0 then 1 along n), onehot[r] = reached[r] minus
    reached[r] shifted by one. One comparison per entry and no multiplication, so under
    MPC an integer mask gives an integer one-hot at the cost of the comparisons alone.
    mask: [..., N] 0/1 (float or integer); the result has the mask's dtype.
    """
    count = jnp.cumsum(mask, axis=-1)                                    # [..., N]
    if not tracing_for_mpc():
        # (the same one-hot from each row's index, found by search: one pass over
        # [..., k, N] instead of three)
        rows = jnp.arange(k, dtype=count.dtype)
        where = jax.vmap(lambda c: jnp.searchsorted(c, rows, side="right"))(
            count.reshape(-1, count.shape[-1])).reshape(count.shape[:-1] + (k,))
        hit = (where[..., None] == jnp.arange(mask.shape[-1])) & (
            rows < count[..., -1:])[..., None]
        return hit.astype(mask.dtype)
    rows = jnp.arange(k, dtype=mask.dtype)
    reached = (count[..., None, :] > rows[:, None]).astype(mask.dtype)  # [..., k, N]
    before = jnp.pad(reached[..., :-1], [(0, 0)] * (reached.ndim - 1) + [(1, 0)])
    return reached - before


# Largest block-diagonal operand (entries) batched_matmul builds to replace a batched matmul.
# (Its local work is L times the loop's: decode attention over a whole 2k cache measured 10x
# the parties' compute this way, so it keeps the loop.)
BLOCK_DIAGONAL_MAX = 1 << 21


def block_diagonal(blocks: jax.Array) -> jax.Array:
    """[L, m, n] -> [L m, L n] with block i at rows i m.., columns i n.. and zeros elsewhere,
    by padding (data movement: free under MPC, where a product with a public 0/1 pattern
    would cost a truncation of every entry). Integer blocks under MPC are spread by that
    product instead: an integer product needs no truncation, and a pad of each block of a
    one-hot that a comparison made (a boolean share) converts it block by block (under ABY3
    32 messages for 24 blocks, 1 as one product)."""
    L, m, n = blocks.shape
    if tracing_for_mpc() and jnp.issubdtype(blocks.dtype, jnp.integer):
        eye = np.eye(L, dtype=np.int32).astype(blocks.dtype)[:, None, :, None]
        return (blocks[:, :, None, :] * eye).reshape(L * m, L * n)
    return jnp.concatenate([jnp.pad(blocks[i], ((0, 0), (i * n, (L - 1 - i) * n)))
                            for i in range(L)], axis=0)


def batched_matmul(a: jax.Array, b: jax.Array, out_dtype=None) -> jax.Array:
    """a: [L, m, n]; b: [L, n, p] -> [L, m, p], one product per leading index.

    SPU runs a batched matmul as a loop over the batch, one round of messages per index. When
    the block-diagonal spread of `a` ([L*m, L*n], built by padding: free under MPC) is small, the product is instead one 2-D matmul of that spread with `b` stacked
    as [L*n, p]: the same [L*m, p] result in one round."""
    L, m, n = a.shape
    p = b.shape[-1]
    if L * m * L * n > BLOCK_DIAGONAL_MAX:
        return jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))),
                                   preferred_element_type=out_dtype)
    out = jax.lax.dot(block_diagonal(a), b.reshape(L * n, p), preferred_element_type=out_dtype)
    return out.reshape(L, m, p)


# Whether the program being traced is compiled for MPC (SPU). Secure programs gather with
# one-hot products (a secret index has no other oblivious form); plaintext programs (XLA) take
# the same rows by index: the result is the same to the bit (a one-hot product adds exact
# zeros to the one row it picks), at a fraction of the work (k x D instead of k x N x D).
_SECURE_TRACE = contextvars.ContextVar("mpcache_secure_trace", default=False)
# Rows narrower than this are gathered by the product in plaintext too: the index path first
# finds each row's one (an argmax over the one-hot), which costs as much as a product with a
# few columns (LongCache's put-back of [k, T] one-hots onto G x 1 columns: 2.7x slower by
# index on SmolLM2 at 8192 tokens; the default's working-set gather of c x row columns: 2x
# faster).
INDEX_GATHER_MIN_WIDTH = 32


@contextlib.contextmanager
def secure_trace():
    """Trace programs for MPC inside this block (`runtime.mpc.backends.compile_spu`)."""
    token = _SECURE_TRACE.set(True)
    try:
        yield
    finally:
        _SECURE_TRACE.reset(token)


def tracing_for_mpc() -> bool:
    return _SECURE_TRACE.get()


def gather_rows(onehot: jax.Array, x: jax.Array, group: int | None = None) -> jax.Array:
    """One-hot MatMul gather. onehot: [..., k, N] 0/1 with at most one 1 per row; x: [..., N, D]
    -> [..., k, D] (zeros for an all-zero row).

    Under MPC (`secure_trace`) the one-hot enters the matmul as integers (a float one-hot is
    turned into integers by one comparison of its [k, N] entries; an integer one-hot is used
    as it is): an integer x fixed-point product needs no truncation of the [k, D] result (1.5x
    less ABY3 communication, `--experiment=mpc_cost --mpc_bench=gather_dtype`); values are
    exact. Leading axes (heads, stripes) go through `batched_matmul` (one round of messages
    when small), or, with `group` = g, g leading indices per product: each product spreads its
    g one-hots block-diagonally (one round for g gathers, g times their multiply-accumulates),
    ceil(L / g) products in all (g = 1: one per index; wide rows, where a whole spread's extra
    work costs more than the rounds it saves). In plaintext rows of at least
    INDEX_GATHER_MIN_WIDTH columns are taken by index (the same values).
    """
    lead = jnp.broadcast_shapes(onehot.shape[:-2], x.shape[:-2])
    if not jnp.issubdtype(onehot.dtype, jnp.integer):
        onehot = onehot > 0.5
    if not tracing_for_mpc() and x.shape[-1] >= INDEX_GATHER_MIN_WIDTH:
        picked = onehot != 0
        index = jnp.broadcast_to(jnp.argmax(picked, axis=-1), lead + onehot.shape[-2:-1])
        rows = jnp.take_along_axis(jnp.broadcast_to(x, lead + x.shape[-2:]), index[..., None],
                                   axis=-2)
        hit = jnp.broadcast_to(jnp.any(picked, axis=-1), index.shape)[..., None]
        return jnp.where(hit, rows, jnp.zeros((), x.dtype))
    ints = jnp.broadcast_to(onehot, lead + onehot.shape[-2:]).astype(jnp.int32)
    rows = jnp.broadcast_to(x, lead + x.shape[-2:])
    (k, N), D = ints.shape[-2:], rows.shape[-1]
    a, b = ints.reshape(-1, k, N), rows.reshape(-1, N, D)
    if group is None:
        out = batched_matmul(a, b, x.dtype)
    else:
        out = grouped_matmul(a, b, group, x.dtype)
    return out.reshape(lead + (k, D))


def grouped_matmul(a: jax.Array, b: jax.Array, group: int, out_dtype=None) -> jax.Array:
    """a: [L, m, n]; b: [L, n, p] -> [L, m, p] in ceil(L / group) products (a round of messages
    each under SPU), each the block-diagonal spread of its indices' a with their b stacked.
    The indices are dealt into products of as equal a size as that count allows: one batched
    product of the full groups and one of the rest (no padded index does work)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group={group!r} must be an integer >= 1 (indices per product)")
    L, m, n = a.shape
    p = b.shape[-1]
    products = -(-L // group)
    size = -(-L // products)
    if size == 1:
        return jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))),
                                   preferred_element_type=out_dtype)

    def spread(a_part, b_part, count):                  # count products of `size` indices
        a_part = a_part.reshape(count, size, m, n)
        b_part = b_part.reshape(count, size * n, p)
        if count == 1:
            out = jax.lax.dot(block_diagonal(a_part[0]), b_part[0],
                              preferred_element_type=out_dtype)[None]
        else:
            out = jax.lax.dot_general(jax.vmap(block_diagonal)(a_part), b_part,
                                      (((2,), (1,)), ((0,), (0,))),
                                      preferred_element_type=out_dtype)
        return out.reshape(count * size, m, p)
    full = L // size
    out = spread(a[:full * size], b[:full * size], full)
    rest = L - full * size
    if rest:
        out = jnp.concatenate([out, grouped_matmul(a[full * size:], b[full * size:], rest,
                                                   out_dtype)])
    return out


def gather_clusters(onehot: jax.Array, x: jax.Array, cluster_size: int) -> jax.Array:
    """Gather whole clusters of adjacent tokens with one matmul.

    onehot: [..., k, C]; x: [..., C * s, d] -> [..., k * s, d] (clusters as [C, s*d] rows).
    """
    *lead, T, d = x.shape
    C = T // cluster_size
    rows = x.reshape(*lead, C, cluster_size * d)
    out = gather_rows(onehot, rows)
    return out.reshape(*lead, onehot.shape[-2] * cluster_size, d)


# A hierarchical selection kept as its levels' one-hots ("chain"), coarse to fine:
# ([R, k_0, N_0], [R, k_1, k_0 * r_1], ..., [R, k_L, k_{L-1} * r_L]). Level i picks k_i of the
# r_i children of the k_{i-1} rows picked above, so the composed one-hot is [R, k_L, N_L] with
# N_L = N_0 * r_1 * ... * r_L. Under SPU a secret product with a multi-row left operand takes
# time per multiply-accumulate (`--mpc_bench=matmul`): picking through the chain never builds the composed [k_L, N_L] one-hot (nor the [k * r, N]
# children of every level), and a coarse factor moves whole groups of rows at once.
# A single one-hot array is a chain of one level.

def as_chain(onehot) -> tuple:
    return tuple(onehot) if isinstance(onehot, (tuple, list)) else (onehot,)


def chain_shape(chain) -> tuple[int, int]:
    """(rows picked k_L, finest candidates N_L) of a chain."""
    chain = as_chain(chain)
    total = chain[0].shape[-1]
    for above, f in zip(chain, chain[1:]):
        total *= f.shape[-1] // above.shape[-2]
    return chain[-1].shape[-2], total


def chain_pick(chain, rows: jax.Array) -> jax.Array:
    """Gather through a chain. rows: [R, N, D] with N = m x N_L (m rows per finest candidate,
    e.g. the tokens of a cluster) -> [R, k_L x m, D], in the composed one-hot's row order.
    A chain with one row of selections (R = 1) serves rows of any R (broadcast)."""
    chain = as_chain(chain)
    D = rows.shape[-1]
    y = rows.reshape(rows.shape[0], chain[0].shape[-1], -1)
    for i, f in enumerate(chain):
        if i:
            y = y.reshape(y.shape[0], f.shape[-1], -1)
        y = gather_rows(f, y)
    return y.reshape(y.shape[0], -1, D)


def chain_put(chain, picked: jax.Array) -> jax.Array:
    """The transpose of `chain_pick`: picked [R, k_L x m, D] -> [R, N_L x m, D], each row put
    back where it was picked from, zeros elsewhere."""
    chain = as_chain(chain)
    D = picked.shape[-1]
    y = picked
    for f in reversed(chain):
        y = y.reshape(y.shape[0], f.shape[-2], -1)
        y = gather_rows(jnp.swapaxes(f, -1, -2), y)
    return y.reshape(y.shape[0], -1, D)


def chain_dense(chain) -> jax.Array:
    """The composed one-hot [R, k_L, N_L] (integer) of a chain (tests, analysis, slot masks)."""
    chain = as_chain(chain)
    if len(chain) == 1:
        return chain[0]
    return chain_pick(chain, jnp.eye(chain_shape(chain)[1], dtype=jnp.int32)[None])


def cluster_bounds(k: jax.Array, cluster_size: int, valid: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """Per-channel max/min of each cluster of `cluster_size` adjacent keys.

    k: [..., T, d] with T a multiple of cluster_size; valid: [T] or [..., T] 0/1 (empty slots
    are ignored; a cluster with no valid slot gets -EMPTY_BOUND / +EMPTY_BOUND).
    Returns (r_max, r_min), each [..., T / s, d].
    """
    *lead, T, d = k.shape
    if T % cluster_size:
        raise ValueError(f"{T} slots are not a multiple of the cluster size {cluster_size}")
    kc = k.reshape(*lead, T // cluster_size, cluster_size, d)
    if valid is None:
        return jnp.max(kc, axis=-2), jnp.min(kc, axis=-2)
    v = jnp.broadcast_to(valid, k.shape[:-1]).reshape(*lead, T // cluster_size, cluster_size, 1)
    v = v.astype(k.dtype)
    r_max = jnp.max(kc * v - EMPTY_BOUND * (1.0 - v), axis=-2)
    r_min = jnp.min(kc * v + EMPTY_BOUND * (1.0 - v), axis=-2)
    return r_max, r_min


def empty_bounds(lead: tuple[int, ...], num_clusters: int, d: int, dtype=jnp.float32):
    """Bounds of clusters that hold no token yet: ([..., C, d] -EMPTY, [..., C, d] +EMPTY)."""
    shape = (*lead, num_clusters, d)
    return jnp.full(shape, -EMPTY_BOUND, dtype), jnp.full(shape, EMPTY_BOUND, dtype)


def update_bounds(r_max: jax.Array, r_min: jax.Array, k_new: jax.Array, slot, cluster_size: int
                  ) -> tuple[jax.Array, jax.Array]:
    """Fold one appended key into the bounds: only cluster slot // s changes.

    r_max, r_min: [..., C, d]; k_new: [..., d]; slot: public int (the new token's slot).
    """
    c = slot // cluster_size
    start = (0,) * (r_max.ndim - 2) + (c, 0)
    size = (*r_max.shape[:-2], 1, r_max.shape[-1])
    cur_max = jax.lax.dynamic_slice(r_max, start, size)
    cur_min = jax.lax.dynamic_slice(r_min, start, size)
    new = k_new[..., None, :]
    return (jax.lax.dynamic_update_slice(r_max, jnp.maximum(cur_max, new), start),
            jax.lax.dynamic_update_slice(r_min, jnp.minimum(cur_min, new), start))


def rowwise_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a: [L, d]; b: [L, C, d] -> [L, C], out[l, c] = a[l] . b[l, c] (via `batched_matmul`:
    one round of messages under SPU when small, instead of one per row l)."""
    return batched_matmul(a[:, None, :], jnp.swapaxes(b, 1, 2))[:, 0, :]


def cluster_scores(q: jax.Array, r_max: jax.Array, r_min: jax.Array, mode: str = "alpha",
                   alpha: float = 0.6, mean: jax.Array | None = None) -> jax.Array:
    """Similarity of each query head with each cluster, summed over the heads of a GQA group.

    q: [H_kv, G, d]; r_max, r_min (and mean for "avg"): [H_kv, C, d] -> [H_kv, C].
    mode "alpha": q . (alpha r_max + (1 - alpha) r_min) (linearized and reordered: one matmul,
    and since it is linear in q the group's queries are summed first);
    "mp": sum_i max(q_i r_max_i, q_i r_min_i), the exact upper bound of max_k q . k;
    "avg": q . mean(cluster).
    """
    if mode == "alpha":
        # (alpha 0 or 1 skips a multiplication by a public constant: a truncation under MPC)
        centre = (r_max if alpha == 1.0 else r_min if alpha == 0.0 else
                  alpha * r_max + (1.0 - alpha) * r_min)
        return rowwise_dot(jnp.sum(q, axis=1), centre)
    if mode == "mp":
        hi = q[:, :, None, :] * r_max[:, None, :, :]
        lo = q[:, :, None, :] * r_min[:, None, :, :]
        return jnp.sum(jnp.maximum(hi, lo), axis=(1, 3))
    if mode == "avg":
        if mean is None:
            raise ValueError("mode='avg' needs the cluster means")
        return rowwise_dot(jnp.sum(q, axis=1), mean)
    raise ValueError(f"unknown similarity mode {mode!r}; use 'alpha', 'mp' or 'avg'")


@dataclasses.dataclass(frozen=True)
class Budget:
    """A ratio of the prompt with a floor in tokens: `Budget(0.1, 384)` attends 10% of a
    prompt, at least 384 tokens (the whole prompt when it is shorter). A ratio alone starves
    short prompts (10% of 2048 is 205 tokens); the floor gives every policy the same tokens
    there, and prompts whose ratio reaches the floor keep their ratio.

    ratio: in (0, 1]; min_tokens: >= 1. Written 'RATIOminTOKENS' ('0.1min384') in flags,
    records and node configs (`str` / `parse_budget`).
    """
    ratio: float
    min_tokens: int

    def __post_init__(self):
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, float):
            raise ValueError(f"Budget ratio={self.ratio!r} must be a ratio in (0, 1] (a token "
                             "count needs no floor: give the larger count)")
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"Budget ratio={self.ratio} must be in (0, 1]"
                             + (" (a token count needs no floor: give the larger count)"
                                if self.ratio > 1 else ""))
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                or self.min_tokens < 1):
            raise ValueError(f"Budget min_tokens={self.min_tokens!r} must be an integer >= 1")

    def __str__(self) -> str:       # the ratio's shortest exact text: parse_budget returns it
        return f"{self.ratio!r}min{self.min_tokens}"


def parse_budget(text: str) -> float | int | Budget:
    """'0.1' -> ratio 0.1 of the prompt; '128' -> 128 tokens; '0.1min384' -> Budget(0.1, 384).
    A ValueError with one line saying what to write otherwise."""
    text = str(text).strip()
    ratio_text, sep, floor_text = text.partition("min")
    if sep:
        try:
            ratio, floor = float(ratio_text), int(floor_text)
        except ValueError:
            raise ValueError(f"budget {text!r}: write RATIOminTOKENS, e.g. 0.1min384 (10% of "
                             "the prompt, at least 384 tokens)") from None
        return Budget(ratio, floor)
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"budget {text!r} is not a number; give a ratio in (0, 1], a token "
                         "count such as 128, or RATIOminTOKENS such as 0.1min384") from None
    if value <= 1.0:
        if value <= 0.0:
            raise ValueError(f"budget {text!r} must be a ratio in (0, 1] or a token count >= 1")
        return value
    if not value.is_integer():
        raise ValueError(f"budget {text!r}: a budget above 1 is a token count and must be a "
                         "whole number")
    return int(value)


def budget_record(budget):
    """The budget as a JSON scalar for records and configs: a number, or 'RATIOminTOKENS'."""
    return str(budget) if isinstance(budget, Budget) else budget


def budget_label(budget) -> str:
    """A budget in a label or a message: '0.1', '128', '0.1min384' (a record's text as is)."""
    return format(budget, "g") if isinstance(budget, float) else str(budget)


def budget_ratio(budget) -> float | int:
    """The ratio (or count) part of a budget: what a plot's budget axis shows, and what a
    policy's layout follows where a floor must not change it."""
    if isinstance(budget, str):
        budget = parse_budget(budget)
    return budget.ratio if isinstance(budget, Budget) else budget


def budget_tokens(budget: float | int | Budget, total: int) -> int:
    """A budget given as a ratio of `total` (float in (0, 1]), a token count (int >= 1) or a
    `Budget` (its ratio, at least its floor, at most `total`)."""
    if isinstance(budget, Budget):
        return max(budget_tokens(budget.ratio, total), min(budget.min_tokens, total))
    if isinstance(budget, bool):
        raise ValueError(f"budget={budget!r} must be a ratio in (0, 1] or a token count")
    if isinstance(budget, int):
        if budget < 1:
            raise ValueError(f"budget={budget} tokens must be >= 1")
        return min(budget, total)
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget ratio {budget} must be in (0, 1]; give an int for a token count")
    return max(1, min(total, math.ceil(budget * total - 1e-9)))


# --- additions for the per-step retrieval baselines (LongCache, ArkVale, PQCache) ---------


def inverse_norms(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """1 / |x| along the last axis: x [..., d] -> [...] (a zero row gives 1 / sqrt(eps))."""
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1) + eps)


def unit_rows(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / |x| along the last axis (cosine similarity = dot product of unit rows)."""
    return x * inverse_norms(x, eps)[..., None]


def cluster_mad_bounds(k: jax.Array, cluster_size: int, valid: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    """Box of each cluster from its centre +- mean absolute deviation, per channel.

    k: [..., T, d] (T a multiple of cluster_size); valid: [T] or [..., T] 0/1 (empty slots are
    ignored). Returns (centre + mad, centre - mad), each [..., T / s, d]; use them like
    cluster_bounds' (r_max, r_min).
    """
    *lead, T, d = k.shape
    if T % cluster_size:
        raise ValueError(f"{T} slots are not a multiple of the cluster size {cluster_size}")
    kc = k.reshape(*lead, T // cluster_size, cluster_size, d)
    if valid is None:
        w = jnp.ones(kc.shape[:-1] + (1,), k.dtype)
    else:
        w = jnp.broadcast_to(valid, k.shape[:-1]).reshape(*lead, T // cluster_size,
                                                          cluster_size, 1).astype(k.dtype)
    count = jnp.maximum(jnp.sum(w, axis=-2), 1.0)
    centre = jnp.sum(kc * w, axis=-2) / count
    mad = jnp.sum(jnp.abs(kc - centre[..., None, :]) * w, axis=-2) / count
    return centre + mad, centre - mad


def nearest_centroid(x: jax.Array, centroids: jax.Array) -> jax.Array:
    """Index of the nearest centroid (squared Euclidean) of each row.

    x: [..., N, d]; centroids: [..., K, d] -> int32 [..., N]. |x|^2 is the same for every
    centroid, so the argmin needs only |c|^2 - 2 x . c (one matmul).
    """
    dist = (jnp.sum(centroids * centroids, axis=-1)[..., None, :]
            - 2.0 * jnp.einsum("...nd,...kd->...nk", x, centroids))
    return jnp.argmin(dist, axis=-1).astype(jnp.int32)


def _lloyd(x: jax.Array, centroids: jax.Array, weights, iters: int):
    K = centroids.shape[-2]

    def step(centroids, _):
        assign = indices_onehot(nearest_centroid(x, centroids), K, x.dtype)             # [..., N, K]
        if weights is not None:
            assign = assign * weights[:, None]
        count = jnp.sum(assign, axis=-2)[..., None]                                      # [..., K, 1]
        total = jnp.einsum("...nk,...nd->...kd", assign, x)
        # An empty cluster keeps its centroid.
        return jnp.where(count > 0, total / jnp.maximum(count, 1.0), centroids), None

    centroids, _ = jax.lax.scan(step, centroids, None, length=iters)
    return centroids, nearest_centroid(x, centroids)


def _kmeans(x: jax.Array, num_centroids: int, iters: int, count: int | None = None
            ) -> tuple[jax.Array, jax.Array]:
    N = x.shape[-2] if count is None else count
    # Deterministic, public initialisation: evenly spaced rows (repeats when N < K).
    init_rows = np.floor(np.arange(num_centroids) * N / num_centroids).astype(np.int32)
    weights = None if count is None or count == x.shape[-2] else \
        (np.arange(x.shape[-2]) < count).astype(np.float32)
    return _lloyd(x, x[..., init_rows, :], weights, iters)


def _kmeans_runtime_count(x: jax.Array, count: jax.Array, num_centroids: int, iters: int):
    init_rows = jnp.floor(jnp.arange(num_centroids) * count / num_centroids).astype(jnp.int32)
    weights = (jnp.arange(x.shape[-2]) < count).astype(x.dtype)
    return _lloyd(x, jnp.take(x, init_rows, axis=-2), weights, iters)


# Jitted once per (shapes, K, iters); inside another jit (a policy's compress) it is inlined.
kmeans = jax.jit(_kmeans, static_argnames=("num_centroids", "iters", "count"))
kmeans_runtime_count = jax.jit(_kmeans_runtime_count, static_argnames=("num_centroids", "iters"))
kmeans_runtime_count.__doc__ = """`kmeans` of the first `count` rows (an int32 scalar known at
run time: bucketed prompts); the other rows are left out and get arbitrary codes."""
kmeans.__doc__ = """Lloyd's k-means as fixed-shape array code (batched over leading axes).

x: [..., N, d]; num_centroids K; iters fixed iterations of one-hot assignment + matmul
update; count: only the first `count` rows are clustered (the rest is padding; default N).
Returns (centroids [..., K, d], codes int32 [..., N] = nearest centroid of each row).
"""
