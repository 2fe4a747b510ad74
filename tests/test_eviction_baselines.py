"""Prompt-eviction baselines on hand-made cases: each keeps exactly what its rule says."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from mpcache_jax.cache import LayerKV
from mpcache_jax.policies import make_policy
from mpcache_jax.policies.base import GivenCounts, StreamingLLM, window_attention_mass
from mpcache_jax.policies.h2o import H2O
from mpcache_jax.policies.prefixkv import (MPCachePrefixKV, PrefixKV, lorenz_curve,
                                           search_retention)
from experiments.prefixkv_calibrate import main as prefixkv_main
from mpcache_jax.policies.pyramidkv import PyramidKV
from mpcache_jax.policies.snapkv import SnapKV, max_pool_1d
from mpcache_jax.policies.tova import TOVA
from mpcache_jax.policy import PrefillAux
from mpcache_jax.extent import Extent


def dense_layer(k: np.ndarray, extra: int = 4) -> LayerKV:
    """A prefill cache layer holding keys k [H_kv, T, d]; each value is tagged with its position
    (v[..., 0] = position) so the kept set can be read back from any compressed state."""
    Hkv, T, d = k.shape
    kk = np.zeros((Hkv, T + extra, d), np.float32)
    kk[:, :T] = k
    v = np.zeros_like(kk)
    v[:, :T, 0] = np.arange(T)
    return LayerKV(jnp.asarray(kk), jnp.asarray(v), jnp.asarray(T, jnp.int32))


def compress(policy, k, q, extra=4):
    """Compress one (or several) hand-made layers. k: [H_kv, T, d]; q: [H, T, d]."""
    T = k.shape[1]
    queries = None if q is None else (jnp.asarray(q),)
    return policy.compress((dense_layer(k, extra),), PrefillAux(queries, T), extra)[0]


def kept_positions(state, head=0) -> set[int]:
    return {int(round(float(p))) for p, ok in zip(np.asarray(state.v[head, :, 0]),
                                                 np.asarray(state.valid[head])) if ok}


def test_streaming_llm_keeps_sinks_and_recent_window():
    k = np.random.RandomState(0).randn(1, 30, 4).astype(np.float32)
    state = compress(StreamingLLM(budget=10), k, None)
    assert kept_positions(state) == {0, 1, 2, 3} | set(range(24, 30))


def test_max_pool_spreads_each_peak_over_its_kernel():
    x = jnp.asarray([0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 1, 0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(max_pool_1d(x, 7)),
                                  [5, 5, 5, 5, 5, 5, 5, 1, 1, 1, 1, 1])


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("length", [None, 53, 64])
def test_a_long_vote_in_blocks_of_rows_equals_the_one_block_vote(reduce, length):
    """The voting window scored in blocks of query rows (uneven split, the first block
    starting before row 0 when the window is the whole prompt, a bucketed prompt's runtime
    length and window) gives the one-block vote."""
    rng = np.random.RandomState(4)
    q = jnp.asarray(rng.randn(4, 64, 8), jnp.float32)
    k = jnp.asarray(rng.randn(2, 64, 8), jnp.float32)
    for window in (7, 30, 64 if length is None else 53):
        if length is None:
            args = dict(window=window, reduce=reduce)
        else:
            bound = min(window, length)                 # rows scored; the last bound - 2 count
            args = dict(window=jnp.asarray(bound - 2, jnp.int32), reduce=reduce,
                        extent=Extent(64, jnp.asarray(length, jnp.int32), 40), window_max=bound)
        whole = window_attention_mass(q, k, **args)
        for rows in (1, 3, 16):
            blocked = window_attention_mass(q, k, block_elements=4 * 64 * rows, **args)
            np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-5,
                                       atol=1e-6)
    assert float(jnp.max(whole)) > 0.1


def test_snapkv_keeps_pooled_neighbourhood_of_the_voted_token_and_the_window():
    """The window queries attend to token 5 only (logit 5 vs 0): after max-pooling (kernel 3)
    tokens 4, 5, 6 share the top score; the 4-token window is always kept."""
    T, d = 20, 4
    k = np.zeros((1, T, d), np.float32)
    k[0, 5, 0] = 10.0
    q = np.zeros((2, T, d), np.float32)            # 2 query heads share the KV head (GQA)
    q[:, :, 0] = 1.0
    policy = SnapKV(budget=7, window=4, kernel=3)
    scores, _ = policy.keep_scores(0, jnp.asarray(q), jnp.asarray(k), Extent(T, T), None)
    scores = np.asarray(scores)[0]
    assert scores[4] == scores[5] == scores[6] > 2 * scores[3]
    assert scores[15] < 0.1 * scores[5]   # the window's votes for itself do not leak into pooling
    assert kept_positions(compress(policy, k, q)) == {4, 5, 6, 16, 17, 18, 19}


def test_snapkv_window_is_cut_to_a_smaller_budget():
    k = np.random.RandomState(1).randn(1, 40, 4).astype(np.float32)
    q = np.random.RandomState(2).randn(1, 40, 4).astype(np.float32)
    assert kept_positions(compress(SnapKV(budget=8, window=32), k, q)) == set(range(32, 40))


def _h2o_case():
    """Every query is e_0; tokens 2, 5, 7 have key 10 e_0 (logit 5), the rest 0. Accumulated
    attention: token 2 ~ 3 + 2/2 + 5/3 = 5.7, token 5 ~ 2/2 + 5/3 = 2.7, token 7 ~ 5/3 = 1.7,
    token 0 ~ 1 + 1/2 = 1.5 (before any heavy token is visible), every other token ~ 0."""
    T, d = 12, 4
    k = np.zeros((1, T, d), np.float32)
    k[0, [2, 5, 7], 0] = 10.0
    q = np.zeros((1, T, d), np.float32)
    q[..., 0] = 1.0
    return k, q


def test_h2o_prefill_keeps_heavy_hitters_and_recent_half():
    k, q = _h2o_case()
    state = compress(H2O(budget=6, decode_window=0), k, q)
    assert kept_positions(state) == {2, 5, 7, 9, 10, 11}
    assert state.k.shape[1] == 6                       # decode_window=0: a buffer of B slots


def test_h2o_decode_slides_recent_window_and_accumulates_attention():
    """Buffer of 6 (decode_window=0), recent window 3. Token 12 gets key 20 e_0 (logit 10: it
    takes ~all attention of queries 12..15); later tokens get key 0. Each step drops the
    lowest accumulated score outside the newest 3 positions: 9, 10, 11 (prompt recency is
    not protected any more), then 7 (1.7) rather than 12 (~1 from each of queries 12..15), then 13."""
    k, q = _h2o_case()
    policy = H2O(budget=6, decode_window=0)
    state = compress(policy, k, q)
    query = jnp.zeros((1, 4)).at[0, 0].set(1.0)
    expected = [{2, 5, 7, 10, 11, 12}, {2, 5, 7, 11, 12, 13}, {2, 5, 7, 12, 13, 14},
                {2, 5, 12, 13, 14, 15}, {2, 5, 12, 14, 15, 16}]
    for step, want in enumerate(expected):
        position = 12 + step
        k_new = jnp.zeros((1, 4)).at[0, 0].set(20.0 if position == 12 else 0.0)
        v_new = jnp.zeros((1, 4)).at[0, 0].set(float(position))
        _, state, _ = policy.attend(0, query, k_new, v_new, state, None)
        assert kept_positions(state) == want, step
    scores = dict(zip(np.asarray(state.pos[0]).astype(int), np.asarray(state.score[0])))
    assert 4.8 < scores[12] < 5.1 and scores[2] > scores[12] > scores[5]   # ~1 per step, 5 steps


def test_h2o_decode_window_holds_new_tokens_before_evicting():
    """decode_window=2: 8 slots. Two new tokens fill the empty slots; the third evicts the
    lowest accumulated score outside the recent window {12, 13, 14}: token 11, which fewer
    queries have seen than 9 and 10 (all three only get ~1/450 per query)."""
    k, q = _h2o_case()
    policy = H2O(budget=6, decode_window=2)
    state = compress(policy, k, q)
    query = jnp.zeros((1, 4)).at[0, 0].set(1.0)
    for position in (12, 13):
        v_new = jnp.zeros((1, 4)).at[0, 0].set(float(position))
        _, state, _ = policy.attend(0, query, jnp.zeros((1, 4)), v_new, state, None)
    assert kept_positions(state) == {2, 5, 7, 9, 10, 11, 12, 13}   # 8 slots, nothing dropped
    v_new = jnp.zeros((1, 4)).at[0, 0].set(14.0)
    _, state, _ = policy.attend(0, query, jnp.zeros((1, 4)), v_new, state, None)
    assert kept_positions(state) == {2, 5, 7, 9, 10, 12, 13, 14}


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_tova_keeps_top_tokens_of_the_last_query_and_drops_the_argmin():
    """Keys are c_j e_0 for two query heads: head 0 queries e_0, head 1 queries -e_0, so a
    token's rank comes from the attention averaged over heads (not either head alone)."""
    rng = np.random.RandomState(4)
    T, d = 10, 4
    c = rng.permutation(np.linspace(-3, 3, T)).astype(np.float32)
    k = np.zeros((1, T, d), np.float32)
    k[0, :, 0] = c
    k[0, :, 1] = rng.randn(T)
    q = np.zeros((2, T, d), np.float32)
    q[0, :, 0], q[1, :, 0], q[1, :, 1] = 1.0, -0.5, 1.0
    policy = TOVA(budget=4, decode_window=0)
    state = compress(policy, k, q)
    logits = np.einsum("hd,td->ht", q[:, -1], k[0]) / 2.0
    mean = _softmax(logits).mean(0)
    assert kept_positions(state) == set(np.argsort(-mean)[:4].tolist())
    for step in range(3):
        before = sorted(kept_positions(state))
        q_new = rng.randn(2, d).astype(np.float32)
        k_new = rng.randn(1, d).astype(np.float32)
        position = T + step
        keys = np.concatenate([np.asarray(state.k[0])[np.asarray(state.valid[0]) > 0], k_new])
        order = [int(round(float(p))) for p, ok in zip(np.asarray(state.v[0, :, 0]),
                                                      np.asarray(state.valid[0])) if ok]
        mean = _softmax(q_new @ keys.T / 2.0).mean(0)
        dropped = (order + [position])[int(np.argmin(mean))]
        v_new = np.zeros((1, d), np.float32)
        v_new[0, 0] = position
        _, state, _ = policy.attend(0, jnp.asarray(q_new), jnp.asarray(k_new), jnp.asarray(v_new),
                                    state, None)
        assert kept_positions(state) == (set(before) | {position}) - {dropped}


