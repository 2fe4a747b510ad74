"""Hand-checkable tests of the shared MPC-friendly primitives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpcache_jax import primitives as P


def _as_sets(mask):
    return [set(np.flatnonzero(row).tolist()) for row in np.asarray(mask).reshape(-1, mask.shape[-1])]


@pytest.mark.parametrize("method", P.TOPK_METHODS)
def test_topk_mask_equals_lax_top_k_sets_with_ties(method):
    rng = np.random.RandomState(0)
    # Few distinct values -> many ties; 3 "heads" batched in one call.
    scores = rng.randint(0, 4, size=(3, 17)).astype(np.float32)
    for k in (1, 5, 16, 17):
        mask = P.topk_mask(jnp.asarray(scores), k, method=method)
        assert np.all(np.asarray(mask).sum(-1) == k)
        _, idx = jax.lax.top_k(jnp.asarray(scores), k)
        expected = [set(row.tolist()) for row in np.asarray(idx)]
        assert _as_sets(mask) == expected


def test_topk_mask_tie_break_prefers_lower_index():
    scores = jnp.asarray([[1.0, 2.0, 2.0, 2.0, 0.0]])
    for method in P.TOPK_METHODS:
        assert _as_sets(P.topk_mask(scores, 2, method=method)) == [{1, 2}]


@pytest.mark.parametrize("method", P.TOPK_METHODS)
def test_topk_mask_forced_and_invalid(method):
    scores = jnp.asarray([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    forced = jnp.asarray([0, 0, 0, 0, 0, 1])
    valid = jnp.asarray([0, 1, 1, 1, 1, 1])
    mask = P.topk_mask(scores, 3, valid=valid, forced=forced, method=method)
    # slot 0 is invalid despite the best score; slot 5 is forced despite the worst.
    assert set(np.flatnonzero(mask).tolist()) == {1, 2, 5}


@pytest.mark.parametrize("method", P.TOPK_METHODS)
def test_topk_mask_integer_output_matches_float(method):
    scores = jnp.asarray(np.random.RandomState(3).randn(4, 9).astype(np.float32))
    as_float = P.topk_mask(scores, 3, method=method)
    as_int = P.topk_mask(scores, 3, method=method, dtype=jnp.int32)
    assert as_float.dtype == jnp.float32 and as_int.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(as_int), np.asarray(as_float))
    assert np.asarray(as_int).sum(-1).tolist() == [3, 3, 3, 3]


def test_pairwise_rank_matches_brute_force_with_ties():
    rng = np.random.RandomState(5)
    for N in (1, 2, 3, 4, 7, 8, 16, 33):
        s = rng.randint(0, 4, size=(3, N)).astype(np.float32)    # many ties
        want = [[sum(s[b, j] >= s[b, i] for j in range(i)) +
                 sum(s[b, j] > s[b, i] for j in range(i + 1, N)) for i in range(N)]
                for b in range(3)]
        np.testing.assert_array_equal(np.asarray(P._pairwise_rank(jnp.asarray(s))), want)


def test_topk_mask_rejects_bad_k():
    with pytest.raises(ValueError, match="0 < k"):
        P.topk_mask(jnp.zeros(4), 5)
    with pytest.raises(ValueError, match="unknown top-k method"):
        P.topk_mask(jnp.zeros(4), 2, method="bitonic")


def test_onehot_gather_equals_fancy_indexing():
    rng = np.random.RandomState(1)
    x = rng.randn(2, 12, 3).astype(np.float32)
    mask = np.zeros((2, 12), np.float32)
    picks = [[0, 4, 5, 11], [2, 3, 7, 9]]
    for h, p in enumerate(picks):
        mask[h, p] = 1
    onehot = P.mask_onehot(jnp.asarray(mask), 4)
    got = np.asarray(P.gather_rows(onehot, jnp.asarray(x)))
    expected = np.stack([x[h, p] for h, p in enumerate(picks)])
    np.testing.assert_array_equal(got, expected)
    # An integer mask gives an integer one-hot with the same entries (and the same gather).
    int_onehot = P.mask_onehot(jnp.asarray(mask, jnp.int32), 4)
    assert int_onehot.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(int_onehot), np.asarray(onehot))
    assert sorted(np.unique(np.asarray(onehot)).tolist()) == [0.0, 1.0]
    np.testing.assert_array_equal(np.asarray(P.gather_rows(int_onehot, jnp.asarray(x))), expected)
    # From an index vector too.
    idx = jnp.asarray([[3, 1], [0, 11]])
    got_idx = np.asarray(P.gather_rows(P.indices_onehot(idx, 12), jnp.asarray(x)))
    np.testing.assert_array_equal(got_idx, np.stack([x[0, [3, 1]], x[1, [0, 11]]]))


def test_cluster_gather_equals_fancy_indexing():
    rng = np.random.RandomState(2)
    s, C, d = 4, 6, 3
    x = rng.randn(2, C * s, d).astype(np.float32)
    cmask = np.zeros((2, C), np.float32)
    cmask[0, [0, 3]] = 1
    cmask[1, [2, 5]] = 1
    got = np.asarray(P.gather_clusters(P.mask_onehot(jnp.asarray(cmask), 2), jnp.asarray(x), s))
    expected = np.stack([
        np.concatenate([x[0, 0:4], x[0, 12:16]]),
        np.concatenate([x[1, 8:12], x[1, 20:24]]),
    ])
    np.testing.assert_array_equal(got, expected)


def _random_chain(rng, R, n0, picks):
    """A 3-level selection chain: picks[i] of the candidates of level i (n0 at level 0, then
    r children of each row picked above); returns (chain, the finest ids it picks per row)."""
    chain, ids = [], [np.arange(n0)] * R
    n = n0
    for level, (k, r) in enumerate(picks):
        cand = n if level == 0 else chain[-1].shape[1] * r
        mask = np.zeros((R, cand), np.int32)
        for row in range(R):
            mask[row, np.sort(rng.choice(cand, k, replace=False))] = 1
        chain.append(P.mask_onehot(jnp.asarray(mask), k))
        if level == 0:
            ids = [np.flatnonzero(mask[row]) for row in range(R)]
        else:
            children = [np.repeat(ids[row] * r, r) + np.tile(np.arange(r), len(ids[row]))
                        for row in range(R)]
            ids = [children[row][np.flatnonzero(mask[row])] for row in range(R)]
        n = n * r if level else n
    return tuple(chain), np.stack(ids)


@pytest.mark.parametrize("R", [1, 3])
def test_chain_pick_and_put_equal_the_composed_onehot(R):
    """Picking through a selection's levels = picking with the composed one-hot (in the same
    row order), and chain_put is its exact transpose; a 1-row chain serves every head."""
    rng = np.random.RandomState(4)
    chain, ids = _random_chain(rng, R, 6, [(3, None), (4, 2), (5, 4)])   # 6 -> 48 finest
    k, N = P.chain_shape(chain)
    assert (k, N) == (5, 48)
    dense = np.asarray(P.chain_dense(chain))
    assert dense.shape == (R, 5, 48) and dense.dtype == np.int32
    np.testing.assert_array_equal(dense.argmax(-1), ids)
    np.testing.assert_array_equal(dense.sum(-1), 1)
    H, m, D = 3, 2, 5                                    # m rows per finest candidate
    x = rng.randn(H, N * m, D).astype(np.float32)
    got = np.asarray(P.chain_pick(chain, jnp.asarray(x)))
    rows = (ids[:, :, None] * m + np.arange(m)).reshape(R, -1)           # [R, k * m]
    want = np.stack([x[h, rows[h % R]] for h in range(H)])
    np.testing.assert_array_equal(got, want)
    y = rng.randn(H, k * m, D).astype(np.float32)
    back = np.asarray(P.chain_put(chain, jnp.asarray(y)))
    want_back = np.zeros((H, N * m, D), np.float32)
    for h in range(H):
        want_back[h, rows[h % R]] = y[h]
    np.testing.assert_array_equal(back, want_back)


def test_alpha_and_mp_bounds_on_a_2d_example():
    # One KV head, one query head, one cluster of two keys in 2-d.
    keys = jnp.asarray([[[1.0, -2.0], [3.0, 4.0]]])          # [1, 2, 2]
    r_max, r_min = P.cluster_bounds(keys, 2)                  # max (3, 4), min (1, -2)
    np.testing.assert_array_equal(np.asarray(r_max), [[[3.0, 4.0]]])
    np.testing.assert_array_equal(np.asarray(r_min), [[[1.0, -2.0]]])
    q = jnp.asarray([[[2.0, -1.0]]])                          # [H_kv=1, G=1, d=2]
    # MP: max(2*3, 2*1) + max(-1*4, -1*-2) = 6 + 2 = 8
    assert float(P.cluster_scores(q, r_max, r_min, mode="mp")[0, 0]) == pytest.approx(8.0)
    # alpha=0.6: 2*(0.6*3+0.4*1) + (-1)*(0.6*4+0.4*-2) = 2*2.2 - 1.6 = 2.8
    assert float(P.cluster_scores(q, r_max, r_min, mode="alpha", alpha=0.6)[0, 0]) == \
        pytest.approx(2.8)
    # True max dot product: max(2*1 + -1*-2, 2*3 + -1*4) = max(4, 2) = 4 <= 8.
    mean = jnp.mean(keys.reshape(1, 1, 2, 2), axis=2)
    assert float(P.cluster_scores(q, r_max, r_min, mode="avg", mean=mean)[0, 0]) == \
        pytest.approx(3.0)


def test_mp_bound_dominates_true_max_dot_product():
    rng = np.random.RandomState(3)
    s, C, d, G = 8, 10, 16, 3
    keys = rng.randn(2, C * s, d).astype(np.float32)
    q = rng.randn(2, G, d).astype(np.float32)
    r_max, r_min = P.cluster_bounds(jnp.asarray(keys), s)
    bound = np.asarray(P.cluster_scores(jnp.asarray(q), r_max, r_min, mode="mp"))
    true = np.einsum("kgd,kcsd->kgcs", q, keys.reshape(2, C, s, d)).max(-1).sum(1)
    assert np.all(bound >= true - 1e-4)


def test_incremental_bounds_equal_recomputed():
    rng = np.random.RandomState(4)
    s, C, d = 4, 5, 3
    keys = rng.randn(2, C * s, d).astype(np.float32)
    r_max, r_min = P.empty_bounds((2,), C, d)
    for slot in range(13):
        r_max, r_min = P.update_bounds(r_max, r_min, jnp.asarray(keys[:, slot]), slot, s)
    valid = (np.arange(C * s) < 13).astype(np.float32)
    want_max, want_min = P.cluster_bounds(jnp.asarray(keys), s, jnp.asarray(valid))
    np.testing.assert_array_equal(np.asarray(r_max), np.asarray(want_max))
    np.testing.assert_array_equal(np.asarray(r_min), np.asarray(want_min))


def test_budget_tokens():
    assert P.budget_tokens(0.1, 1000) == 100
    assert P.budget_tokens(1.0, 37) == 37
    assert P.budget_tokens(64, 1000) == 64
    assert P.budget_tokens(5000, 1000) == 1000
    for bad in (0.0, 1.5, -3, 0):
        with pytest.raises(ValueError):
            P.budget_tokens(bad, 100)


def test_a_budget_floor_gives_short_prompts_its_tokens_and_long_ones_their_ratio():
    floored = P.Budget(0.1, 384)
    assert [P.budget_tokens(floored, t) for t in (100, 384, 2048, 3840, 8192)] == [
        100, 384, 384, 384, 820]
    assert str(floored) == "0.1min384" and P.parse_budget("0.1min384") == floored
    odd = P.Budget(0.123456789, 5)
    assert P.parse_budget(str(odd)) == odd                   # records name it exactly
    assert P.budget_record(floored) == "0.1min384" and P.budget_record(0.1) == 0.1
    assert P.budget_ratio("0.1min384") == P.budget_ratio(floored) == 0.1
    assert [P.budget_label(b) for b in (0.1, 0.05, 128, floored, "0.2min64")] == [
        "0.1", "0.05", "128", "0.1min384", "0.2min64"]
    assert (P.parse_budget("0.2"), P.parse_budget("128")) == (0.2, 128)
    assert isinstance(P.parse_budget("128"), int)
    for text, message in (("128min384", "ratio=128.0 must be in"),
                          ("0.1min0", "min_tokens=0 must be an integer >= 1"),
                          ("0.1min3.5", "write RATIOminTOKENS"), ("ten", "is not a number"),
                          ("0", "must be a ratio in"), ("12.5", "whole number")):
        with pytest.raises(ValueError, match=message):
            P.parse_budget(text)
    with pytest.raises(ValueError, match="a token count needs no floor"):
        P.Budget(64, 384)


def test_topk_onehot_rows_are_the_entries_in_rank_order():
    """Row r of the one-hot marks the entry of rank r (lax.top_k's order, ties to the lower
    index); forced entries come first, invalid ones last; rows at or past a runtime k are
    zero."""
    rng = np.random.RandomState(1)
    scores = rng.randint(0, 5, size=(2, 3, 13)).astype(np.float32)   # ties, batched rows
    for k in (1, 4, 13):
        onehot = np.asarray(P.topk_onehot(jnp.asarray(scores), k, k))
        assert onehot.dtype == np.int32 and onehot.shape == (2, 3, k, 13)
        _, idx = jax.lax.top_k(jnp.asarray(scores), k)
        np.testing.assert_array_equal(onehot.argmax(-1), np.asarray(idx))
        assert (onehot.sum(-1) == 1).all()
    valid = (np.arange(13) < 9).astype(np.float32)
    forced = (np.arange(13) == 7).astype(np.float32)
    onehot = np.asarray(P.topk_onehot(jnp.asarray(scores), 5, 5, valid=valid, forced=forced))
    assert (onehot[..., 0, :].argmax(-1) == 7).all()           # forced first
    assert onehot[..., 9:].sum() == 0                          # invalid ones never (9 valid)
    runtime = np.asarray(jax.jit(lambda s, k: P.topk_onehot(s, k, 6))(jnp.asarray(scores), 3))
    np.testing.assert_array_equal(runtime[..., :3, :], np.asarray(P.topk_onehot(
        jnp.asarray(scores), 3, 3)))
    assert runtime[..., 3:, :].sum() == 0
    with pytest.raises(ValueError, match="k_max"):
        P.topk_onehot(jnp.asarray(scores), 2, 14)
    with pytest.raises(ValueError, match="k=7"):
        P.topk_onehot(jnp.asarray(scores), 7, 6)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 213, 255, 256, 257, 828, 2056])
def test_reduce_max_pads_to_a_power_of_two_only_where_that_saves_rounds(n):
    """Same value as jnp.max; padded (to the next power of two, with MAX_FILL) exactly when
    SPU's reduction would take more rounds on n entries than on the power of two."""
    from mpcache_jax import attention
    x = np.random.RandomState(n).randn(3, n).astype(np.float32) - 50.0
    got = attention.reduce_max(jnp.asarray(x), axis=-1)
    np.testing.assert_array_equal(np.asarray(got), x.max(-1, keepdims=True))
    shapes = [eqn.invars[0].aval.shape for eqn in
              jax.make_jaxpr(lambda v: attention.reduce_max(v))(x).jaxpr.eqns
              if eqn.primitive.name == "reduce_max"]
    padded = 1 << max(0, (n - 1).bit_length())
    want = padded if bin(n).count("1") > 2 else n
    assert shapes == [(3, want)]
    assert attention.max_rounds(256) == 8 and attention.max_rounds(255) == 14
    assert attention.max_rounds(213) == 11 and attention.max_rounds(1) == 0


