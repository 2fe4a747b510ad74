"""The default policy (`mpcache`: working_set.py) on hand-made caches: its counts keep to the
budget, its selection is each stripe's best clusters, its attention equals attending to the
gathered tokens, and it selects only on its public schedule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpcache_jax import attention
from mpcache_jax import extent as E
from mpcache_jax import primitives as P
from mpcache_jax.cache import empty_layer, fill_prefix
from mpcache_jax.policies import make_policy, working_set
from mpcache_jax.policies.working_set import geometry_length
from mpcache_jax.policy import PrefillAux


@pytest.mark.parametrize("budget", [0.05, 0.1, 0.2, 0.5, 64, 300, P.Budget(0.1, 384),
                                    P.Budget(0.05, 200)])
def test_counts_keep_to_the_budget_and_share_one_layout_per_power_of_two(budget):
    policy = make_policy("mpcache", budget)
    floor = budget.min_tokens if isinstance(budget, P.Budget) else 0
    # (6145-6175, 6208, 8193, 16448: just past a cluster boundary of a class's short end,
    # where rounding the window's start up would leave it fewer than recent_min tokens)
    for t in list(range(40, 600, 7)) + [1024, 2047, 2048, 3073, 4096, 6145, 6160, 6208, 8192,
                                        8193, 16448]:
        B = max(P.budget_tokens(P.budget_ratio(budget), t), min(floor, t))
        assert policy.budget_at(t) == B
        try:
            m, start = policy.plan(t)
        except ValueError as err:                      # only when the sink alone is too much
            assert "sink cluster" in str(err) and B < policy.cluster_of(geometry_length(t))
            continue
        L = geometry_length(t)
        c, S = policy.cluster_of(L), policy.stripes_of(L)
        sink = policy.sink_of(t)
        assert min(c, t) >= sink >= min(4, t) and sink <= start <= t
        attended = sink + S * m * c + (t - start)
        assert attended <= B or B >= t and attended == t, (t, B, m, start)
        if m:    # whole middle clusters before a cluster-aligned window; m in every stripe
            assert start % c == 0 and start <= t // c * c and (start // c - 1) // S >= m
            # the window from a boundary: short of recent_min by less than a cluster, where
            # the sink cluster had not the tokens to start it a cluster earlier
            assert t - start > policy.recent_min - c, (t, B, m, start)
        extent = E.Extent(t, t)
        geo = policy.geometry(extent)
        assert geo.picks >= max(m, 1) and geo.recent >= t - start
    default = make_policy("mpcache", "0.1min384")
    for t in (6145, 6160, 6208, 8193, 16448):   # (the window's start rounded up: 0-31 tokens)
        m, start = default.plan(t)
        assert m == 1 and t - start >= 32 and 4 <= default.sink_of(t) < 64, (t, start)
    assert make_policy("mpcache", 0.1).plan(2048)[0] >= 1     # the default selects at 2k
    assert make_policy("mpcache", 0.1).plan(1025)[0] >= 1     # and at the bucket's smallest


def test_clusters_stop_growing_at_64_tokens_and_the_stripes_grow_instead():
    """Up to 8192 tokens the clusters grow with the prompt (128 candidates); from there they
    stay at 64 tokens, 32 above 16384 (LONG_CLASS): the candidates and the stripes grow as
    T / c, each stripe still ranks about as many candidates, and a refresh's comparisons
    (S n_b^2) grow as T / c."""
    policy = make_policy("mpcache", "0.1min384")
    clusters = {L: policy.cluster_of(L) for L in (2048, 4096, 8192, 16384, 24576, 32768, 65536)}
    assert clusters == {2048: 16, 4096: 32, 8192: 64, 16384: 64, 24576: 32, 32768: 32,
                        65536: 32}
    rows = {t: policy.ranked_rows(t, 1) for t in (8192, 16384, 24577, 32744)}
    for t in (16384, 24577, 32744):
        c = policy.cluster_of(geometry_length(t))
        stripes, per_stripe = rows[t]
        assert policy.geometry(E.Extent(t, t)).clusters == -(-t // c)
        assert stripes >= rows[8192][0] * t // 8192 * 3 // 4 * 64 // c   # stripes grow ~ T / c
        assert per_stripe <= rows[8192][1]                              # rankings do not
        assert stripes * per_stripe ** 2 <= 2 * rows[8192][0] * rows[8192][1] ** 2 * t // 8192 * 64 // c
        m, start = policy.plan(t)
        assert m == 1 and start % c == 0
    # the working set holds as many tokens with 32-token clusters as 64-token ones would
    wide = make_policy("mpcache", "0.1min384", cluster_size=64)
    for t in (24577, 32744):
        assert (policy.geometry(E.Extent(t, t)).working
                >= wide.geometry(E.Extent(t, t)).working)
    assert make_policy("mpcache", 0.1, cluster_size=128).cluster_of(16384) == 128   # explicit
    assert make_policy("mpcache", 0.1, cluster_size=64).cluster_of(32768) == 64


def test_a_budget_floor_widens_short_prompts_only():
    """Budget(0.1, 384): a 2048-token prompt attends 384 tokens instead of 205, in the same
    stripes with more clusters each; a prompt whose ratio gives at least the floor keeps its
    plan."""
    plain, floored = make_policy("mpcache", 0.1), make_policy("mpcache", "0.1min384")
    assert floored.budget == P.Budget(0.1, 384)
    assert (plain.budget_at(2048), floored.budget_at(2048)) == (205, 384)
    assert floored.stripes_of(2048) == plain.stripes_of(2048)
    assert floored.plan(2048)[0] > plain.plan(2048)[0] >= 1
    assert floored.budget_at(200) == 200                     # never more than the prompt
    for t in (4096, 8192):
        assert floored.budget_at(t) == plain.budget_at(t)
        assert floored.plan(t) == plain.plan(t)
    with pytest.raises(ValueError, match="min_tokens=-1 must be an integer >= 1"):
        make_policy("mpcache", P.Budget(0.1, -1))


def _layer(policy, T, max_new, seed=0, Hkv=2, d=8, scale=None):
    rng = np.random.RandomState(seed)
    k = rng.randn(Hkv, T, d).astype(np.float32)
    if scale is not None:                                 # [T]: each token's key norm scaled
        k = k * scale[None, :, None]
    v = rng.randn(Hkv, T, d).astype(np.float32)
    dense = fill_prefix(empty_layer(Hkv, T + max_new, d), jnp.asarray(k), jnp.asarray(v))
    state = policy.compress((dense,), PrefillAux(None, T), max_new)[0]
    return state, k, v


def _picked_clusters(policy, q, state, T):
    """The prompt clusters each selecting row picks for query q: [set of cluster indices]."""
    geo = policy.geometry(E.Extent(T, T))
    m, start = policy.plan(T)
    _, picked = policy.select(jnp.asarray(q), state, geo, m, start)
    return [set((np.asarray(row) + 1).tolist()) for row in np.asarray(picked)]


def _reference_clusters(policy, q, k, T):
    """The clusters a selection picks, by brute force: token scores max / sum as configured,
    cluster maxima, middle clusters dealt round robin into stripes, each stripe's best m."""
    L = geometry_length(T)
    c, S = policy.cluster_of(L), policy.stripes_of(L)
    m, start = policy.plan(T)
    Hkv, _, d = k.shape
    G = q.shape[0] // Hkv
    qg = q.reshape(Hkv, G, d) / np.sqrt(d)
    if policy.token_score == "cosine":
        qg = qg / np.linalg.norm(qg, axis=-1, keepdims=True)
    scores = np.einsum("hgd,htd->hgt", qg, k)                      # [H_kv, G, T]
    if policy.token_score in ("cosine", "key_cosine"):
        scores = scores / np.linalg.norm(k, axis=-1)[:, None]
    mass = policy.resolved_cluster_score(PrefillAux(None, T)) == "mass"
    if mass:     # each head's weights relative to its sink-slot score, halved, summed
        scores = np.exp((scores - scores[..., :1]) * 0.5)
    token = scores.max(1) if policy.group_reduce == "max" and not mass else scores.sum(1)
    if policy.scope_for(Hkv) == "layer":
        token = token.sum(0, keepdims=True)
    chosen = []
    for row in token:
        reduce = np.sum if mass else np.max
        clusters = [reduce(row[i * c:(i + 1) * c]) for i in range(1, start // c)]
        picked = set()
        for s in range(S):
            members = list(range(s, len(clusters), S))
            best = sorted(members, key=lambda j: (-clusters[j], j))[:m]
            picked |= {j + 1 for j in best}
        chosen.append(picked)
    return chosen


@pytest.mark.parametrize("scope", ["layer", "head"])
def test_selection_is_each_stripes_best_clusters(scope):
    """For each token score (q . k, the cosine, q . k / |k|) and scope, the clusters of the
    brute-force reference; the three scores pick differently on these keys (whose norms vary
    from token to token), so each is checked for what it is."""
    T = 90
    rng = np.random.RandomState(5)
    queries = [rng.randn(4, 8).astype(np.float32) for _ in range(5)]
    scale = np.exp(rng.randn(T)).astype(np.float32)            # keys of unequal norms
    picks = {}
    for score in ("dot", "cosine", "key_cosine"):
        policy = make_policy("mpcache", 48, cluster_size=4, stripes=3, recent_min=4,
                             select_scope=scope, refresh_every=1, token_score=score)
        state, k, v = _layer(policy, T, 4, scale=scale)
        assert policy.plan(T)[0] >= 2 and (state.inv_norms is None) == (score == "dot")
        picks[score] = []
        for q in queries:
            got = _picked_clusters(policy, q, state, T)
            assert got == _reference_clusters(policy, q, k, T), score
            picks[score].append(got)
    assert picks["dot"] != picks["cosine"] != picks["key_cosine"] != picks["dot"]


@pytest.mark.parametrize("scope", ["layer", "head"])
def test_mass_selection_is_each_stripes_heaviest_clusters(scope):
    """cluster_score="mass": the clusters of the brute-force reference (exp of half of each
    score less the sink slot's, summed over the group's heads and the cluster). It picks
    otherwise than the best token does on these keys."""
    T = 90
    rng = np.random.RandomState(6)
    queries = [(rng.randn(4, 8) * 6).astype(np.float32) for _ in range(5)]
    scale = np.exp(rng.randn(T)).astype(np.float32)
    chosen = {}
    for score in ("mass", "max"):
        policy = make_policy("mpcache", 48, cluster_size=4, stripes=3, recent_min=4,
                             select_scope=scope, refresh_every=1, cluster_score=score,
                             token_score="dot")
        state, k, v = _layer(policy, T, 4, scale=scale)
        chosen[score] = []
        for q in queries:
            got = _picked_clusters(policy, q, state, T)
            assert got == _reference_clusters(policy, q, k, T), score
            chosen[score].append(got)
    assert chosen["mass"] != chosen["max"]


@pytest.mark.parametrize("budget, cluster, recent_min, T, sink, window",
                         [(40, 4, 4, 70, 4, 2),        # (a sink of 4 has no token to give)
                          # rounding the window's start up to a boundary would leave it no
                          # token: it starts a cluster earlier, the sink gives up 2 tokens
                          (30, 8, 6, 64, 6, 8)])
def test_attention_equals_attending_to_the_gathered_tokens(budget, cluster, recent_min, T,
                                                           sink, window):
    """Per KV head (select_scope="auto" with 2 KV heads): the sink, the head's selected
    clusters, the recent window and the generated tokens, nothing else."""
    policy = make_policy("mpcache", budget, cluster_size=cluster, stripes=2,
                         recent_min=recent_min, refresh_every=1)
    new = 3
    state, k, v = _layer(policy, T, new + 1)
    m, start = policy.plan(T)
    assert m >= 1 and policy.scope_for(2) == "head"
    assert (policy.sink_of(T), T - start) == (sink, window)
    assert sink + 2 * cluster * m + T - start <= budget
    rng = np.random.RandomState(2)
    for step in range(new):
        q = rng.randn(4, k.shape[-1]).astype(np.float32)
        k_new, v_new = rng.randn(2, 2, k.shape[-1]).astype(np.float32)
        want = []
        for head, clusters in enumerate(_reference_clusters(policy, q, k, T)):
            slots = sorted({s for c in clusters for s in range(cluster * c, cluster * (c + 1))}
                           | set(range(sink)) | set(range(start, T)))
            assert len(slots) <= budget
            keys = np.concatenate([k[head, slots], np.asarray(state.new.k[head, :step]),
                                   k_new[head, None]])
            vals = np.concatenate([v[head, slots], np.asarray(state.new.v[head, :step]),
                                   v_new[head, None]])
            want.append(attention.decode_attention(
                jnp.asarray(q[2 * head:2 * head + 2]), jnp.asarray(keys[None]),
                jnp.asarray(vals[None]), jnp.ones(keys.shape[0])))
        out, state, _ = policy.attend(0, jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new),
                                      state, None)
        np.testing.assert_allclose(np.asarray(out), np.concatenate(want), atol=1e-5)


@pytest.mark.parametrize("dense_steps", [0, 4])
def test_between_refreshes_the_working_set_stays(dense_steps):
    """refresh_every=3: steps 0, 3, 6 select (whatever the query), the others keep the last
    working set even when their query would choose differently; with dense_steps=4 the
    steps 0-3 all select, then 6 and 9."""
    policy = make_policy("mpcache", 40, cluster_size=4, stripes=2, recent_min=4,
                         refresh_every=3, dense_steps=dense_steps)
    state, k, v = _layer(policy, 70, 8)
    rng = np.random.RandomState(3)
    picks, working = [], []
    for step in range(10):
        q = rng.randn(4, k.shape[-1]).astype(np.float32) * 3
        _, state, _ = policy.attend(0, jnp.asarray(q), jnp.zeros((2, 8)), jnp.zeros((2, 8)),
                                    state, None)
        picks.append(np.asarray(state.picked))
        working.append(np.asarray(state.working_k))
    for step in range(1, 10):
        same = np.array_equal(working[step], working[step - 1])
        assert same == (step % 3 != 0 and step >= dense_steps), step
    assert not all(np.array_equal(picks[0], p) for p in picks[3::3])


@pytest.mark.parametrize("traced_layer", [False, True])
def test_staggered_layers_take_turns(traced_layer):
    """stagger_layers with refresh_every=3: every layer selects at step 0, then layer l at
    the steps where step + l is a multiple of 3 (a traced layer index, as inside the model's
    layer loop, the same)."""
    policy = make_policy("mpcache", 40, cluster_size=4, stripes=2, recent_min=4,
                         refresh_every=3, stagger_layers=True, dense_steps=0)
    attend = jax.jit(policy.attend) if traced_layer else policy.attend
    rng = np.random.RandomState(5)
    for layer in range(3):
        state, k, v = _layer(policy, 70, 8, seed=layer)
        working = []
        for step in range(7):
            q = rng.randn(4, k.shape[-1]).astype(np.float32) * 3
            index = jnp.int32(layer) if traced_layer else layer
            _, state, _ = attend(index, jnp.asarray(q), jnp.zeros((2, 8)), jnp.zeros((2, 8)),
                                 state, None)
            working.append(np.asarray(state.working_k))
        assert np.any(working[0] != 0), layer                 # step 0 selected in every layer
        for step in range(1, 7):
            same = np.array_equal(working[step], working[step - 1])
            assert same == ((step + layer) % 3 != 0), (layer, step)
    with pytest.raises(ValueError, match="stagger_layers=1 must be True or False"):
        make_policy("mpcache", 0.1, stagger_layers=1)


@pytest.mark.parametrize("refresh_every", [1, 2])
def test_shared_layers_gather_their_own_keys_at_the_selecting_layers_picks(refresh_every):
    """share_layers=2: layers 0 and 2 select for their own queries; layers 1 and 3 take the
    picks of the layer before (per KV head) whatever their query, and gather their own keys
    and values there; between refreshes every layer keeps its working set."""
    policy = make_policy("mpcache", 40, cluster_size=4, stripes=2, recent_min=4,
                         refresh_every=refresh_every, dense_steps=0, share_layers=2)
    alone = make_policy("mpcache", 40, cluster_size=4, stripes=2, recent_min=4,
                        refresh_every=refresh_every, dense_steps=0)
    rng = np.random.RandomState(11)
    layers = [_layer(policy, 70, 8, seed=layer) for layer in range(4)]
    states = [s for s, _, _ in layers]
    differed = False             # a shared layer's own query would have chosen otherwise
    for step in range(4):
        carry = None
        before = [np.asarray(s.working_k) for s in states]
        for layer in range(4):
            q = jnp.asarray(rng.randn(4, 8).astype(np.float32) * 3)
            own = _picked_clusters(alone, q, states[layer], 70)
            _, states[layer], carry = policy.attend(layer, q, jnp.zeros((2, 8)),
                                                    jnp.zeros((2, 8)), states[layer], carry)
            picked = [set((row + 1).tolist()) for row in np.asarray(states[layer].picked)]
            if step % refresh_every:
                np.testing.assert_array_equal(np.asarray(states[layer].working_k),
                                              before[layer])
                continue
            if layer % 2 == 0:
                assert picked == own, (step, layer)
            else:
                leader = [set((row + 1).tolist()) for row in np.asarray(states[layer - 1].picked)]
                assert picked == leader, (step, layer)
                differed |= picked != own
                k = layers[layer][1]                  # this layer's own keys at those clusters
                want = np.stack([np.concatenate([k[h, 4 * c:4 * c + 4] for c in
                                                 np.asarray(states[layer].picked)[h] + 1])
                                 for h in range(2)])
                np.testing.assert_allclose(np.asarray(states[layer].working_k), want)
    assert differed


def test_bad_settings_and_buckets_are_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="refresh_every=0 must be an integer >= 1"):
        make_policy("mpcache", 0.1, refresh_every=0)
    with pytest.raises(ValueError, match="dense_steps=-1 must be an integer >= 0"):
        make_policy("mpcache", 0.1, dense_steps=-1)
    with pytest.raises(ValueError, match="share_layers=0 must be an integer >= 1"):
        make_policy("mpcache", 0.1, share_layers=0)
    with pytest.raises(ValueError, match="stagger_layers=True gives each layer its own"):
        make_policy("mpcache", 0.1, share_layers=2, stagger_layers=True)
    with pytest.raises(ValueError, match="cluster_score='best'"):
        make_policy("mpcache", 0.1, cluster_score="best")
    with pytest.raises(ValueError, match="cluster_size=1 must be a power of two >= 2"):
        make_policy("mpcache", 0.1, cluster_size=1)
    with pytest.raises(ValueError, match="cluster_size=24 must be a power of two"):
        make_policy("mpcache", 0.1, cluster_size=24)
    with pytest.raises(ValueError, match="token_score='cosine' scores single tokens"):
        make_policy("mpcache", 0.1, token_score="cosine", cluster_score="mean")
    with pytest.raises(ValueError, match="token_score='key_cosine' scores single tokens"):
        make_policy("mpcache", 0.1, token_score="key_cosine", cluster_score="mean")
    for fanin in (1, 3, 12, True, 4.0):
        with pytest.raises(ValueError, match=f"tournament_fanin={fanin!r} must be a power of two"):
            make_policy("mpcache", 0.1, tournament_fanin=fanin)
    with pytest.raises(ValueError, match="cannot hold the sink cluster of 16"):
        make_policy("mpcache", 10).check_prompt(2048)
    with pytest.raises(ValueError, match=r"the bucket \[100, 300\] spans 128 and 384; use "
                                         r"bucket edges at such lengths \(e.g. 1024, 1536"):
        make_policy("mpcache", 0.1).check_bucketed(150, 100, 300)
    with pytest.raises(ValueError, match=r"the bucket \[1025, 2048\] spans 1536 and 2048"):
        make_policy("mpcache", 0.1).check_bucketed(1100, 1025, 2048)
    make_policy("mpcache", 0.1).check_bucketed(1100, 1025, 1536)
    make_policy("mpcache", 0.1).check_bucketed(1600, 1537, 2048)


