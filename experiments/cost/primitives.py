"""Benchmarks of the building blocks every policy uses: gathers (Table 2, one-hot data types,
repeatability of the summed bytes), top-k (Appendix B.5), single matmuls, one RMSNorm scale, and
round-cutting alternatives for the softmax max and q . K (measured, not shipped)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.cost.harness import CostConfig, Harness, benchmark, median_run
from models import registry
from mpcache_jax import primitives as P
from runtime import mpc

# ----- gathers (Table 2, one-hot data types, repeatability) ------------------------------------------
def _gather_inputs(cfg: CostConfig):
    """Table 2's inputs: a [T, d] key cache, 25% of the tokens and of the clusters."""
    T, C, d = cfg.gather_tokens, cfg.gather_clusters, cfg.gather_dim
    rng = np.random.RandomState(cfg.seed)
    keys = rng.randn(T, d).astype(np.float32)
    tokens = np.sort(rng.choice(T, T // 4, replace=False)).astype(np.int32)
    clusters = np.sort(rng.choice(C, C // 4, replace=False)).astype(np.int32)
    return keys, tokens, clusters


@benchmark("gather")
def bench_gather(cfg: CostConfig, harness: Harness):
    T, C, d = cfg.gather_tokens, cfg.gather_clusters, cfg.gather_dim
    s = T // C
    keys, idx1, idx2 = _gather_inputs(cfg)

    def token_level(idx, K):
        return P.gather_rows(P.indices_onehot(idx, T, jnp.int32), K)

    def cluster_level(idx, K):
        return P.gather_clusters(P.indices_onehot(idx, C, jnp.int32), K, s)

    for protocol, mpc_cfg, backend in harness.backends():
        K = backend.share(keys, mpc.SECRET, owner=mpc.CLIENT)
        row = {}
        for name, fn, idx in (("token_level", token_level, idx1),
                              ("cluster_level", cluster_level, idx2)):
            prog = backend.compile(fn, (idx, keys), (mpc.SECRET, mpc.SECRET))
            _, cost, wall = backend.run(prog, backend.share(idx, mpc.SECRET), K)
            row[name] = harness.record("gather", protocol, mpc_cfg, cost, wall, policy=name,
                                       seq_len=T, model=f"K[{T}x{d}]", extra={
                                           "clusters": C, "selected": len(idx), "cluster_size": s})
        tok, clu = row["token_level"], row["cluster_level"]
        if clu["comm_bytes"]:
            print(f"  {protocol}: token/cluster comm {tok['comm_bytes'] / clu['comm_bytes']:.1f}x, "
                  f"LAN network time {tok['lan_latency_s'] / clu['lan_latency_s']:.1f}x, LAN "
                  f"total {tok['lan_total_s'] / clu['lan_total_s']:.1f}x "
                  "(paper: 369.8x comm, 73.5x latency)")


# MPCache's cluster gather at T = 2048 with a 25% static keep: 12 of 32 clusters of 16 tokens
# x 32 dims, for 32 heads.
GATHER_DTYPE_SHAPE = {"heads": 32, "selected": 12, "clusters": 32, "row": 16 * 32}
_BATCHED = (((2,), (1,)), ((0,), (0,)))


@benchmark("gather_dtype")
def bench_gather_dtype(cfg: CostConfig, harness: Harness):
    """A fixed-point x fixed-point matmul truncates every output; an integer one-hot (from the
    comparison that builds it) needs no truncation. Casting a fixed-point one-hot to int is
    itself a truncation, so the integer one-hot has to come from the comparison."""
    H, k, C, D = (GATHER_DTYPE_SHAPE[n] for n in ("heads", "selected", "clusters", "row"))
    rng = np.random.RandomState(cfg.seed)
    onehot = np.zeros((H, k, C), np.float32)
    for h in range(H):
        onehot[h, np.arange(k), rng.choice(C, k, replace=False)] = 1.0
    x = rng.randn(H, C, D).astype(np.float32)
    want = np.einsum("hkc,hcd->hkd", onehot, x)
    variants = {
        "fixed_point_onehot": lambda o, v: jnp.einsum("hkc,hcd->hkd", o, v),
        "cast_fixed_point_to_int": lambda o, v: jax.lax.dot_general(
            o.astype(jnp.int32), v, _BATCHED, preferred_element_type=jnp.float32),
        "int_onehot_from_comparison": lambda o, v: jax.lax.dot_general(
            (o > 0.5).astype(jnp.int32), v, _BATCHED, preferred_element_type=jnp.float32),
        "gather_rows": lambda o, v: P.gather_rows(o, v),    # what the policies use
    }
    for protocol, mpc_cfg, backend in harness.backends():
        base = None
        for name, fn in variants.items():
            program = backend.compile(fn, (onehot, x), mpc.SECRET)
            out, cost, wall = backend.run(program, *backend.share((onehot, x), mpc.SECRET))
            err = float(np.abs(np.asarray(backend.reveal(out)) - want).max())
            rec = harness.record("gather_dtype", protocol, mpc_cfg, cost, wall, policy=name,
                                 seq_len=C, model=f"onehot[{H}x{k}x{C}] @ x[{C}x{D}]",
                                 extra={"max_abs_error": err})
            base = base or rec["comm_bytes"]
            print(f"  {name}: {base / max(rec['comm_bytes'], 1):.2f}x fewer bytes than the "
                  f"fixed-point one-hot, max error {err:.1e}")


REPEATS = 4


@benchmark("repeat_noise")
def bench_repeat_noise(cfg: CostConfig, harness: Harness):
    """Table 2's token-level gather run REPEATS times by one backend: ABY3 kernels that draw
    asymmetric roles per call (B2A by OT, eqz, TruncAPr2) change each party's bytes from run
    to run; the sum over the parties (comm_bytes) must not change, and equals the sum
    received."""
    T = cfg.gather_tokens
    keys, idx, _ = _gather_inputs(cfg)
    variants = {
        "fixed_point_onehot": lambda i, K: P.indices_onehot(i, T, K.dtype) @ K,
        "int_onehot_gather_rows": lambda i, K: P.gather_rows(P.indices_onehot(i, T, jnp.int32), K),
    }
    for protocol, mpc_cfg, backend in harness.backends():
        for name, fn in variants.items():
            program = backend.compile(fn, (idx, keys), (mpc.SECRET, mpc.SECRET))
            totals = []
            for rep in range(REPEATS):
                _, cost, wall = backend.run(program, backend.share(idx, mpc.SECRET),
                                            backend.share(keys, mpc.SECRET))
                rec = harness.record("repeat_noise", protocol, mpc_cfg, cost, wall, policy=name,
                                     seq_len=T, model=f"K[{T}x{cfg.gather_dim}]",
                                     extra={"repeat": rep})
                totals.append(rec["comm_bytes"])
                print("    per party MB " + " ".join(
                    f"{b / 1e6:7.2f}" for b in rec["party_send_bytes"]))
            same = "the same in every run" if len(set(totals)) == 1 else "NOT the same in every run"
            print(f"  {protocol} {name}: sum over parties {min(totals) / 1e6:.2f}-"
                  f"{max(totals) / 1e6:.2f} MB, {same}")


# ----- top-k (Appendix B.5) -------------------------------------------------------------------------
@benchmark("topk")
def bench_topk(cfg: CostConfig, harness: Harness):
    rng = np.random.RandomState(cfg.seed)
    H = cfg.topk_rows
    for protocol, mpc_cfg, backend in harness.backends():
        for N in cfg.topk_sizes:
            scores = rng.randn(H, N).astype(np.float32)
            k = max(1, N // 4)
            row = {}
            for method in ("lax", "rank"):
                def fn(x, method=method):
                    return P.topk_mask(x, k, method=method)
                prog = backend.compile(fn, (scores,), (mpc.SECRET,))
                _, cost, wall = backend.run(prog, backend.share(scores, mpc.SECRET))
                row[method] = harness.record("topk", protocol, mpc_cfg, cost, wall, policy=method,
                                             seq_len=N, model=f"scores[{H}x{N}]",
                                             extra={"k": k, "rows": H})
            a, b = row["lax"], row["rank"]
            cheaper = "rank" if b["lan_total_s"] < a["lan_total_s"] else "lax"
            print(f"  {protocol} N={N}: lax/rank comm {a['comm_bytes'] / max(b['comm_bytes'], 1):.2f}x,"
                  f" LAN total {a['lan_total_s'] / max(b['lan_total_s'], 1e-9):.2f}x -> {cheaper}")


# ----- single matmuls ---------------------------------------------------------------------------------
# (name, lhs shape, rhs shape, operand kind): the selection's one-hot composition of MPCache's
# default on SmolLM2 at T = 1024 ([25, 52] x [52, 256]) as integers, integer x fixed point
# (gather_rows) and fixed point, against one MLP matmul of a SmolLM2 decode layer.
MATMUL_CASES = (("onehot_int_x_int", (25, 52), (52, 256), "int"),
                ("onehot_int_x_fixed", (25, 52), (52, 256), "gather"),
                ("onehot_fixed_x_fixed", (25, 52), (52, 256), "float"),
                ("mlp_fixed_x_fixed", (1, 576), (576, 1536), "float"),
                # SmolLM2 at T = 1024: MPCache's coarse put-back of the probabilities (the
                # largest one-hot product of a step), as computed and transposed, and q . K.
                ("put_back_int_x_fixed", (64, 13), (13, 144), "gather"),
                ("put_back_transposed", (144, 13), (13, 64), "gather_t"),
                ("scores_fixed_x_fixed", (1, 64), (64, 1024), "float"))
REPEATS_MATMUL = 3


@benchmark("matmul")
def bench_matmul(cfg: CostConfig, harness: Harness):
    """Whether a secret matmul's time follows its multiply-accumulates or its output size."""
    rng = np.random.default_rng(cfg.seed)
    for protocol, mpc_cfg, backend in harness.backends():
        real = lambda shape: rng.normal(size=shape).astype(np.float32)
        bits = lambda shape: rng.integers(0, 2, shape).astype(np.int32)
        for name, a_shape, b_shape, kind in MATMUL_CASES:
            if kind == "float":
                args, fn = (real(a_shape), real(b_shape)), jnp.matmul
            elif kind == "int":
                args, fn = (bits(a_shape), bits(b_shape)), jnp.matmul
            elif kind == "gather":      # integer one-hot x fixed point
                args, fn = (bits(a_shape), real(b_shape)), P.gather_rows
            else:                       # "gather_t": fixed point x a one-hot, transposed
                args = (real(a_shape), bits(b_shape))
                fn = lambda x, onehot: jnp.matmul(x, onehot.astype(jnp.float32))
            prog = backend.compile(fn, args, (mpc.SECRET, mpc.SECRET))
            cost, wall, _ = median_run(
                lambda: backend.run(prog, *(backend.share(a, mpc.SECRET) for a in args))[1:],
                REPEATS_MATMUL)
            harness.record("matmul", protocol, mpc_cfg, cost, wall, policy=name,
                           seq_len=a_shape[1], model=f"{a_shape} x {b_shape}", extra={
                               "macs": a_shape[0] * a_shape[1] * b_shape[1],
                               "outputs": a_shape[0] * b_shape[1]})


# ----- one RMSNorm scale ----------------------------------------------------------------------------
def _two_rsqrt_scale(x, eps):
    """The RMSNorm scale as it was before one-rsqrt (both branches inverted, then selected):
    kept here only as the benchmark's reference."""
    from models.transformer import NORM_LARGE_MEAN_SQUARE, NORM_SHIFT
    shift = 2.0 ** -NORM_SHIFT
    mean_square = jnp.mean(x * x, axis=-1, keepdims=True)
    shifted = jnp.mean((x * shift) * x, axis=-1, keepdims=True)
    large = shifted > shift * NORM_LARGE_MEAN_SQUARE
    return jnp.where(large, jax.lax.rsqrt(shifted + shift * eps) * shift ** 0.5,
                     jax.lax.rsqrt(mean_square + eps))


@benchmark("norm")
def bench_norm(cfg: CostConfig, harness: Harness):
    """Messages / bytes of one RMSNorm scale on a hidden-size row (with an attention-sink
    entry, so the large-row branch is taken): shipped one-rsqrt form vs two rsqrts."""
    from models.transformer import rms_scale
    cfg_model = registry.get_config(cfg.model)
    x = np.random.RandomState(cfg.seed).randn(1, cfg_model.hidden_size).astype(np.float32)
    x[0, 5] = 2.0e4
    exact = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + cfg_model.norm_eps)
    for protocol, mpc_cfg, backend in harness.backends():
        row = {}
        for name, fn in (("one_rsqrt", rms_scale), ("two_rsqrt", _two_rsqrt_scale)):
            prog = backend.compile(lambda v, fn=fn: fn(v, cfg_model.norm_eps), (x,), (mpc.SECRET,))
            out, cost, wall = backend.run(prog, backend.share(x, mpc.SECRET))
            value = float(np.asarray(backend.reveal(out)).ravel()[0])
            row[name] = harness.record("norm", protocol, mpc_cfg, cost, wall, policy=name,
                                       seq_len=cfg_model.hidden_size, extra={
                                           "value": value, "rel_error": abs(value - exact) / exact})
        a, b = row["two_rsqrt"], row["one_rsqrt"]
        print(f"  {protocol}: two/one rsqrt messages {a['messages'] / max(b['messages'], 1):.2f}x,"
              f" comm {a['comm_bytes'] / max(b['comm_bytes'], 1):.2f}x; relative error "
              f"{b['rel_error']:.1e} (one) / {a['rel_error']:.1e} (two)")


# ----- rounds every policy shares: alternatives measured and not shipped -----------------------------
def tournament_max(x: jax.Array, fan_in: int = 4) -> jax.Array:
    """Max over the last axis in ceil(log_fan_in(N)) levels instead of log2(N): every level
    compares each pair of a group once (all pairs at the same time) and keeps the entry that
    wins all of its comparisons (ties go to the lower index). Kept here only as the
    benchmark's alternative."""
    while x.shape[-1] > 1:
        f = min(fan_in, x.shape[-1])
        pad = -x.shape[-1] % f
        if pad:
            x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (pad,), -1e4, x.dtype)], axis=-1)
        g = x.reshape(x.shape[:-1] + (-1, f))
        first, second = np.triu_indices(f, 1)
        first_wins = g[..., first] >= g[..., second]              # one comparison per pair
        wins = []
        for i in range(f):
            won = [first_wins[..., p] if first[p] == i else ~first_wins[..., p]
                   for p in range(len(first)) if i in (first[p], second[p])]
            wins.append(functools.reduce(jnp.logical_and, won))
        x = jnp.sum(jnp.where(jnp.stack(wins, axis=-1), g, 0.0), axis=-1)
    return x[..., 0]


def integer_query_scores(q: jax.Array, k: jax.Array, bits: int = 12) -> jax.Array:
    """grouped_scores with the scaled query turned into integers (x 2^bits, one conversion of
    [H, d]) so that the per-head products are integer x fixed point: no truncation per head,
    one rescale of the [H_kv, G, T] scores. Kept here only as the benchmark's alternative."""
    Hkv, d = k.shape[0], q.shape[-1]
    # x 3 after the conversion: SPU leaves a converted integer in boolean shares, and every
    # per-head slice would convert it back; an integer product re-shares it arithmetically.
    ints = (q * (2.0 ** bits / (3.0 * np.sqrt(d)))).astype(jnp.int32) * 3
    ints = ints.reshape(Hkv, -1, d)
    out = jax.lax.dot_general(ints, k, (((2,), (2,)), ((0,), (0,))),
                              preferred_element_type=jnp.float32)
    return out * 2.0 ** -bits


@benchmark("rounds")
def bench_rounds(cfg: CostConfig, harness: Harness):
    """Two ways to cut the rounds of the attention every policy runs, on one
    layer of the model's geometry at each --seq_lens: the softmax row max as SPU's reduce
    (log2 T levels) vs a fan-in-4 tournament, and q . K with a fixed-point query (SPU loops
    over the KV heads, a truncation per head) vs an integer query (mixed products)."""
    from mpcache_jax.attention import grouped_scores
    m = registry.get_config(cfg.model)
    rng = np.random.default_rng(cfg.seed)
    H, Hkv, d = m.num_heads, m.num_kv_heads, m.head_dim
    for protocol, mpc_cfg, backend in harness.backends():
        for T in cfg.seq_lens:
            q = rng.normal(size=(H, d)).astype(np.float32)
            k = rng.normal(size=(Hkv, T, d)).astype(np.float32)
            s = (4 * rng.normal(size=(Hkv, H // Hkv, T))).astype(np.float32)
            cases = (("row_max_reduce", lambda x: jnp.max(x, axis=-1), (s,), s.max(-1)),
                     ("row_max_tournament4", tournament_max, (s,), s.max(-1)),
                     ("scores_fixed_query", grouped_scores, (q, k), None),
                     ("scores_integer_query", integer_query_scores, (q, k), None))
            exact = np.einsum("kgd,ksd->kgs", q.reshape(Hkv, H // Hkv, d), k) / np.sqrt(d)
            for name, fn, args, want in cases:
                prog = backend.compile(fn, args, (mpc.SECRET,) * len(args))
                out, cost, wall = backend.run(prog, *(backend.share(a, mpc.SECRET) for a in args))
                got = np.asarray(backend.reveal(out))
                want = exact if want is None else want
                harness.record("rounds", protocol, mpc_cfg, cost, wall, policy=name, seq_len=T,
                               model=cfg.model, extra={
                                   "max_abs_error": float(np.abs(got - want).max())})