@pytest.mark.parametrize("tiles", [(64, 64), (40, 100), (128, 24), (300, 300)])
def test_tiled_causal_attention_equals_the_blocks_and_is_plaintext_only(tiles, monkeypatch):
    """The plaintext prefill's tiles with an online softmax (whole and partial tiles, more
    query rows than keys per tile and the reverse, one tile for everything) give the blocked
    softmax's output up to float rounding, also for sharp rows where the running max moves
    many times; a program traced for MPC keeps the unrolled blocks (no loop in its jaxpr)."""
    from mpcache_jax import attention
    rng = np.random.RandomState(sum(tiles))
    T = 300
    q = jnp.asarray(rng.randn(6, T, 16).astype(np.float32) * 3)
    k = jnp.asarray(rng.randn(2, T, 16).astype(np.float32) * 3)
    v = jnp.asarray(rng.randn(2, T, 16).astype(np.float32))
    monkeypatch.setattr(attention, "TILED_MIN_TOKENS", 1 << 62)
    blocks = np.asarray(attention.causal_attention(q, k, v, block=32))
    got = np.asarray(jax.jit(lambda q, k, v: attention._tiled_causal_attention(
        q, k, v, *tiles))(q, k, v))
    np.testing.assert_allclose(got, blocks, atol=2e-5, rtol=0)
    assert np.abs(blocks[:, 1:] - blocks[:, :-1]).max() > 1.0     # rows differ: not trivial
    np.testing.assert_allclose(got[:, 0], np.repeat(np.asarray(v)[:, 0], 3, axis=0), atol=1e-6)
    monkeypatch.setattr(attention, "TILED_MIN_TOKENS", 64)
    monkeypatch.setattr(attention, "CPU_TILE", tiles)
    np.testing.assert_array_equal(np.asarray(jax.jit(
        lambda q, k, v: attention.causal_attention(q, k, v, block=32))(q, k, v)), got)
    loops = lambda: [e.primitive.name for e in jax.make_jaxpr(
        lambda q, k, v: attention.causal_attention(q, k, v, block=32))(q, k, v).jaxpr.eqns
        if e.primitive.name in ("while", "scan")]
    assert loops() != []
    with P.secure_trace():
        assert loops() == []


