"""MPCache policy behaviour on tiny models: exactness at full budget, budgets, selection rules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpcache_jax import primitives as P
from mpcache_jax.cache import empty_layer
from runtime.generate import compress_cache
from mpcache_jax.policies import POLICY_NAMES, MPCache, make_policy
from mpcache_jax.cache import LayerKV
from mpcache_jax.policies.base import PrunedLayer
from mpcache_jax.policy import PrefillAux
from mpcache_jax.extent import Extent
from models import registry
from models.model import decode_logits
from tests.decode_helpers import teacher_forced_logits


def prompt_state(k, extras=None) -> PrunedLayer:
    """A layer holding only a prompt: keys = values = k [H_kv, S, d], every slot valid, room
    for 4 generated tokens; `extras` are the policy's `layer_extras`."""
    Hkv, S, d = k.shape
    return PrunedLayer(k, k, jnp.ones((Hkv, S), jnp.float32), empty_layer(Hkv, 4, d),
                       extras, prompt_len=S, kept=S)


SMALL_LEVELS = {"levels": ((8, 0.5), (4, None))}


@pytest.fixture(scope="module")
def tiny():
    lm = registry.load("llama-tiny")
    tokens = np.random.RandomState(0).randint(0, lm.model.cfg.vocab_size, size=140)
    return lm.model, lm.params, tokens


_run = teacher_forced_logits


@pytest.mark.parametrize("similarity", ["exact", "alpha", "mp", "avg"])
def test_full_budget_equals_full_attention(tiny, similarity):
    model, params, tokens = tiny
    want, _ = _run(model, params, tokens, make_policy("full"), 120, 6)
    policy = make_policy("mpcache_exact", 1.0, similarity=similarity, **SMALL_LEVELS)
    got, _ = _run(model, params, tokens, policy, 120, 6)
    assert np.abs(got - want).max() <= 1e-5