def test_prefixkv_search_splits_budget_by_lorenz_curves():
    """Layer A holds all importance in 10% of its tokens (P(o) = min(1, 10 o)), layer B is
    uniform (P(o) = o). A global 30% budget: 0.1 p + p = 0.6 -> p = 0.545, A keeps 5.45%,
    B keeps 54.5%."""
    o = np.linspace(0, 1, 101)
    curves = np.stack([np.minimum(1.0, o / 0.1), o])
    p, counts = search_retention(curves, total=600, prompt_len=1000, min_keep=5)
    assert abs(p - 0.6 / 1.1) < 1e-3
    assert abs(counts[0] - 55) <= 1 and abs(counts[1] - 545) <= 1 and sum(counts) <= 600


@pytest.mark.parametrize("budget", [0.05, 0.1, 0.2, 0.5])
def test_prefixkv_binary_search_hits_global_budget_within_one_percent(budget):
    rng = np.random.RandomState(7)
    T, L = 1400, 30
    curves = tuple(tuple(lorenz_curve(rng.gamma(0.05 + 0.1 * l, size=T), 100)) for l in range(L))
    policy = PrefixKV(budget=budget, curves=curves)
    counts = policy.kept_counts(L, T)
    target = L * int(np.ceil(budget * T))
    assert 0.99 * target <= sum(counts) <= target
    assert len(set(counts)) > 1                           # budgets really differ per layer