@pytest.mark.parametrize("group", [None, 1, 2, 3])
def test_plaintext_gathers_by_index_equal_the_secure_one_hot_products_bit_for_bit(group):
    """gather_rows / chain_pick / chain_put take rows by index in plaintext programs and multiply
    by the one-hot in programs traced for MPC (`secure_trace`): the same values, bit for bit
    (zero rows included), float and integer one-hots alike."""
    rng = np.random.RandomState(4)
    x = rng.randn(3, 20, P.INDEX_GATHER_MIN_WIDTH).astype(np.float32) * 100
    rows = np.zeros((3, 5, 20), np.int32)
    for h in range(3):
        rows[h, np.arange(4), rng.choice(20, 4, replace=False)] = 1   # row 4 stays empty
    for onehot in (rows, rows.astype(np.float32)):
        plain = jax.jit(lambda o, v: P.gather_rows(o, v, group))(onehot, x)
        with P.secure_trace():
            secure = jax.jit(lambda o, v: P.gather_rows(o, v, group))(onehot, x)
        np.testing.assert_array_equal(np.asarray(plain), np.asarray(secure))
        np.testing.assert_array_equal(np.asarray(plain)[:, :4], np.stack(
            [x[h, rows[h, :4].argmax(-1)] for h in range(3)]))
        assert (np.asarray(plain)[:, 4] == 0).all()
    chain = (jnp.asarray(rows[:1, :, :]),)                             # one shared row
    picked_plain = P.chain_put(chain, P.chain_pick(chain, jnp.asarray(x)))
    with P.secure_trace():
        picked_secure = jax.jit(lambda v: P.chain_put(chain, P.chain_pick(chain, v)))(x)
    np.testing.assert_array_equal(np.asarray(picked_plain), np.asarray(picked_secure))


