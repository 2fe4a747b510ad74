"""Per-decode-step selection baselines (LongCache, Quest, InfLLM, ArkVale, PQCache): each
selects what its rule says on hand-made cases, respects the budget, and equals `full` at 100%."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpcache_jax import attention
from mpcache_jax import primitives as P
from mpcache_jax.cache import LayerKV
from mpcache_jax.policies import make_policy
from mpcache_jax.policies.arkvale import ArkVale
from mpcache_jax.policies.infllm import InfLLM, attention_received, representative_mask
from mpcache_jax.policies.longcache import LongCache
from mpcache_jax.policies.pqcache import PQCache, pq_encode, pq_reconstruct
from mpcache_jax.policies.quest import Quest
from mpcache_jax.policy import PrefillAux
from models import registry
from tests.decode_helpers import teacher_forced_logits

NAMES = ("longcache", "quest", "infllm", "arkvale", "arkvale_mad", "pqcache")
# Sizes that leave room for a choice at a 40-token budget on a 120-token prompt.
SMALL = {"longcache": {}, "quest": {"page_size": 4}, "infllm": {"page_size": 8},
         "arkvale": {"page_size": 8}, "arkvale_mad": {"page_size": 8}, "pqcache": {"bits": 3}}


@pytest.fixture(scope="module")
def tiny():
    lm = registry.load("llama-tiny")
    tokens = np.random.RandomState(0).randint(0, lm.model.cfg.vocab_size, size=140)
    return lm.model, lm.params, tokens


@pytest.fixture(scope="module")
def full_logits(tiny):
    return _run(*tiny, make_policy("full"), 120, 4)[0]


_run = teacher_forced_logits


def _hand_state(policy, keys, queries=None, steps=4):
    """Compress a one-layer, one-KV-head cache holding `keys` [T, d] (values = keys)."""
    k = jnp.asarray(keys, jnp.float32)[None]
    T, d = keys.shape
    layer = LayerKV(jnp.pad(k, ((0, 0), (0, steps), (0, 0))), jnp.pad(k, ((0, 0), (0, steps), (0, 0))),
                    jnp.asarray(T, jnp.int32))
    q = None if queries is None else (jnp.asarray(queries, jnp.float32)[None],)
    return policy.compress((layer,), PrefillAux(queries=q, prompt_len=T), steps)[0]


@pytest.mark.parametrize("name", NAMES)
def test_full_budget_equals_full_attention(tiny, full_logits, name):
    got, _ = _run(*tiny, make_policy(name, 1.0), 120, 4)
    assert np.abs(got - full_logits).max() <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_small_budget_selects_within_budget(tiny, full_logits, name):
    model = tiny[0]
    policy = make_policy(name, 40, **SMALL[name])
    got, cache = _run(*tiny, policy, 120, 4)
    assert np.abs(got - full_logits).max() > 1e-4         # a real selection happened
    lay = policy.layout(120)
    attended = lay.initial + lay.local + lay.selected * lay.page_size
    assert not lay.full and attended <= 40
    q = jnp.asarray(np.random.RandomState(1).randn(model.cfg.num_heads, model.cfg.head_dim),
                    jnp.float32)
    mask = np.asarray(policy.select(q, cache[-1], lay))
    np.testing.assert_array_equal(mask.sum(-1), lay.selected)   # per KV head, exactly n pages


def test_quest_page_score_2d():
    # Page 0 keys (1,-2), (3,0): max (3,0), min (1,-2). Page 1 keys (-1,1), (0,2): max (0,2),
    # min (-1,1). q = (1,-1): page 0 -> max(3,1) + max(0,2) = 5; page 1 -> max(0,-1) +
    # max(-2,-1) = -1. q = (-1,1): page 0 -> -1 + 0 = -1; page 1 -> 1 + 2 = 3.
    keys = np.array([[1, -2], [3, 0], [-1, 1], [0, 2]], np.float32)
    policy = Quest(budget=2, page_size=2, dense_layers=0)
    state = _hand_state(policy, keys)
    lay = policy.layout(4)
    assert (lay.num_pages, lay.selected) == (2, 1)
    for q, scores, page in (([1, -1], [5, -1], 0), ([-1, 1], [-1, 3], 1)):
        qg = jnp.asarray([[q]], jnp.float32)                         # [H_kv=1, G=1, d=2]
        np.testing.assert_allclose(policy.page_scores(qg, state.extras, lay), [scores])
        mask = policy.select(jnp.asarray([q], jnp.float32), state, lay)
        assert np.flatnonzero(np.asarray(mask)[0]).tolist() == [page]


def test_longcache_ranks_by_cosine_not_dot_product():
    # q = (1,1). Dot products: 10, 2, 0.3, -4 (top-2 {0,1}); cosines: 0.71, 1, 0.95, -0.55
    # (top-2 {1,2}).
    keys = np.array([[10, 0], [1, 1], [0.2, 0.1], [-5, 1]], np.float32)
    policy = LongCache(budget=2)
    state = _hand_state(policy, keys)
    mask = policy.select(jnp.asarray([[1.0, 1.0]]), state, policy.layout(4))
    assert np.flatnonzero(np.asarray(mask)[0]).tolist() == [1, 2]


def test_infllm_representatives_are_most_attended_in_block():
    # Every query is (1,0), d = 2, so a key (5,0) has logit 5/sqrt(2) (weight E) and a zero key
    # weight 1 in the causal softmax over ALL earlier keys. Block 0 = positions 0-3 with
    # key 2 = (5,0): query 0 gives key 0 weight 1, query 1 gives keys 0,1 1/2 each, queries
    # 2 and 3 give key 2 E/(2+E) and E/(3+E). Block 1 = positions 4-7 with key 5 = (5,0):
    # query 4 gives key 4 only 1/(4+E) (key 2 outside the block takes most), queries 5-7 give
    # key 5 E/(4+2E), E/(5+2E), E/(6+2E). Block 2 has 2 real tokens and 2 padding slots.
    E = np.exp(5 / np.sqrt(2))
    k = np.zeros((1, 12, 2), np.float32)
    k[0, 2] = k[0, 5] = [5, 0]
    q = np.tile(np.array([1, 0], np.float32), (1, 12, 1))
    valid = jnp.asarray([1] * 10 + [0] * 2, jnp.float32)
    received = np.asarray(attention_received(jnp.asarray(q), jnp.asarray(k), 0, 4, valid))[0]
    np.testing.assert_allclose(received[0, 2], E / (2 + E) + E / (3 + E), rtol=1e-5)
    np.testing.assert_allclose(received[0, 0], 1 + 1 / 2 + 1 / (2 + E) + 1 / (3 + E), rtol=1e-5)
    np.testing.assert_allclose(received[1, 0], sum(1 / (n + m * E) for n, m in
                                                   ((4, 1), (4, 2), (5, 2), (6, 2))), rtol=1e-5)
    np.testing.assert_allclose(received[1, 1], E * (1 / (4 + 2 * E) + 1 / (5 + 2 * E)
                                                    + 1 / (6 + 2 * E)), rtol=1e-5)
    reps = np.asarray(representative_mask(jnp.asarray(received[None]), 2, valid))[0]
    assert [np.flatnonzero(block).tolist() for block in reps] == [[0, 2], [0, 1], [0, 1]]


def test_infllm_block_score_uses_representatives():
    # Token 0 is initial; blocks of 4 = tokens 1..4 and 5..8, one representative each. All
    # prompt queries are (1,1); the only non-zero keys, 2 = (5,0) and 7 = (0,5), are their
    # blocks' most attended keys, so the block digests are exactly those keys.
    policy = InfLLM(budget=5, page_size=4, representatives=1, num_initial=1, local_ratio=0.0)
    keys = np.zeros((9, 2), np.float32)
    keys[2], keys[7] = [5, 0], [0, 5]
    state = _hand_state(policy, keys, np.ones((9, 2), np.float32))
    lay = policy.layout(9)
    assert (lay.initial, lay.local, lay.num_pages, lay.selected) == (1, 0, 2, 1)
    np.testing.assert_allclose(state.extras[0], [[5, 0], [0, 5]])
    for q, block in (([[1.0, 0.0]], 0), ([[0.0, 1.0]], 1)):
        mask = policy.select(jnp.asarray(q), state, lay)
        assert np.flatnonzero(np.asarray(mask)[0]).tolist() == [block]


def test_arkvale_mad_box_by_hand():
    # Page keys (0,0), (0,0), (2,0), (6,4): centre (2,1); mean |k - centre| = (2, 1.5)
    # -> box (4, 2.5) / (0, -0.5); the min/max cuboid is (6,4) / (0,0). A padded 5th..8th slot
    # (page 2) holding 100s is ignored.
    k = np.zeros((1, 8, 2), np.float32)
    k[0, 2], k[0, 3] = [2, 0], [6, 4]
    k[0, 4:6] = [1, 3]
    k[0, 6:] = 100.0
    valid = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)
    hi, lo = P.cluster_mad_bounds(jnp.asarray(k), 4, jnp.asarray(valid))
    np.testing.assert_allclose(hi[0], [[4, 2.5], [1, 3]])
    np.testing.assert_allclose(lo[0], [[0, -0.5], [1, 3]])
    policy = ArkVale(budget=4, page_size=4, bound="mad")
    state = _hand_state(policy, k[0, :6], np.ones((6, 2), np.float32))
    np.testing.assert_allclose(state.extras.hi[0], [[4, 2.5], [1, 3]])
    cuboid = _hand_state(ArkVale(budget=4, page_size=4), k[0, :6], np.ones((6, 2), np.float32))
    np.testing.assert_allclose(cuboid.extras.hi[0, 0], [6, 4])
    np.testing.assert_allclose(cuboid.extras.lo[0, 0], [0, 0])


def test_arkvale_evicts_then_recalls_a_page():
    # Three pages of 2 tokens along +x, +y and -x-y; the budget holds one page. The last
    # prompt query (+x) leaves page 0 active. Step 1 (query +x) keeps it; step 2 (+y) evicts
    # it and recalls page 1; step 3 (+x) recalls page 0 again.
    keys = np.array([[3, 0], [2, 0], [0, 3], [0, 2], [-2, -2], [-3, -3]], np.float32)
    queries = np.tile(np.array([1, 0], np.float32), (6, 1))
    policy = ArkVale(budget=2, page_size=2)
    state = _hand_state(policy, keys, queries)
    lay = policy.layout(6)
    assert np.asarray(state.extras.active).tolist() == [[1, 0, 0]]
    step = jax.jit(lambda q, k_new, state: policy.attend(0, q, k_new, k_new, state, None))
    seen = []
    for q in ([1.0, 0.0], [0.0, 1.0], [1.0, 0.0]):
        q = jnp.asarray([q])
        k_new = jnp.zeros((1, 2))
        out, state, _ = step(q, k_new, state)
        seen.append((np.asarray(state.extras.active)[0].tolist(), int(state.extras.recalls[0])))
        # The output is attention over the active page's two tokens plus the new tokens.
        page = int(np.argmax(np.asarray(state.extras.active)[0]))
        k_att = jnp.concatenate([jnp.asarray(keys[2 * page:2 * page + 2]), state.new.k[0]])[None]
        valid = jnp.concatenate([jnp.ones(2), state.new.valid()])
        np.testing.assert_allclose(out, attention.decode_attention(q, k_att, k_att, valid), atol=1e-6)
    assert seen == [([1, 0, 0], 0), ([0, 1, 0], 1), ([1, 0, 0], 2)]
    assert lay.selected == 1


def test_pq_codes_reconstruct_keys_better_than_random_codes():
    rng = np.random.RandomState(0)
    k = jnp.asarray(rng.randn(2, 200, 8), jnp.float32)
    centroids, codes = pq_encode(k, subspaces=2, bits=3, iters=10)
    assert centroids.shape == (2, 2, 8, 4) and codes.shape == (2, 2, 200)
    err = float(jnp.mean((pq_reconstruct(centroids, codes, 8) - k) ** 2))
    random_codes = jnp.asarray(rng.randint(0, 8, size=codes.shape), jnp.int32)
    err_random = float(jnp.mean((pq_reconstruct(centroids, random_codes, 8) - k) ** 2))
    _, codes_1 = pq_encode(k, subspaces=2, bits=3, iters=1)
    assert err < 0.5 * err_random
    # Codes are the nearest centroids: no other code reconstructs a sub-vector better.
    parts = np.asarray(k).reshape(2, 200, 2, 4).transpose(0, 2, 1, 3)
    dist = ((parts[:, :, :, None, :] - np.asarray(centroids)[:, :, None]) ** 2).sum(-1)
    np.testing.assert_array_equal(np.asarray(codes), dist.argmin(-1))
    assert codes_1.shape == codes.shape


def test_kmeans_compiles_once_per_shape():
    x = jnp.asarray(np.random.RandomState(0).randn(3, 40, 4), jnp.float32)
    P.kmeans(x, num_centroids=4, iters=3)
    before = P.kmeans._cache_size()
    for shift in (1.0, 2.0, 3.0):
        P.kmeans(x + shift, num_centroids=4, iters=3)
    assert P.kmeans._cache_size() == before


def test_pqcache_refuses_a_window_that_leaves_nothing_to_select():
    # budget 10: 4 initial tokens, a window of int(0.9 * 10) = 9 >= the 6 selectable slots.
    with pytest.raises(ValueError, match="local window of 9 tokens leaves no top-k token in a "
                                         "budget of 6"):
        make_policy("pqcache", budget=10, local_ratio=0.9)
    make_policy("pqcache", budget=10, local_ratio=0.5)   # a window of 5 leaves one


def test_pqcache_scores_window_and_new_codes():
    rng = np.random.RandomState(0)
    keys = rng.randn(40, 4).astype(np.float32)
    policy = PQCache(budget=12, bits=2, subspaces=2, num_initial=2, local_ratio=0.25)
    state = _hand_state(policy, keys, steps=4)
    lay = policy.layout(40)
    assert (lay.initial, lay.middle, lay.selected, policy.window_tokens(40)) == (2, 38, 10, 3)
    index = state.extras
    # Approximate score of token j = q . (PQ reconstruction of k_j).
    q = jnp.asarray(rng.randn(1, 4), jnp.float32)
    recon = pq_reconstruct(index.centroids, index.codes, 4)[0]
    np.testing.assert_allclose(policy.page_scores(q[None], index, lay)[0], recon @ q[0], rtol=1e-5,
                               atol=1e-5)
    # The local window slides: after g generated tokens the last max(3 - g, 0) prompt
    # tokens are forced; a generated token gets its nearest centroid's code.
    step = jax.jit(lambda q, k_new, state: policy.attend(0, q, k_new, k_new, state, None))
    for g in range(1, 5):
        k_new = jnp.asarray(rng.randn(1, 4), jnp.float32)
        _, state, _ = step(q, k_new, state)
        forced = np.asarray(policy.forced_pages(state, lay))
        assert np.flatnonzero(forced).tolist() == list(range(38 - max(3 - g, 0), 38))
        code = np.asarray(state.extras.new_codes)[0, :, g - 1]
        parts = np.asarray(k_new).reshape(2, 2)
        want = [((np.asarray(index.centroids)[0, m] - parts[m]) ** 2).sum(-1).argmin()
                for m in range(2)]
        assert code.tolist() == want


@pytest.mark.parametrize("make, match", [
    (lambda: InfLLM(budget=100), "less than one page of 128"),
    (lambda: Quest(budget=8), "less than one page of 16"),
    (lambda: LongCache(page_size=4), "page_size must be 1"),
    (lambda: PQCache(budget=10, local_ratio=0.9, num_initial=1), "lower local_ratio"),
    (lambda: ArkVale(bound="sphere"), "use 'cuboid'"),
    (lambda: InfLLM(page_size=8, representatives=9), "representatives"),
])
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_ratio_budget_checked_against_the_prompt(tiny):
    model, params, tokens = tiny
    policy = InfLLM(budget=0.5)                # 60 of 120 tokens: no block of 128 fits
    with pytest.raises(ValueError, match="raise the budget or lower page_size"):
        _run(model, params, tokens, policy, 120, 1)


@pytest.fixture(scope="module")
def spu_sim():
    """runtime.mpc and a three-party ABY3 simulator shared by this module's tests."""
    pytest.importorskip("spu")
    from runtime import mpc
    return mpc, mpc.make_backend("spu_sim", mpc.MPCConfig(protocol="ABY3"), profile=False)