def test_prefixkv_applies_per_layer_counts_and_keeps_start_and_recent_tokens():
    rng = np.random.RandomState(8)
    T, d = 40, 4
    o = np.linspace(0, 1, 101)
    policy = PrefixKV(budget=10, curves=(tuple(np.minimum(1.0, o / 0.1)), tuple(o)))
    counts = policy.kept_counts(2, T)
    assert counts[0] < 10 < counts[1] and sum(counts) <= 20
    layers = tuple(dense_layer(rng.randn(1, T, d).astype(np.float32)) for _ in range(2))
    queries = tuple(jnp.asarray(rng.randn(2, T, d), jnp.float32) for _ in range(2))
    cache = policy.compress(layers, PrefillAux(queries, T), 4)
    for layer, count in zip(cache, counts):
        assert layer.k.shape[1] == layer.kept == count
        recent = min(policy.num_recent, count - 4)       # what the budget leaves after 4 sinks
        assert {0, 1, 2, 3} | set(range(T - recent, T)) <= kept_positions(layer)
    assert kept_positions(cache[1]) == {0, 1, 2, 3} | set(range(T - counts[1] + 4, T))


def test_mpcache_prefixkv_uses_mpcache_forced_tokens_with_per_layer_counts():
    """Same curves as above: layer 0 keeps fewer than MPCache's 16 sinks (so exactly its first
    tokens), layer 1 keeps more than 16 + 32 forced tokens (sinks and recent all present)."""
    rng = np.random.RandomState(9)
    T, d = 200, 4
    o = np.linspace(0, 1, 101)
    policy = MPCachePrefixKV(budget=40, curves=(tuple(np.minimum(1.0, o / 0.1)), tuple(o)))
    small, large = policy.kept_counts(2, T)
    assert small < 16 and large > 48 and small + large <= 80
    layers = tuple(dense_layer(rng.randn(1, T, d).astype(np.float32)) for _ in range(2))
    queries = tuple(jnp.asarray(rng.randn(2, T, d), jnp.float32) for _ in range(2))
    cache = policy.compress(layers, PrefillAux(queries, T), 4)
    assert kept_positions(cache[0]) == set(range(small))
    assert set(range(16)) | set(range(T - 32, T)) <= kept_positions(cache[1])
    assert len(kept_positions(cache[1])) == large