def test_hand_set_stripes_the_budget_cannot_fill_are_refused_where_fitted_ones_select():
    """stripes=24 of 64-token clusters need 1536 tokens: a 10% budget of a 12700-token prompt
    (1270) holds none per stripe, so the policy would select nothing; it says so, naming the
    stripes the budget holds. Where the budget holds them (16384 tokens), or where no stripes
    would select either (a budget at the prompt's length), the prompt is served."""
    budget = P.parse_budget("0.1min384")
    wide = make_policy("mpcache", budget, stripes=24)
    assert wide.plan(12700)[0] == 0 and make_policy("mpcache", budget).plan(12700)[0] == 1
    with pytest.raises(ValueError, match=r"stripes=24 need 1536 tokens for one 64-token cluster "
                                         r"each.*a budget of 1270 tokens for a 12700-token "
                                         r"prompt.*\(stripes=0: as many as the budget holds, "
                                         r"17 here\)"):
        wide.check_prompt(12700)
    wide.check_prompt(16384)
    assert wide.plan(16384)[0] == 1
    make_policy("mpcache", 384, stripes=24).check_prompt(300)   # the budget holds it all
    tight = make_policy("mpcache", 40, cluster_size=4, stripes=2, recent_min=4)
    tight.check_prompt(200)
    assert tight.plan(200)[0] >= 1