@pytest.mark.parametrize("name", NAMES)
def test_compress_and_decode_step_run_under_spu(spu_sim, name):
    """The same compress + attend code runs on secret inputs in SPU's ABY3 simulator, compiled
    as every secure run is (`runtime.mpc`: traced for MPC, where plaintext-only paths such as
    index gathers and scattered masks give way to one-hot arithmetic), and matches XLA to
    fixed-point precision. PQ scores tie whenever tokens share codes, and SPU's top_k breaks
    ties differently from XLA's, so PQCache uses the deterministic rank top-k."""
    mpc, backend = spu_sim
    rng = np.random.RandomState(0)
    Hkv, H, T, d, steps = 2, 4, 48, 8, 2
    k, v = (rng.randn(Hkv, T + steps, d).astype(np.float32) for _ in range(2))
    prompt_q, q = rng.randn(H, T, d).astype(np.float32), rng.randn(H, d).astype(np.float32)
    k_new = rng.randn(Hkv, d).astype(np.float32)
    options = dict(SMALL[name], kmeans_iters=3, topk_method="rank") if name == "pqcache" \
        else SMALL[name]
    policy = make_policy(name, 16, **options)

    def step(k, v, prompt_q, q, k_new):
        cache = (LayerKV(k, v, jnp.asarray(T, jnp.int32)),)
        state = policy.compress(cache, PrefillAux((prompt_q,), T), steps)[0]
        return policy.attend(0, q, k_new, k_new, state, None)[0]

    args = (k, v, prompt_q, q, k_new)
    want = np.asarray(jax.jit(step)(*args))
    program = backend.compile(step, args, mpc.SECRET)
    out = backend.run(program, *[backend.share(a) for a in args])[0]
    got = np.asarray(backend.reveal(out))
    assert np.abs(got - want).max() < 1e-2