@pytest.mark.parametrize("L,group,products", [(7, 1, 7), (7, 3, 3), (8, 3, 3), (17, 8, 3),
                                                (5, 5, 1), (5, 9, 1)])
def test_grouped_gathers_take_one_product_per_group_and_the_same_rows(L, group, products):
    """gather_rows with `group` g under MPC: ceil(L / g) products in all (batched or 2-D),
    each spreading its share of the L one-hots block-diagonally, none padded (their spread
    columns add up to L x N); the rows are the loop's, bit for bit."""
    rng = np.random.RandomState(L * 10 + group)
    x = jnp.asarray(rng.randn(L, 9, 6).astype(np.float32))
    onehot = np.zeros((L, 2, 9), np.int32)
    for i in range(L):
        onehot[i, 0, rng.randint(9)] = 1                                # row 1 stays empty
    with P.secure_trace():
        loop = jax.jit(lambda o, v: P.gather_rows(o, v, 1))(onehot, x)
        grouped = jax.jit(lambda o, v: P.gather_rows(o, v, group))(onehot, x)
        dots = [e for e in jax.make_jaxpr(lambda o, v: P.gather_rows(o, v, group))(
            onehot, x).jaxpr.eqns if e.primitive.name == "dot_general"]
    np.testing.assert_array_equal(np.asarray(grouped), np.asarray(loop))
    np.testing.assert_array_equal(np.asarray(loop)[:, 0], np.asarray(x)[np.arange(L), onehot[:, 0].argmax(-1)])
    assert (np.asarray(loop)[:, 1] == 0).all()
    counts, columns = 0, 0
    for dot in dots:
        (_, _), (batch, _) = dot.params["dimension_numbers"]
        shape = dot.invars[0].aval.shape
        counts += shape[0] if batch else 1
        columns += (shape[0] if batch else 1) * shape[-1]
    assert (counts, columns) == (products, L * 9)
    with pytest.raises(ValueError, match="group=0"):
        P.gather_rows(onehot, x, 0)