@pytest.mark.parametrize("T,cluster,ties,fanin", [
    (1200, 32, False, 16), (2400, 64, False, 16), (2400, 64, True, 16), (1500, 16, False, 16),
    (1500, 16, False, 4), (1200, 32, False, 4), (2400, 64, True, 2)])
def test_secure_selection_ranks_partial_maxima_and_picks_the_same_clusters(T, cluster, ties,
                                                                           fanin):
    """Under MPC with one pick per stripe, the stripe's top-1 ranks the cluster-max
    tournament's partial maxima (its last stage's r runs per cluster: at fan-in 16, 2 for
    clusters of 32, 4 for 64) instead of running that stage: the same clusters as the
    plaintext reduction, including ties (lower cluster first), at every fan-in. Clusters of 16
    at fan-in 16 (one stage) rank whole maxima."""
    wide = make_policy("mpcache", 0.1, cluster_size=cluster)
    m, _ = wide.plan(T)                       # as many stripes as clusters picked: one each
    policy = make_policy("mpcache", 0.1, cluster_size=cluster, tournament_fanin=fanin,
                         stripes=m * wide.stripes_of(geometry_length(T)))
    state, k, _ = _layer(policy, T, 4, seed=3, Hkv=4, d=8)
    geo = policy.geometry(E.Extent(T, T))
    m, start = policy.plan(T)
    assert geo.picks == 1 and m == 1
    with P.secure_trace():
        runs = policy.fused_runs(geo, 4)
    want = {16: {16: 1, 32: 2, 64: 4}, 4: {16: 4, 32: 2, 64: 4}, 2: {64: 2}}[fanin][cluster]
    assert runs == want
    assert policy.fused_runs(geo, 4) == 1                    # plaintext: the plain reduction
    rng = np.random.RandomState(5)
    for trial in range(6):
        q = rng.randn(4 * 2, 8).astype(np.float32)
        if ties:   # every key the same but for a few: many clusters share their maximum
            keys = np.asarray(state.k)
            flat = np.where(rng.rand(*keys.shape) < 0.97, 1.0, keys).astype(np.float32)
            state = state.replace(k=jnp.asarray(flat))
        plain = policy.select(jnp.asarray(q), state, geo, m, start)
        with P.secure_trace():
            secure = jax.jit(lambda q, s: policy.select(q, s, geo, m, start))(jnp.asarray(q),
                                                                              state)
        np.testing.assert_array_equal(np.asarray(secure[0]), np.asarray(plain[0]))
        np.testing.assert_array_equal(np.asarray(secure[1]), np.asarray(plain[1]))
        assert np.asarray(plain[0]).sum() == geo.stripes * np.asarray(plain[0]).shape[0]