def test_budget_changes_output_and_is_respected(tiny):
    model, params, tokens = tiny
    want, _ = _run(model, params, tokens, make_policy("full"), 120, 4)
    policy = make_policy("mpcache_exact", 24, static=True, static_keep=64, **SMALL_LEVELS)
    got, cache = _run(model, params, tokens, policy, 120, 4)
    assert np.abs(got - want).max() > 1e-4  # eviction really happened
    layer = cache[0]
    assert isinstance(layer, PrunedLayer) and layer.kept == 64
    # Selection: exactly budget // finest-size clusters, each of 4 tokens, per KV head.
    q = jnp.asarray(np.random.RandomState(1).randn(model.cfg.num_heads, model.cfg.head_dim),
                    jnp.float32)
    onehot = np.asarray(policy.select(q, layer))
    assert onehot.shape[1] * 4 <= 24
    np.testing.assert_array_equal(onehot.sum(-1), 1.0)          # each row picks one cluster
    chosen = [set(np.argmax(row, -1).tolist()) for row in onehot]
    for heads_set in chosen:
        assert 0 in heads_set and (64 // 4 - 1) in heads_set       # sink + most recent forced
        assert len(heads_set) == onehot.shape[1]                   # no cluster twice


def test_static_eviction_keeps_most_attended_tokens():
    """Hand-made layer: the window queries attend only to tokens 3 and 7 (and themselves)."""
    d, T = 4, 10
    k = np.zeros((1, T, d), np.float32)
    k[0, 3] = [10, 0, 0, 0]
    k[0, 7] = [0, 10, 0, 0]
    q = np.zeros((1, T, d), np.float32)
    q[0, -2:] = [1, 1, 0, 0]
    policy = MPCache(budget=3, static=True, static_keep=3, dynamic=False, static_window=0.2)
    scores, _ = policy.keep_scores(0, jnp.asarray(q), jnp.asarray(k), Extent(T, T), None)
    keep = P.topk_mask(scores, 3)
    assert set(np.flatnonzero(np.asarray(keep)).tolist()) == {3, 7, 0}  # tie at 0 -> lowest index


def test_cluster_static_eviction_keeps_whole_clusters():
    """Clusters of 4 over T=18 (last cluster partial: 2 tokens). The window votes for token 9
    only, so its cluster {8..11} is kept whole, plus the forced sink and last clusters."""
    d, T = 4, 18
    k = np.zeros((1, T, d), np.float32)
    k[0, 9] = [10, 0, 0, 0]
    q = np.zeros((1, T, d), np.float32)
    q[0, -3:] = [1, 0, 0, 0]
    policy = MPCache(budget=10, static=True, dynamic=False, static_cluster=4, static_window=3,
                     static_sinks=1, static_recent=1)
    count = policy.kept_count(T)
    assert count == 4 + 4 + 2              # two whole clusters and the partial last one
    mask, _ = policy.keep_mask(0, jnp.asarray(q), jnp.asarray(k), Extent(T, T), count, count,
                               policy.forced_keep(Extent(T, T), count), None)
    assert set(np.flatnonzero(np.asarray(mask)).tolist()) == {0, 1, 2, 3, 8, 9, 10, 11, 16, 17}


def test_model_scope_keeps_one_set_for_all_layers(tiny):
    model, params, tokens = tiny
    policy = make_policy("mpcache_exact", 40, static=True, dynamic=False, static_scope="model",
                         static_cluster=4, static_window=8, static_sinks=4, static_recent=4)
    _, cache = _run(model, params, tokens, policy, 120, 1)
    first = np.asarray(cache[0].k[:, : cache[0].kept])
    cache_t = model.init_cache(121)
    _, dense, _ = model.prefill(params, tokens[:120], cache_t)
    # The kept keys of every layer are the same prompt positions of that layer's dense keys.
    for l in (0, 1, model.cfg.num_layers - 1):
        kept = np.asarray(cache[l].k[0, : cache[l].kept])
        dense_k = np.asarray(dense[l].k[0, :120])
        pos = [int(np.argmin(np.abs(dense_k - row).sum(-1))) for row in kept]
        if l == 0:
            positions = pos
        assert pos == positions and len(set(pos)) == len(pos) == cache[l].kept
    assert first.shape[1] == 40 and positions[:4] == [0, 1, 2, 3] and positions[-4:] == [116, 117, 118, 119]


def test_auto_scope_selects_per_head_only_on_models_with_few_kv_heads():
    from mpcache_jax.policies.mpcache import AUTO_HEAD_MAX_KV_HEADS
    policy = make_policy("mpcache_exact", 0.1)
    assert policy.select_scope == "auto"
    assert policy.scope_for(3) == "head" and policy.scope_for(AUTO_HEAD_MAX_KV_HEADS) == "head"
    assert policy.scope_for(32) == "layer"
    assert policy.ranked_rows(2048, 32)[0] == 1 and policy.ranked_rows(2048, 3)[0] == 3
    per_head_static = make_policy("mpcache_exact", 0.1, static=True, static_scope="head")
    assert per_head_static.scope_for(32) == "head"
    assert make_policy("mpcache_exact", 0.1, select_scope="layer").scope_for(3) == "layer"


def test_cross_layer_sharing_schedule():
    policy = MPCache(share_group=2, share_from=2)
    assert [policy.selects(l) for l in range(7)] == [True, True, True, False, True, False, True]
    assert all(MPCache(share_group=1).selects(l) for l in range(7))


def test_shared_layers_reuse_selection(tiny):
    model, params, tokens = tiny
    policy = make_policy("mpcache_exact", 16, static=True, static_keep=64, share_group=2,
                         **SMALL_LEVELS)
    _, cache = _run(model, params, tokens, policy, 120, 1)
    q = jnp.asarray(np.random.RandomState(2).randn(model.cfg.num_heads, model.cfg.head_dim),
                    jnp.float32)
    sel2 = policy.select(q, cache[2])
    _, _, carry = policy.attend(2, q, jnp.zeros((2, 16)), jnp.zeros((2, 16)), cache[2], None)
    _, _, carry3 = policy.attend(3, q, jnp.zeros((2, 16)), jnp.zeros((2, 16)), cache[3], carry)
    assert carry3 is carry            # layer 3 reuses layer 2's selection chain as it is
    np.testing.assert_array_equal(np.asarray(P.chain_dense(carry3)), np.asarray(sel2))


@pytest.mark.parametrize("bad,match", [
    (dict(alpha=1.5), "alpha"),
    (dict(levels=((16, 0.5), (32, None))), "coarse to fine"),
    (dict(levels=((32, 0.5), (12, None))), "coarse to fine"),
    (dict(levels=((32, 1.5), (16, None))), "keep ratio"),
    (dict(levels=((32, 0.5), (16, 0.5))), "final budget"),
    (dict(budget=0.0), "budget"),
    (dict(budget=6), "always-selected"),
    (dict(select_scope="group"), "select_scope"),
    (dict(static=True, static_scope="head", select_scope="layer"), "select per head too"),
    (dict(static_keep=2.0), "static_keep"),
    (dict(similarity="cosine"), "similarity"),
    (dict(static_scope="global"), "static_scope"),
    (dict(static_cluster=0), "static_cluster"),
    (dict(static_window=0.0), "static_window"),
    (dict(oversample=0.5), "oversample"),
    (dict(oversample="2"), "oversample"),
    (dict(group_reduce="mean"), "group_reduce"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        MPCache(**bad)


@pytest.mark.parametrize("budget", [0.05, 0.1, 0.2, 0.3])
def test_finest_level_chooses_among_at_least_twice_its_budget(budget):
    """The default's coarse level (16-token clusters, 20% kept) hands the 4-token level at
    least 2x the budget at every budget. From 20% on, its keep ratio alone (the paper's rule,
    oversample=0) hands down hardly more than the 4-token level keeps: no choice left."""
    policy = make_policy("mpcache_exact", budget=budget)
    plain = make_policy("mpcache_exact", budget=budget, oversample=0)
    for prompt_len in (512, 1000, 2048):
        tokens = P.budget_tokens(budget, prompt_len)
        coarse, finest = policy.level_counts(prompt_len, tokens)
        assert finest == tokens // 4
        assert coarse * 16 >= min(2 * tokens, prompt_len)        # candidates >= 2 x budget
        assert coarse * 4 >= 2 * finest
        plain_coarse, plain_finest = plain.level_counts(prompt_len, tokens)
        assert plain_finest == finest
        if budget < 0.2:     # the 20% ratio already hands down >= 2x: oversampling adds nothing
            assert plain_coarse == coarse
        else:   # the ratio alone leaves at most one coarse cluster (+ the padding) of slack
            assert plain_coarse * 16 - finest * 4 < 16 + (-prompt_len % 16)
            assert coarse > plain_coarse


def test_ratio_budget_too_small_for_forced_clusters(tiny):
    model, params, tokens = tiny
    policy = make_policy("mpcache_exact", 0.05)   # 6 tokens of 120 < 2 clusters of 4
    cache = model.init_cache(124)
    _, cache, aux = model.prefill(params, tokens[:120], cache, return_queries=True)
    with pytest.raises(ValueError, match="always-selected"):
        compress_cache(policy, cache, aux, 4)


def test_registry_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("orcale")
    with pytest.raises(ValueError, match="no option"):
        make_policy("mpcache_exact", 0.1, gamma=3)
    assert "mpcache" in POLICY_NAMES and "full" in POLICY_NAMES


def test_decode_compiles_once_per_policy(tiny):
    from models import model as model_module
    model, params, tokens = tiny
    policy = make_policy("mpcache_exact", 32, static_keep=64, **SMALL_LEVELS)
    cache = model.init_cache(130)
    _, cache, aux = model.prefill(params, tokens[:120], cache, return_queries=True)
    cache = compress_cache(policy, cache, aux, 10)
    logits, cache = model.decode_step(params, tokens[120], 120, cache, policy)
    size = model_module._decode._cache_size()
    for t in range(121, 126):
        logits, cache = model.decode_step(params, tokens[t], t, cache, policy)
    assert model_module._decode._cache_size() == size


@pytest.mark.parametrize("token_score", ["dot", "cosine", "projection"])
@pytest.mark.parametrize("scope,group_reduce", [("layer", "sum"), ("head", "sum"),
                                                ("layer", "max"), ("head", "max")])
def test_exact_selection_picks_the_clusters_with_the_best_tokens(scope, group_reduce,
                                                                 token_score):
    """similarity="exact": the chosen clusters are the forced first/last ones and those whose
    best token scores highest (a token's score: its GQA group's summed or best q . k, cos(q, k)
    with token_score="cosine" or q . k / |q| with "projection", then summed over the KV heads
    for a per-layer selection). Keys and queries have spread norms, so the three token scores
    rank apart."""
    rng = np.random.RandomState(3)
    Hkv, G, d, S, s = 2, 2, 8, 64, 4
    policy = MPCache(budget=24, levels=((s, None),), select_scope=scope,
                     group_reduce=group_reduce, token_score=token_score)
    k = rng.randn(Hkv, S, d) * rng.uniform(0.2, 5.0, size=(Hkv, S, 1))
    q = rng.randn(Hkv * G, d) * rng.uniform(0.2, 5.0, size=(Hkv * G, 1))
    k, q = jnp.asarray(k, jnp.float32), jnp.asarray(q, jnp.float32)
    state = prompt_state(k, P.inverse_norms(k) if token_score == "cosine" else None)
    chosen = np.asarray(policy.select(q, state))
    assert chosen.shape == ((1 if scope == "layer" else Hkv), 24 // s, S // s)

    def expected(qn, kn):
        per_head = np.einsum("kgd,ksd->kgs", qn.reshape(Hkv, G, d), kn)
        token = per_head.max(1) if group_reduce == "max" else per_head.sum(1)
        if scope == "layer":
            token = token.sum(0, keepdims=True)
        best = token.reshape(token.shape[0], S // s, s).max(-1)
        forced = {0, S // s - 1}
        picks = []
        for row in range(best.shape[0]):
            rest = [c for c in np.argsort(-best[row], kind="stable") if c not in forced]
            picks.append(forced | set(rest[:24 // s - 2]))
        return picks

    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    qn, kn = np.asarray(q), np.asarray(k)
    picks = {"dot": expected(qn, kn), "cosine": expected(unit(qn), unit(kn)),
             "projection": expected(unit(qn), kn)}
    assert all(picks[token_score] != picks[other] for other in picks if other != token_score)
    assert [set(row.argmax(-1).tolist()) for row in chosen] == picks[token_score]


@pytest.mark.parametrize("normalized_keys", [False, True])
def test_auto_token_score_is_the_cosine_on_models_with_normalized_keys(normalized_keys):
    """token_score="auto" (the default) decides at prefill: a model whose keys are
    RMS-normalized per head (QK-norm: PrefillAux.normalized_keys) gets the cosine selection
    (the layers carry the keys' inverse norms), any other the dot product; each picks as the
    explicit setting does."""
    rng = np.random.RandomState(7)
    Hkv, G, d, T = 1, 4, 8, 64
    k = rng.randn(Hkv, T, d) * rng.uniform(0.2, 5.0, size=(Hkv, T, 1))
    q = jnp.asarray(rng.randn(Hkv * G, d) * rng.uniform(0.2, 5.0, size=(Hkv * G, 1)), jnp.float32)
    dense = LayerKV(jnp.asarray(np.pad(k, ((0, 0), (0, 4), (0, 0))), jnp.float32),
                    jnp.zeros((Hkv, T + 4, d), jnp.float32), jnp.asarray(T, jnp.int32))
    aux = PrefillAux(queries=None, prompt_len=T, normalized_keys=normalized_keys)

    def picks(**options):
        policy = MPCache(budget=16, levels=((4, None),), **options)
        state = policy.compress((dense,), aux, 4)[0]
        return state, sorted(np.asarray(policy.select(q, state))[0].argmax(-1).tolist())
    state, auto = picks()
    _, dot = picks(token_score="dot")
    _, cosine = picks(token_score="cosine")
    assert dot != cosine
    assert auto == (cosine if normalized_keys else dot)
    if normalized_keys:
        np.testing.assert_allclose(np.asarray(state.extras),
                                   1 / np.linalg.norm(k, axis=-1), rtol=1e-4)
    else:
        assert state.extras is None


def test_cosine_token_score_needs_the_exact_similarity():
    with pytest.raises(ValueError, match="similarity='exact'"):
        MPCache(similarity="mp", token_score="cosine")
    with pytest.raises(ValueError, match="token_score"):
        MPCache(token_score="l2")


@pytest.mark.parametrize("levels", [((4, None),), ((8, 0.5), (4, None))])
def test_selection_matches_brute_force(levels):
    """select() = top clusters by the MP bound computed directly (single level), and the
    hierarchical version only picks children of the best coarse clusters."""
    rng = np.random.RandomState(5)
    Hkv, G, d, kept = 2, 2, 8, 64
    policy = MPCache(budget=24, static=True, static_keep=kept, similarity="mp", levels=levels,
                     select_scope="head")
    k = jnp.asarray(rng.randn(Hkv, kept, d), jnp.float32)
    valid = jnp.ones((Hkv, kept), jnp.float32)
    state = prompt_state(k, policy.layer_extras(k, valid))
    q = jnp.asarray(rng.randn(Hkv * G, d), jnp.float32)
    chosen = np.asarray(policy.select(q, state)).argmax(-1)       # [Hkv, k] finest cluster ids
    s = levels[-1][0]
    kc = np.asarray(k).reshape(Hkv, kept // s, s, d)
    qg = np.asarray(q).reshape(Hkv, G, d)
    bound = np.maximum(qg[:, :, None, :] * kc.max(2)[:, None], qg[:, :, None, :] * kc.min(2)[:, None])
    bound = bound.sum(axis=(1, 3))                                   # [Hkv, C]
    n = 24 // s
    for h in range(Hkv):
        if len(levels) == 1:
            forced = {0, kept // s - 1}
            rest = [c for c in np.argsort(-bound[h], kind="stable") if c not in forced]
            assert set(chosen[h].tolist()) == forced | set(rest[: n - 2])
        else:
            s0 = levels[0][0]
            kc0 = np.asarray(k).reshape(Hkv, kept // s0, s0, d)
            b0 = np.maximum(qg[:, :, None, :] * kc0.max(2)[:, None],
                            qg[:, :, None, :] * kc0.min(2)[:, None]).sum(axis=(1, 3))
            counts = policy.level_counts(kept, 24)
            forced0 = {0, kept // s0 - 1}
            rest0 = [c for c in np.argsort(-b0[h], kind="stable") if c not in forced0]
            coarse = forced0 | set(rest0[: counts[0] - 2])
            r = s0 // s
            children = [c for c in range(kept // s) if c // r in coarse]
            forced1 = {0, kept // s - 1}
            rest1 = [c for c in sorted(children, key=lambda c: (-bound[h, c], c)) if c not in forced1]
            assert set(chosen[h].tolist()) == forced1 | set(rest1[: counts[1] - 2])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("start,stop", [(0, 24), (3, 19)])
def test_attend_selected_equals_gathering_keys_and_values(start, stop, shared):
    """Scores picked and probabilities scattered back by the one-hot = attention over the
    gathered clusters (plus the slots outside [start, stop) and the generated tokens), and so
    does the plaintext path's softmax masked by the selection (`attend_masked`)."""
    from mpcache_jax.cache import append_token
    from mpcache_jax.policies.base import attend_masked, attend_selected, attend_with_new
    rng = np.random.RandomState(7)
    Hkv, G, S, d, s = 2, 2, 24, 4, 4
    S = stop + 5 if start else S
    q = jnp.asarray(rng.randn(Hkv * G, d), jnp.float32)
    k = jnp.asarray(rng.randn(Hkv, S, d), jnp.float32)
    v = jnp.asarray(rng.randn(Hkv, S, d), jnp.float32)
    valid = np.ones((Hkv, S), np.float32)
    valid[:, stop - 2:stop] = 0.0        # a partly empty last cluster
    new = empty_layer(Hkv, 3, d)
    new = append_token(new, jnp.asarray(rng.randn(Hkv, d), jnp.float32),
                       jnp.asarray(rng.randn(Hkv, d), jnp.float32))
    C = (stop - start) // s
    # shared: one selection for both heads and one valid row (passed as [S]), picked once.
    picks = [[0, C - 1], [0, C - 1]] if shared else [[0, C - 1], [1, 2]]
    mask = np.zeros((Hkv, C), np.int32)
    for h, p in enumerate(picks):
        mask[h, p] = 1
    onehot = P.mask_onehot(jnp.asarray(mask[:1] if shared else mask), 2)
    got = attend_selected(q, k, v, valid[0] if shared else valid, new, onehot, s, start, stop)
    slots = [np.concatenate([np.arange(start), *[start + c * s + np.arange(s) for c in p],
                             np.arange(stop, S)]) for p in picks]
    take = lambda x: jnp.stack([x[h, idx] for h, idx in enumerate(slots)])
    expected = attend_with_new(q, take(k), take(v), take(jnp.asarray(valid)), new)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)
    masked = attend_masked(q, k, v, valid[0] if shared else valid, new,
                           jnp.asarray(np.broadcast_to(mask[:1], mask.shape) if shared else mask),
                           s, start, stop)
    np.testing.assert_allclose(np.asarray(masked), np.asarray(expected), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="do not tile"):
        attend_selected(q, k, v, valid, new, onehot, s + 1, start, stop)
    with pytest.raises(ValueError, match="do not tile"):
        attend_masked(q, k, v, valid, new, jnp.asarray(mask), s + 1, start, stop)


def test_softmax_normalisations_agree_and_are_validated(tiny):
    from mpcache_jax import attention
    scores = jnp.asarray(np.random.RandomState(0).randn(3, 10) * 4, jnp.float32)
    valid = np.ones((3, 10), np.float32)
    valid[1, 4:] = 0
    valid[2] = 0                          # a row with nothing to attend to stays all zero
    a = attention.masked_softmax(scores, valid, normalize="reciprocal")
    b = attention.masked_softmax(scores, valid, normalize="divide")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(a).sum(-1), [1.0, 1.0, 0.0], atol=1e-6)
    assert float(np.asarray(a)[1, 4:].max()) == 0.0
    with pytest.raises(ValueError, match="normalize"):
        attention.masked_softmax(scores, valid, normalize="sum")
    with pytest.raises(ValueError, match="softmax"):
        make_policy("mpcache_exact", 0.25, softmax="exp2")
    # Decode logits do not depend on the normalisation (only the MPC cost does).
    for name in ("full", "mpcache"):
        model, params, tokens = tiny
        logits = [_run(model, params, tokens, make_policy(name, 0.25, softmax=m), 128, 3)[0]
                  for m in ("reciprocal", "divide")]
        np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options", [
    {"levels": ((16, 0.2), (4, None))},                                   # the default
    {"levels": ((16, 0.5), (8, 0.5), (4, None)), "select_scope": "head"},
    {"levels": ((8, 0.5), (4, None)), "static": True, "static_keep": 64},
], ids=["default", "three_levels_per_head", "after_static"])
def test_ranked_rows_are_the_rows_selection_ranks(tiny, options, monkeypatch):
    """The cost runs choose pairwise rank or sort from `ranked_rows`; it must name the rows
    and the longest row that `select` actually hands to the top-k."""
    model, params, tokens = tiny
    T = 120
    policy = make_policy("mpcache_exact", 0.2, **options)
    seen = []
    real_topk = P.topk_mask

    def recording(scores, k, **kw):
        seen.append(scores.shape)
        return real_topk(scores, k, **kw)
    cache = model.init_cache(T + 4)
    _, cache, aux = model.prefill(params, tokens[:T], cache, return_queries=True)
    cache = compress_cache(policy, cache, aux, 4)
    monkeypatch.setattr(P, "topk_mask", recording)   # the decode step's selection only
    jax.eval_shape(lambda c: decode_logits(model, policy, params, tokens[T], T, c), cache)
    assert seen, "selection ranked nothing"
    rows, longest = policy.ranked_rows(T, model.cfg.num_kv_heads)
    layer_rows = {shape[:-1] for shape in seen}
    assert {r[0] for r in layer_rows} == {rows}
    assert max(shape[-1] for shape in seen) == longest


def test_group_reduce_changes_the_selection_only_with_query_groups():
    """With GQA groups, "max" and "sum" choose differently on these scores (so the test above
    could not pass with the option ignored); with one query head per KV head they are the
    same selection."""
    rng = np.random.RandomState(3)
    S, d = 64, 8
    for Hkv, G, differ in ((2, 3, True), (4, 1, False)):
        k = jnp.asarray(rng.randn(Hkv, S, d), jnp.float32)
        state = prompt_state(k)
        q = jnp.asarray(rng.randn(Hkv * G, d), jnp.float32)
        picks = [np.asarray(MPCache(budget=16, levels=((4, None),), select_scope="head",
                                    group_reduce=r).select(q, state)) for r in ("sum", "max")]
        assert (not np.array_equal(*picks)) == differ


# ----- temporal reuse: a working set gathered on refresh steps ------------------------------------
def _reuse_pair(scope, refresh_every=3):
    reuse = make_policy("mpcache_exact", 16, select_scope=scope, refresh_every=refresh_every,
                        **SMALL_LEVELS)
    return reuse, make_policy("mpcache_exact", 16, select_scope=scope, **SMALL_LEVELS)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_reuse_selects_on_refresh_steps_and_keeps_the_working_set_between(scope):
    """Refresh steps (every refresh_every-th, the first included) select as the every-step
    policy does and give its output; the steps between attend to the same gathered tokens
    (equal to attention over exactly those prompt slots plus the generated tokens)."""
    reuse, every = _reuse_pair(scope)
    rng = np.random.RandomState(0)
    Hkv, G, S, d = 2, 2, 64, 8
    k = jnp.asarray(rng.randn(Hkv, S, d), jnp.float32)
    state_every = prompt_state(k).replace(new=empty_layer(Hkv, 8, d))
    state = state_every.replace(working=reuse._empty_working_set(state_every))
    held = None
    for step in range(7):
        q = jnp.asarray(rng.randn(Hkv * G, d), jnp.float32)
        k_new = jnp.asarray(rng.randn(Hkv, d), jnp.float32)
        want_slots = np.asarray(every.attended_slots(0, q, state_every, None))
        out, state, _ = reuse.attend(0, q, k_new, k_new, state, None)
        ref, state_every, _ = every.attend(0, q, k_new, k_new, state_every, None)
        slots = np.asarray(state.working.attended_slots(Hkv, S))
        if step % 3 == 0:
            np.testing.assert_array_equal(slots, want_slots)
            assert float(jnp.abs(out - ref).max()) <= 1e-5
            held = slots
        else:
            np.testing.assert_array_equal(slots, held)
        assert slots.sum(axis=1).max() == 16                 # the budget, per selection row
        # Reference: softmax over the held prompt slots and the generated tokens.
        new = state.new
        n = int(new.length)
        keys = np.concatenate([np.asarray(k), np.asarray(new.k)[:, :n]], axis=1)
        mask = np.concatenate([held, np.ones((Hkv, n), np.int32)], axis=1) > 0
        qg = np.asarray(q).reshape(Hkv, G, d) / np.sqrt(d)
        logits = np.einsum("kgd,ksd->kgs", qg, keys)
        logits = np.where(mask[:, None], logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = np.einsum("kgs,ksd->kgd", p, keys).reshape(Hkv * G, d)
        np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


def test_reuse_with_whole_budget_equals_full_attention_and_compiles_once(tiny):
    model, params, tokens = tiny
    want, _ = _run(model, params, tokens, make_policy("full"), 120, 6)
    policy = make_policy("mpcache_exact", 1.0, refresh_every=4, **SMALL_LEVELS)
    got, _ = _run(model, params, tokens, policy, 120, 6, check_one_compile=True)
    assert np.abs(got - want).max() <= 1e-5


def test_reuse_changes_outputs_only_between_refreshes(tiny):
    model, params, tokens = tiny
    every, _ = _run(model, params, tokens, make_policy("mpcache_exact", 24, **SMALL_LEVELS), 120, 6)
    reuse, _ = _run(model, params, tokens,
                    make_policy("mpcache_exact", 24, refresh_every=6, **SMALL_LEVELS), 120, 6)
    assert np.abs(reuse[0] - every[0]).max() <= 1e-5     # step 0 selects in both
    assert np.abs(reuse[1:] - every[1:]).max() > 1e-4     # later steps keep step 0's choice


@pytest.mark.parametrize("value", [0, -2, True, 1.5, "4"])
def test_refresh_every_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="refresh_every"):
        make_policy("mpcache_exact", 0.1, refresh_every=value)


def test_reuse_needs_a_dynamic_selection_and_a_budget_within_the_prompt(tiny):
    with pytest.raises(ValueError, match="refresh_every"):
        make_policy("mpcache_exact", 0.1, static=True, dynamic=False, refresh_every=4)
    model, params, tokens = tiny
    cache = model.init_cache(124)
    _, cache, aux = model.prefill(params, tokens[:120], cache)
    with pytest.raises(ValueError, match="working set larger than the prompt"):
        compress_cache(make_policy("mpcache_exact", 128, refresh_every=4, **SMALL_LEVELS), cache,
                       aux, 4)


def test_default_mpcache_keeps_the_dense_prompt_without_votes(tiny):
    """Without static eviction nothing votes: no prompt queries, and the prompt region of a
    bucketed prompt is the dense cache (no compaction) with the padding marked invalid."""
    model, params, tokens = tiny
    policy = make_policy("mpcache_exact", 0.2, **SMALL_LEVELS)
    assert not policy.needs_queries
    assert make_policy("mpcache_paper", 0.2).needs_queries
    cache = model.init_cache(136)
    _, dense, aux = model.prefill(params, np.append(tokens[:100], [0] * 28), cache,
                                  length=100, min_length=97)
    layers = compress_cache(policy, dense, aux, 8)
    for layer, kv in zip(layers, dense):
        np.testing.assert_array_equal(np.asarray(layer.k[:, :128]), np.asarray(kv.k[:, :128]))
        np.testing.assert_array_equal(np.asarray(layer.valid[0]),
                                      (np.arange(layer.k.shape[1]) < 100).astype(np.float32))