@pytest.mark.parametrize("size", [1, 2, 16, 64, 256])
def test_group_max_is_the_maximum_in_plaintext_and_as_a_tournament(size):
    """The tournament traced for MPC (ranks within groups of up to 16, then the rank-0 entry)
    gives each group's maximum, bit for bit the plaintext reduction's, ties included."""
    x = np.random.RandomState(size).randint(-4, 4, (3, 4 * size)).astype(np.float32) * 0.37
    want = x.reshape(3, 4, size).max(-1)
    np.testing.assert_array_equal(np.asarray(P.group_max(jnp.asarray(x), size)), want)
    with P.secure_trace():
        got = jax.jit(lambda v: P.group_max(v, size))(x)
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="power of two"):
        P.group_max(jnp.asarray(x[:, :12]), 3)


@pytest.mark.parametrize("runtime_k", [False, True])
def test_plaintext_masks_equal_the_secure_formulation(runtime_k):
    """In plaintext `topk_mask` (method lax) scatters its indices and `mask_onehot` finds each
    row's index by search; traced for MPC both stay one-hot arithmetic. The same arrays
    either way, with ties, invalid entries, leading axes, fewer ones than rows and a runtime
    k."""
    rng = np.random.RandomState(4)
    scores = jnp.asarray(rng.randint(0, 5, size=(2, 3, 40)).astype(np.float32))  # many ties
    valid = jnp.asarray((rng.rand(2, 3, 40) > 0.2).astype(np.float32))
    k = jnp.int32(7) if runtime_k else 7
    bound = {"k_max": 9} if runtime_k else {}
    for dtype in (jnp.float32, jnp.int32):
        plain = P.topk_mask(scores, k, valid=valid, method="lax", dtype=dtype, **bound)
        with P.secure_trace():
            secure = P.topk_mask(scores, k, valid=valid, method="lax", dtype=dtype, **bound)
        assert plain.dtype == secure.dtype == dtype
        np.testing.assert_array_equal(np.asarray(plain), np.asarray(secure))
        assert np.all(np.asarray(plain).sum(-1) == 7)
        fewer = plain * jnp.asarray(rng.rand(2, 3, 40) > 0.5, dtype)
        for mask in (plain, fewer):
            got = P.mask_onehot(mask, 9)
            with P.secure_trace():
                want = P.mask_onehot(mask, 9)
            assert got.dtype == want.dtype == dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            ones = np.asarray(mask).sum(-1).astype(int)
            for index in np.ndindex(*ones.shape):
                rows, n = np.asarray(got)[index], ones[index]
                assert rows[:n].sum() == n and not rows[n:].any()
                np.testing.assert_array_equal(np.flatnonzero(rows.sum(0)),
                                              np.flatnonzero(np.asarray(mask)[index]))


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_block_diagonal_places_each_block_and_zeros_elsewhere(dtype):
    """Padded (float, or plaintext) or spread by a product with the public identity (integers
    traced for MPC): the same [L m, L n] matrix, and `batched_matmul` equals one product per
    leading index through it."""
    rng = np.random.RandomState(7)
    blocks = (rng.randn(5, 2, 3) * 4).astype(dtype)
    want = np.zeros((10, 15), dtype)
    for i in range(5):
        want[2 * i:2 * i + 2, 3 * i:3 * i + 3] = blocks[i]
    np.testing.assert_array_equal(np.asarray(P.block_diagonal(jnp.asarray(blocks))), want)
    with P.secure_trace():
        traced = jax.jit(P.block_diagonal)(jnp.asarray(blocks))
    assert traced.dtype == dtype
    np.testing.assert_array_equal(np.asarray(traced), want)
    x = rng.randn(5, 3, 4).astype(np.float32)
    with P.secure_trace():
        got = P.batched_matmul(jnp.asarray(blocks), jnp.asarray(x), jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.einsum("lmn,lnp->lmp", blocks, x), rtol=1e-5)