def test_prefixkv_calibration_cli_round_trip(tmp_path):
    out = tmp_path / "curves.json"
    prefixkv_main(["prefixkv_calibrate", "--model", "llama-tiny", "--out", str(out),
                   "--num_prompts", "2", "--length", "48", "--grid", "20"])
    data = json.loads(out.read_text())
    assert data["num_layers"] == 4 and len(data["curves"][0]) == 21
    policy = make_policy("prefixkv", 0.25, calibration=str(out))
    assert len(policy.curves) == 4 and all(np.all(np.diff(c) >= 0) for c in policy.curves)
    assert sum(policy.kept_counts(4, 48)) <= 4 * 12
    with pytest.raises(ValueError, match="layers"):
        policy.kept_counts(3, 48)


def test_a_layer_budget_wraps_the_scoring_of_any_prompt_eviction_policy():
    """StreamingLLM's own rule (4 sinks, then the most recent tokens) under per-layer counts
    it was never written for: each layer keeps its own count by that rule. A family whose
    decode steps assume one budget in every layer refuses a layer budget."""
    T = 30
    policy = StreamingLLM(budget=8, layer_budget=GivenCounts((6, 10)))
    assert policy.kept_counts(2, T) == (6, 10)
    layers = tuple(dense_layer(np.zeros((1, T, 4), np.float32)) for _ in range(2))
    cache = policy.compress(layers, PrefillAux(None, T), 4)
    assert kept_positions(cache[0]) == {0, 1, 2, 3, 28, 29}
    assert kept_positions(cache[1]) == {0, 1, 2, 3} | set(range(24, 30))
    with pytest.raises(ValueError, match="2 layer counts for 3 layers"):
        policy.kept_counts(3, T)
    with pytest.raises(ValueError, match="keeps one budget in every layer"):
        make_policy("h2o", 0.1, layer_budget=GivenCounts((2, 2)))
    with pytest.raises(ValueError, match="static eviction only"):
        make_policy("mpcache_exact", 0.1, layer_budget=GivenCounts((2, 2)))


def test_pyramidkv_layer_counts_form_a_pyramid_under_the_budget():
    """B = 100, window 32: the other 68 per layer spread as 68/20 = 3.4 (top) .. 132.6
    (bottom), step 43.07 -> 164, 121, 78, 35 (floors), mean 99.5 <= 100."""
    assert PyramidKV(budget=100).kept_counts(4, 1000) == (164, 121, 78, 35)
    assert PyramidKV(budget=1.0).kept_counts(4, 50) == (50,) * 4


@pytest.mark.parametrize("cls,bad,match", [
    (H2O, dict(decode_window=-1), "decode_window"),
    (TOVA, dict(decode_window=1.5), "decode_window"),
    (SnapKV, dict(kernel=4), "kernel"),
    (SnapKV, dict(window=0), "window"),
    (PyramidKV, dict(beta=0.5), "beta"),
    (PrefixKV, dict(curves=((0.0, 0.7, 0.5),)), "rise"),
    (PrefixKV, dict(num_recent=0), "num_recent"),
])
def test_config_validation(cls, bad, match):
    with pytest.raises(ValueError, match=match):
        cls(**bad)