def test_tournament_fanin_follows_the_rows_that_select():
    """fan-in 0: wide stages where a layer selects once (shared by its heads, or one KV head),
    narrow ones per KV head of several; a set fan-in is kept."""
    policy = make_policy("mpcache", 0.1)
    assert [policy.fanin_for(h) for h in (1, 3, 4, 32)] == [16, 4, 4, 16]
    assert make_policy("mpcache", 0.1, select_scope="layer").fanin_for(3) == 16
    assert make_policy("mpcache", 0.1, tournament_fanin=8).fanin_for(3) == 8


@pytest.mark.parametrize("scope", ["layer", "head"])
@pytest.mark.parametrize("spread", ["loop", "pairs", "all"])
def test_secure_gather_moves_the_picked_clusters_exactly(scope, spread, monkeypatch):
    """Under MPC the working set is gathered by integer one-hot products: one per stripe (and
    KV head), one block-diagonal product per group of them, or one of them all (as the work
    per saved round allows: GATHER_SPREAD_MAX_LOOP_MACS); each gives the plaintext gather's
    keys and values, bit for bit."""
    policy = make_policy("mpcache", 48, cluster_size=4, stripes=3, recent_min=4,
                         select_scope=scope, refresh_every=1)
    T = 90
    state, k, v = _layer(policy, T, 4, seed=7, Hkv=3)
    geo = policy.geometry(E.Extent(T, T))
    gathers = geo.stripes * (1 if scope == "layer" else 3)
    work = geo.picks * geo.per_stripe * state.striped.shape[-1]
    limit = {"loop": 0, "pairs": 2 * work, "all": 1 << 40}[spread]
    monkeypatch.setattr(working_set, "GATHER_SPREAD_MAX_LOOP_MACS", limit)
    group = policy.gather_group(gathers, geo.picks * geo.per_stripe, state.striped.shape[-1])
    assert group == {"loop": 1, "pairs": 2, "all": gathers}[spread]
    m, start = policy.plan(T)
    q = jnp.asarray(np.random.RandomState(1).randn(6, 8).astype(np.float32))
    onehot, _ = policy.select(q, state, geo, m, start)
    plain = policy.gather(onehot, state, geo)
    with P.secure_trace():
        secure = jax.jit(lambda o, s: policy.gather(o, s, geo))(onehot, state)
        dots = [e for e in jax.make_jaxpr(lambda o, s: policy.gather(o, s, geo))(
            onehot, state).jaxpr.eqns if e.primitive.name == "dot_general"]
    for got, want in zip(secure, plain):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.abs(np.asarray(plain[0])).sum() > 0
    # products (a round each): 2-D for a whole spread, batched over the groups otherwise
    products = sum(dot.invars[0].aval.shape[0] if dot.params["dimension_numbers"][1][0] else 1
                   for dot in dots)
    assert products == -(-gathers // group)


def test_gather_groups_follow_the_work_per_round_saved_and_keep_wide_gathers_apart():
    """gather_group: all the gathers in one product while g x one gather's work fits
    GATHER_SPREAD_MAX_LOOP_MACS (SmolLM2 per head at 4096 tokens, Gemma at 8192), groups of as
    many as fit where not (Gemma's 17 stripes at 16384: 8 per product), and one product per
    gather for gathers wider than GATHER_GROUP_MAX_MACS (llama2-d1024's per-layer rows)."""
    group = working_set.WorkingSetMPCache.gather_group
    assert group(21, 19, 32 * 2 * 64) == 21                  # SmolLM2, 4096: 78k each
    assert group(8, 16, 64 * 2 * 256) == 8                   # Gemma, 8192: 524k each
    assert group(17, 15, 64 * 2 * 256) == 8                  # Gemma, 16384: 3 products
    assert group(7, 19, 32 * 2 * 32 * 32) == 1               # llama2-d1024, 4096: 1.2M each
    assert group(8, 16, 64 * 2 * 32 * 32) == 1               # llama2-d1024, 8192: 2.1M each
    assert group(3, 10, 10) == 3 and group(1, 10, 10) == 1


def _picks_for_queries(dense, aux, T, queries, **options):
    """(layer state, each query's picks) of a policy compressed from one dense layer."""
    policy = make_policy("mpcache", 48, cluster_size=4, stripes=3, recent_min=4, **options)
    state = policy.compress((dense,), aux, 4)[0]
    geo = policy.geometry(E.Extent(T, T))
    m, start = policy.plan(T)
    return state, [np.asarray(policy.select(q, state, geo, m, start)[1]).tolist()
                   for q in queries]


@pytest.mark.parametrize("normalized_keys", [False, True])
def test_auto_token_score_divides_by_the_keys_norms_on_models_with_normalized_keys(
        normalized_keys):
    """token_score="auto" decides at prefill: with QK-norm (PrefillAux.normalized_keys) the
    layers carry the keys' inverse norms and the selection picks as "key_cosine" does (no
    query norms per step); otherwise as "dot"."""
    T = 90
    rng = np.random.RandomState(11)
    scale = np.exp(rng.randn(T)).astype(np.float32)
    k = (rng.randn(2, T, 8) * scale[None, :, None]).astype(np.float32)
    dense = fill_prefix(empty_layer(2, T + 4, 8), jnp.asarray(k), jnp.asarray(k))
    aux = PrefillAux(None, T, normalized_keys=normalized_keys)
    queries = [jnp.asarray(rng.randn(4, 8).astype(np.float32) * rng.uniform(0.2, 5, (4, 1)))
               for _ in range(4)]

    def picks(score):
        return _picks_for_queries(dense, aux, T, queries, token_score=score,
                                  cluster_score="max")
    state, auto = picks("auto")
    assert (state.inv_norms is not None) == normalized_keys
    want = {s: picks(s)[1] for s in ("dot", "cosine", "key_cosine")}
    assert want["dot"] != want["key_cosine"] != want["cosine"]
    assert auto == want["key_cosine" if normalized_keys else "dot"]


def test_auto_cluster_score_takes_the_maxima_past_the_mass_length_class():
    """On QK-norm models "auto" is the mass for prompts up to AUTO_MASS_MAX_LENGTH's class
    and the maxima from the next class up (a bucket by its class); without QK-norm always the
    maxima; a set cluster_score is kept at every length."""
    policy = make_policy("mpcache", 0.1)
    mass_max = working_set.AUTO_MASS_MAX_LENGTH

    def resolved(T, normalized=True, low=None, pol=policy):
        length = None if low is None else jnp.int32(T)
        return pol.resolved_cluster_score(PrefillAux(None, T, length, low or 1,
                                                     normalized_keys=normalized))
    assert [resolved(T) for T in (2048, mass_max - 1, mass_max)] == ["mass"] * 3
    assert [resolved(T) for T in (mass_max + 1, 12288, 16384, 32768)] == ["max"] * 4
    assert resolved(12288, low=mass_max + 1) == "max"
    assert resolved(mass_max, low=mass_max * 3 // 4 + 1) == "mass"
    assert [resolved(T, False) for T in (2048, 16384)] == ["max", "max"]
    mass = make_policy("mpcache", 0.1, cluster_score="mass")
    assert resolved(16384, pol=mass) == "mass"
    state = policy.compress((fill_prefix(empty_layer(1, 16400, 4), jnp.ones((1, 16384, 4)),
                                         jnp.ones((1, 16384, 4))),),
                            PrefillAux(None, 16384, normalized_keys=True), 4)[0]
    assert state.score == "max" and state.inv_norms is not None      # key_cosine, as "max"


@pytest.mark.parametrize("normalized_keys", [False, True])
def test_auto_cluster_score_is_the_mass_on_models_with_normalized_keys(normalized_keys):
    """cluster_score="auto" (the default) decides at prefill: with QK-norm the layers score
    clusters by their mass (token score q . k, no key norms) and pick as cluster_score="mass"
    does; otherwise by their best token, as "max"."""
    T = 90
    rng = np.random.RandomState(12)
    k = (rng.randn(2, T, 8) * np.exp(rng.randn(T))[None, :, None]).astype(np.float32)
    dense = fill_prefix(empty_layer(2, T + 4, 8), jnp.asarray(k), jnp.asarray(k))
    aux = PrefillAux(None, T, normalized_keys=normalized_keys)
    queries = [jnp.asarray(rng.randn(4, 8).astype(np.float32) * 6) for _ in range(4)]

    def picks(cluster_score):
        return _picks_for_queries(dense, aux, T, queries, cluster_score=cluster_score)
    state, auto = picks("auto")
    assert make_policy("mpcache", 0.1).cluster_score == "auto"
    assert state.score == ("mass" if normalized_keys else "max")
    assert state.inv_norms is None                   # the mass and the maxima here: q . k
    want = {score: picks(score)[1] for score in ("max", "mass")}
    assert want["max"] != want["mass"]
    assert auto == want["mass" if normalized_keys else "max"]
