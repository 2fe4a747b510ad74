"""`--experiment=mpc_cost`: cost of secure decode steps (and of their building blocks) under MPC.

Benchmarks (`--mpc_bench`):
  decode  per-token decode cost of each policy at each cache length (Figure 10 / 11 analogs,
          the oracle floor): the decoder layers of one decode step (`--num_layers` of them) run
          under SPU on a cache prefilled in plaintext (cost does not depend on values) and
          secret-shared; the policy-independent LM head + argmax is measured once as `lm_head`.
          `no_cache` recomputes prompt + generated tokens through the layers each step.
          `oracle` rows: attention to exactly the budgeted prompt tokens chosen publicly and for
          free (StreamingLLM's positional choice, a selection without any secure computation).
  gather  Table 2: token-level vs cluster-level one-hot gathers of 25% of the keys.
  topk    lax.top_k vs pairwise-rank top-k on [heads, N] secret scores (Appendix B.5).
Each run prints the ratios measured in that run and writes DIR/results.jsonl.
"""
from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import ensure_dir, flag_values, git_commit, write_jsonl
from mpcache_jax import mpc
from mpcache_jax import primitives as P
from mpcache_jax.generate import apply_policy
from mpcache_jax.policies import make_policy
from models import registry
from models.model import Model

# Cheaper top-k per protocol, measured by `--mpc_bench=topk` (experiments/flags/mpc_topk.flags,
# 32 heads ranked per call, LAN-modelled latency): SPU's lax.top_k sorts the heads one after the
# other (~1200-3000 messages); the pairwise rank ranks every head at once in constant depth
# (15-19 messages) with N(N-1)/2 comparisons: 0.6x lax's bytes (ABY3), about the same (SEMI2K),
# but O(N^2) local work. Counting the simulated compute, the rank is the faster one up to
# RANK_MAX_CANDIDATES candidates per head (mpc_topk.flags, 2026-11-22), lax beyond.
RANK_MAX_CANDIDATES = {"ABY3": 64, "SEMI2K": 128, "CHEETAH": 64}
RANK_ROWS_MEASURED = 32
ORACLE = "oracle"
NEW_SLOTS = 8  # room for generated tokens in every policy's cache


def mpc_config(FLAGS, protocol: str) -> mpc.MPCConfig:
    if FLAGS.runtime_config:
        return mpc.from_json(FLAGS.runtime_config, protocol=protocol)
    return mpc.MPCConfig(protocol=protocol)


def protocols(FLAGS) -> list[str]:
    if FLAGS.backend == "xla":
        return ["PLAINTEXT"]
    if FLAGS.protocol:
        return [p.strip().upper() for p in FLAGS.protocol.split(",") if p.strip()]
    if FLAGS.runtime_config:
        return [mpc.from_json(FLAGS.runtime_config).protocol]
    return ["ABY3"]


def topk_method_for(FLAGS, protocol: str, rows: int, candidates: int) -> str:
    """Pairwise rank while its O(rows x candidates^2) local work stays within what was measured
    to beat lax.top_k (RANK_MAX_CANDIDATES candidates x RANK_ROWS_MEASURED rows), else lax."""
    if FLAGS.topk_method != "auto":
        return FLAGS.topk_method
    limit = RANK_ROWS_MEASURED * RANK_MAX_CANDIDATES.get(protocol, 64) ** 2
    return "rank" if rows * candidates ** 2 <= limit else "lax"


def build_policy(FLAGS, name: str, protocol: str, prompt_len: int, num_kv_heads: int,
                 options: dict | None = None):
    """The registered policy (with `options`, e.g. a --variants entry) with the benchmark's
    budget and per-protocol top-k method."""
    from experiments.accuracy import parse_budget
    budget = parse_budget(FLAGS.budgets[0])
    if name == ORACLE:
        return make_policy("streaming_llm", budget=budget, softmax=FLAGS.softmax), budget
    policy = make_policy(name, budget=budget, **(options or {}))
    fields = {f.name for f in dataclasses.fields(policy)}
    changes = {"softmax": FLAGS.softmax}
    if "share_from" in fields and FLAGS.mpc_share_from is not None:
        changes["share_from"] = FLAGS.mpc_share_from
    if "topk_method" in fields:
        # The rows and longest candidate row the policy ranks: MPCache's levels say theirs
        # (clusters, one row per layer or per KV head); token-level selection is costed like
        # the measured per-head case (every prompt token a candidate).
        rows, candidates = RANK_ROWS_MEASURED, prompt_len
        if hasattr(policy, "ranked_rows"):
            rows, candidates = policy.ranked_rows(prompt_len, num_kv_heads)
        changes["topk_method"] = topk_method_for(FLAGS, protocol, rows, candidates)
    return dataclasses.replace(policy, **changes), budget


def costed_policies(FLAGS) -> list[tuple[str, str, dict]]:
    """(label, registered name, options): --policies plus configured --variants."""
    from experiments.accuracy import parse_variants
    return [(label, name, options) for label, name, options in parse_variants(FLAGS)]


def _record(FLAGS, bench, protocol, cfg, model_name, num_layers, policy_name, seq_len, cost,
            wall, extra=None):
    parties = cfg.parties if cfg else 1
    # Every party's profile (mpc.cost_fields): comm_bytes = bytes sent summed over the parties,
    # per-party bytes / actions / compute in party_* fields. Plaintext runs: zeros, same keys.
    fields = (mpc.cost_fields(cost, wall, parties) if cost is not None else
              {"comm_bytes": 0, "messages": 0, "party_send_bytes": [], "party_recv_bytes": [],
               "party_send_actions": [], "party_compute_s": [], "party_attribution": "",
               "wall_s": round(wall, 4), "compute_s": wall,
               "lan_latency_s": 0.0, "wan_latency_s": 0.0, "lan_total_s": wall,
               "wan_total_s": wall, "phase_breakdown": {}, "ops": {}})
    rec = {"bench": bench, "policy": policy_name, "protocol": protocol,
           "parties": parties, "seq_len": seq_len, "model": model_name,
           "num_layers": num_layers, **fields, **(extra or {}),
           "runtime_config": cfg.runtime_json() if cfg else None,
           "git_commit": git_commit()}
    return rec


# ----- decode (Figures 10 / 11, limit) -------------------------------------------------------------
def bench_decode(FLAGS, out_path):
    loaded = registry.load(FLAGS.model, weights_path=FLAGS.weights_path, cache_dir=FLAGS.cache_dir,
                           seed=FLAGS.seed, num_layers=FLAGS.num_layers)
    full_cfg = loaded.model.cfg.replace(activation_impl=FLAGS.activation_impl)
    seq_lens = [int(t) for t in FLAGS.seq_lens]
    # The decoder layers do not depend on the vocabulary: cost them with a 256-token vocabulary
    # (the one-hot embedding of the new token shrinks accordingly) so that only the layers'
    # weights are secret-shared; the real-vocabulary LM head is costed once on its own.
    # Random weights; positions extended to the longest cache (GPT-2 geometry has 1024).
    cfgm = full_cfg.replace(vocab_size=256,
                            max_position=max(full_cfg.max_position, max(seq_lens) + NEW_SLOTS + 1))
    model = Model(cfgm)
    params = model.init_params(FLAGS.seed)
    params_shape = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    head_params = {k: loaded.params[k] for k in ("final_norm", "lm_head")}
    del loaded
    rng = np.random.RandomState(FLAGS.seed)
    records = []
    for protocol in protocols(FLAGS):
        cfg = None if FLAGS.backend == "xla" else mpc_config(FLAGS, protocol)
        backend = mpc.make_backend(FLAGS.backend, cfg)
        # LM head + argmax: policy independent, once per protocol.
        head_model = Model(full_cfg)
        head = backend.compile(mpc.head_fn(head_model), (head_params,
                                                         np.zeros((1, cfgm.hidden_size), np.float32)),
                               (mpc.SECRET, mpc.SECRET))
        hidden = backend.share(rng.randn(1, cfgm.hidden_size).astype(np.float32) * 0.1, mpc.SECRET)
        _, cost, wall = backend.run(head, backend.share(head_params, mpc.SECRET, owner=mpc.SERVER),
                                    hidden)
        rec = _record(FLAGS, "decode", protocol, cfg, FLAGS.model, cfgm.num_layers, "lm_head", 0,
                      cost, wall, {"scope": "lm_head", "vocab_size": full_cfg.vocab_size})
        records.append(rec)
        write_jsonl(out_path, [rec], append=True)
        _print_row(rec)
        # MLP activation alone (exp/reciprocal of SiLU share op classes with the softmax).
        from models.transformer import activation_fn
        act = activation_fn(cfgm.activation, cfgm.activation_impl)
        x_act = rng.randn(cfgm.num_layers, cfgm.intermediate_size).astype(np.float32)
        prog = backend.compile(lambda x: act(x), (x_act,), mpc.SECRET)
        _, cost, wall = backend.run(prog, backend.share(x_act, mpc.SECRET))
        rec = _record(FLAGS, "decode", protocol, cfg, FLAGS.model, cfgm.num_layers,
                      "mlp_activation", 0, cost, wall,
                      {"scope": "mlp_activation", "activation_impl": cfgm.activation_impl})
        records.append(rec)
        write_jsonl(out_path, [rec], append=True)
        _print_row(rec)
        params_sh = backend.share(params, mpc.SECRET, owner=mpc.SERVER)
        for T in seq_lens:
            prompt = rng.randint(0, cfgm.vocab_size, T)
            need_queries = True
            logits, dense, aux = model.prefill(params, list(prompt), model.init_cache(T + NEW_SLOTS),
                                               return_queries=need_queries)
            for label, name, options in costed_policies(FLAGS):
                policy, budget = build_policy(FLAGS, name, protocol, T, cfgm.num_kv_heads, options)
                extra = {"scope": "decoder_layers", "budget": budget,
                         "topk_method": getattr(policy, "topk_method", None),
                         "share_from": getattr(policy, "share_from", None),
                         "softmax": policy.softmax}
                if policy.recomputes:
                    if T > FLAGS.no_cache_max_len:
                        print(f"  skip no_cache at {T} > --no_cache_max_len={FLAGS.no_cache_max_len}")
                        continue
                    args = (params_shape, np.zeros((T + 1, cfgm.vocab_size), np.float32))
                    prog = backend.compile(mpc.forward_layers_fn(model), args,
                                           (mpc.SECRET, mpc.SECRET))
                    toks = backend.share(mpc.onehot(np.append(prompt, 1), cfgm.vocab_size),
                                         mpc.SECRET, owner=mpc.CLIENT)
                    _, cost, wall = backend.run(prog, params_sh, toks)
                else:
                    # The decode step's inputs and their visibility, as a session's (masks
                    # of kept slots and counters derived from public data stay public).
                    progs = mpc.StepPrograms(model, policy, T, NEW_SLOTS)
                    vis = progs.decode_visibility(params_shape)
                    t0 = time.perf_counter()
                    prog = backend.compile(mpc.decode_layers_fn(model, policy),
                                           progs.decode_args(params_shape), vis)
                    extra["compile_s"] = round(time.perf_counter() - t0, 2)
                    cache = apply_policy(policy, dense, aux, NEW_SLOTS)
                    cache_sh = backend.share(cache, vis[3], owner=mpc.CLIENT)
                    tok = backend.share(mpc.onehot(int(np.argmax(logits)), cfgm.vocab_size),
                                        mpc.SECRET, owner=mpc.CLIENT)
                    pos = backend.share(np.int32(T), mpc.PUBLIC)
                    _, cost, wall = backend.run(prog, params_sh, tok, pos, cache_sh)
                    del cache_sh
                rec = _record(FLAGS, "decode", protocol, cfg, FLAGS.model, cfgm.num_layers, label,
                              T, cost, wall, extra)
                records.append(rec)
                write_jsonl(out_path, [rec], append=True)
                _print_row(rec)
            del dense
    ratios = print_decode_ratios(records)
    write_jsonl(out_path.parent / "ratios.jsonl", ratios)
    return records


def _print_row(rec):
    print(f"  {rec['protocol']:7s} T={rec['seq_len']:5d} {rec['policy']:16s} "
          f"comm {rec['comm_bytes'] / 1e6:10.2f} MB  msgs {rec['messages']:7d}  "
          f"LAN net {rec['lan_latency_s']:7.3f} s  WAN net {rec['wan_latency_s']:7.2f} s  "
          f"compute {rec['compute_s']:7.2f} s  wall {rec['wall_s']:7.2f} s", flush=True)


def print_decode_ratios(records) -> list[dict]:
    """Per (protocol, seq_len): each policy's comm / LAN latency relative to full and longcache,
    its selection + gather overhead above the oracle floor, and the MLP activation's share."""
    rows = [r for r in records if r.get("scope") == "decoder_layers"]
    act = {r["protocol"]: r for r in records if r.get("scope") == "mlp_activation"}
    keys = sorted({(r["protocol"], r["seq_len"]) for r in rows})
    print("\nratios measured in this run (decoder layers of one decode step):")
    print("(comm = bytes sent summed over the parties; LAN = modelled network time: comm / "
          "parties / 377 MB/s + messages x 0.3 ms; the simulated compute is reported per row "
          "above)")
    print(f"{'protocol':8s} {'T':>5s} {'policy':16s} {'comm MB':>9s} {'LAN s':>8s} "
          f"{'full/x comm':>11s} {'full/x LAN':>10s} {'lc/x comm':>9s} {'lc/x LAN':>8s} "
          f"{'x-oracle MB':>11s} {'x-oracle s':>10s}")
    out = []
    for proto, T in keys:
        group = {r["policy"]: r for r in rows if r["protocol"] == proto and r["seq_len"] == T}
        full, lc, orc = group.get("full"), group.get("longcache"), group.get(ORACLE)
        for name, r in group.items():
            def ratio(base, key):
                return base[key] / r[key] if base and r[key] else None
            row = {"protocol": proto, "seq_len": T, "policy": name,
                   "comm_mb": r["comm_bytes"] / 1e6, "lan_s": r["lan_latency_s"],
                   "full_over_x_comm": ratio(full, "comm_bytes"),
                   "full_over_x_lan": ratio(full, "lan_latency_s"),
                   "longcache_over_x_comm": ratio(lc, "comm_bytes"),
                   "longcache_over_x_lan": ratio(lc, "lan_latency_s"),
                   "over_oracle_mb": (r["comm_bytes"] - orc["comm_bytes"]) / 1e6 if orc else None,
                   "over_oracle_lan_s": r["lan_latency_s"] - orc["lan_latency_s"] if orc else None,
                   "mlp_activation_mb": act[proto]["comm_bytes"] / 1e6 if proto in act else None}
            out.append(row)
            f = lambda v, fmt: format(v, fmt) if v is not None else "-"
            print(f"{proto:8s} {T:5d} {name:16s} {row['comm_mb']:9.2f} {row['lan_s']:8.3f} "
                  f"{f(row['full_over_x_comm'], '.2f'):>11s} {f(row['full_over_x_lan'], '.2f'):>10s} "
                  f"{f(row['longcache_over_x_comm'], '.2f'):>9s} "
                  f"{f(row['longcache_over_x_lan'], '.2f'):>8s} {f(row['over_oracle_mb'], '.2f'):>11s} "
                  f"{f(row['over_oracle_lan_s'], '.3f'):>10s}")
    for proto, r in act.items():
        print(f"{proto}: MLP activation alone ({r['num_layers']} layers): "
              f"{r['comm_bytes'] / 1e6:.2f} MB, LAN {r['lan_latency_s']:.3f} s")
    return out


# ----- gather (Table 2) -----------------------------------------------------------------------------
def bench_gather(FLAGS, out_path):
    T, C, d = FLAGS.gather_tokens, FLAGS.gather_clusters, FLAGS.gather_dim
    k1, k2 = T // 4, C // 4
    s = T // C
    rng = np.random.RandomState(FLAGS.seed)
    keys = rng.randn(T, d).astype(np.float32)
    idx1 = np.sort(rng.choice(T, k1, replace=False)).astype(np.int32)
    idx2 = np.sort(rng.choice(C, k2, replace=False)).astype(np.int32)

    def token_level(idx, K):
        return P.gather_rows(P.indices_onehot(idx, T, jnp.int32), K)

    def cluster_level(idx, K):
        return P.gather_clusters(P.indices_onehot(idx, C, jnp.int32), K, s)

    records = []
    for protocol in protocols(FLAGS):
        cfg = None if FLAGS.backend == "xla" else mpc_config(FLAGS, protocol)
        backend = mpc.make_backend(FLAGS.backend, cfg)
        K = backend.share(keys, mpc.SECRET, owner=mpc.CLIENT)
        for name, fn, idx in (("token_level", token_level, idx1),
                              ("cluster_level", cluster_level, idx2)):
            prog = backend.compile(fn, (idx, keys), (mpc.SECRET, mpc.SECRET))
            _, cost, wall = backend.run(prog, backend.share(idx, mpc.SECRET), K)
            rec = _record(FLAGS, "gather", protocol, cfg, f"K[{T}x{d}]", 0, name, T, cost, wall,
                          {"clusters": C, "selected": len(idx), "cluster_size": s})
            records.append(rec)
            write_jsonl(out_path, [rec], append=True)
            _print_row(rec)
        tok, clu = records[-2], records[-1]
        if clu["comm_bytes"]:
            print(f"  {protocol}: token/cluster comm {tok['comm_bytes'] / clu['comm_bytes']:.1f}x, "
                  f"LAN network time {tok['lan_latency_s'] / clu['lan_latency_s']:.1f}x, LAN "
                  f"total {tok['lan_total_s'] / clu['lan_total_s']:.1f}x "
                  "(paper: 369.8x comm, 73.5x latency)")
    return records


# ----- top-k (Appendix B.5) -------------------------------------------------------------------------
def bench_topk(FLAGS, out_path):
    rng = np.random.RandomState(FLAGS.seed)
    H = FLAGS.topk_rows
    records = []
    for protocol in protocols(FLAGS):
        cfg = None if FLAGS.backend == "xla" else mpc_config(FLAGS, protocol)
        backend = mpc.make_backend(FLAGS.backend, cfg)
        for N in [int(n) for n in FLAGS.topk_sizes]:
            scores = rng.randn(H, N).astype(np.float32)
            k = max(1, N // 4)
            row = {}
            for method in ("lax", "rank"):
                def fn(x, method=method):
                    return P.topk_mask(x, k, method=method)
                prog = backend.compile(fn, (scores,), (mpc.SECRET,))
                _, cost, wall = backend.run(prog, backend.share(scores, mpc.SECRET))
                rec = _record(FLAGS, "topk", protocol, cfg, f"scores[{H}x{N}]", 0, method, N,
                              cost, wall, {"k": k, "rows": H})
                records.append(rec)
                row[method] = rec
                write_jsonl(out_path, [rec], append=True)
                _print_row(rec)
            a, b = row["lax"], row["rank"]
            cheaper = "rank" if b["lan_total_s"] < a["lan_total_s"] else "lax"
            print(f"  {protocol} N={N}: lax/rank comm {a['comm_bytes'] / max(b['comm_bytes'], 1):.2f}x,"
                  f" LAN total {a['lan_total_s'] / max(b['lan_total_s'], 1e-9):.2f}x -> {cheaper}")
    return records


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


def bench_norm(FLAGS, out_path):
    """Messages / bytes of one RMSNorm scale on a hidden-size row (with an attention-sink
    entry, so the large-row branch is taken): shipped one-rsqrt form vs two rsqrts."""
    from models.transformer import rms_scale
    cfg_model = registry.get_config(FLAGS.model)
    x = np.random.RandomState(FLAGS.seed).randn(1, cfg_model.hidden_size).astype(np.float32)
    x[0, 5] = 2.0e4
    exact = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + cfg_model.norm_eps)
    records = []
    for protocol in protocols(FLAGS):
        cfg = None if FLAGS.backend == "xla" else mpc_config(FLAGS, protocol)
        backend = mpc.make_backend(FLAGS.backend, cfg)
        row = {}
        for name, fn in (("one_rsqrt", rms_scale), ("two_rsqrt", _two_rsqrt_scale)):
            prog = backend.compile(lambda v, fn=fn: fn(v, cfg_model.norm_eps), (x,), (mpc.SECRET,))
            out, cost, wall = backend.run(prog, backend.share(x, mpc.SECRET))
            value = float(np.asarray(backend.reveal(out)).ravel()[0])
            rec = _record(FLAGS, "norm", protocol, cfg, FLAGS.model, 0, name,
                          cfg_model.hidden_size, cost, wall,
                          {"value": value, "rel_error": abs(value - exact) / exact})
            records.append(rec)
            row[name] = rec
            write_jsonl(out_path, [rec], append=True)
            _print_row(rec)
        a, b = row["two_rsqrt"], row["one_rsqrt"]
        print(f"  {protocol}: two/one rsqrt messages {a['messages'] / max(b['messages'], 1):.2f}x,"
              f" comm {a['comm_bytes'] / max(b['comm_bytes'], 1):.2f}x; relative error "
              f"{b['rel_error']:.1e} (one) / {a['rel_error']:.1e} (two)")
    return records


# ----- secure generation (real model) ----------------------------------------------------------------
def bench_generate(FLAGS, out_path):
    """Greedy secure generation (prefill + static eviction + decode steps under MPC) vs the
    plaintext run of the same programs; records time and communication per step."""
    from experiments.common import with_model_numerics
    loaded = with_model_numerics(registry.load(
        FLAGS.model, weights_path=FLAGS.weights_path, cache_dir=FLAGS.cache_dir, seed=FLAGS.seed,
        num_layers=FLAGS.num_layers), FLAGS)
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"model {FLAGS.model!r} has no tokenizer; secure generation needs one")
    prompt_ids = tok.encode_chat(FLAGS.prompt, system=FLAGS.system_prompt) if FLAGS.chat \
        else tok.encode(FLAGS.prompt)
    records = []
    for protocol in protocols(FLAGS):
        cfg = None if FLAGS.backend == "xla" else mpc_config(FLAGS, protocol)
        for name in FLAGS.policies:
            policy, budget = build_policy(FLAGS, name, protocol, len(prompt_ids),
                                          loaded.model.cfg.num_kv_heads)
            plain = mpc.SecureSession(mpc.make_backend("xla"), loaded.model, loaded.params,
                                      policy).generate(prompt_ids, FLAGS.max_new_tokens)
            backend = mpc.make_backend(FLAGS.backend, cfg)
            t0 = time.perf_counter()
            secure = mpc.SecureSession(backend, loaded.model, loaded.params, policy).generate(
                prompt_ids, FLAGS.max_new_tokens)
            total = time.perf_counter() - t0
            decode = [s for s in secure.steps if s.phase == "decode" and s.cost is not None]
            match = secure.tokens == plain.tokens
            print(f"  {protocol} {name}: secure {secure.tokens}\n  {' ' * len(protocol)} {name}: "
                  f"plain  {plain.tokens} -> {'SAME' if match else 'DIFFERENT'} tokens; "
                  f"text {tok.decode(secure.tokens)!r}")
            for step in secure.steps:
                if step.cost is None:
                    continue
                rec = _record(FLAGS, "generate", protocol, cfg, FLAGS.model,
                              loaded.model.cfg.num_layers, name, step.position, step.cost,
                              step.wall_s, {"phase": step.phase, "budget": budget})
                records.append(rec)
                write_jsonl(out_path, [rec], append=True)
                _print_row(rec)
            summary = {"bench": "generate_summary", "policy": name, "protocol": protocol,
                       "model": FLAGS.model, "prompt_tokens": len(prompt_ids),
                       "tokens_secure": secure.tokens, "tokens_plain": plain.tokens,
                       "same_tokens": match, "text": tok.decode(secure.tokens),
                       "total_s": round(total, 2), "compile_s": round(secure.compile_s, 2),
                       "decode_s_per_token": round(float(np.mean([s.wall_s for s in decode])), 3)
                       if decode else None,
                       "decode_comm_bytes_per_token": int(np.mean(
                           [mpc.cost_fields(s.cost, 0, cfg.parties)["comm_bytes"] for s in decode]))
                       if decode and cfg else None,
                       "git_commit": git_commit()}
            records.append(summary)
            write_jsonl(out_path, [summary], append=True)
            print(f"  summary: {summary}")
    return records


BENCHES = {"decode": bench_decode, "gather": bench_gather, "topk": bench_topk,
           "norm": bench_norm, "generate": bench_generate}


def run(FLAGS):
    if FLAGS.backend not in mpc.BACKENDS:
        raise ValueError(f"--backend={FLAGS.backend!r}; use one of {mpc.BACKENDS}")
    for p in protocols(FLAGS):  # validate every protocol before any work
        if p != "PLAINTEXT":
            mpc_config(FLAGS, p)
    if FLAGS.mpc_bench in ("decode", "generate"):
        validate_policies(FLAGS)
    out_dir = ensure_dir(FLAGS.output_dir or "results/mpc_cost")
    out_path = out_dir / "results.jsonl"
    # Records accumulate in results.jsonl.partial; an earlier run's results.jsonl stays intact
    # until this run has finished and replaces it.
    partial = out_dir / "results.jsonl.partial"
    partial.unlink(missing_ok=True)
    print(f"mpc_cost {FLAGS.mpc_bench}: backend={FLAGS.backend} protocols={protocols(FLAGS)} "
          f"model={FLAGS.model} num_layers={FLAGS.num_layers} -> {out_path}")
    records = BENCHES[FLAGS.mpc_bench](FLAGS, partial)
    write_jsonl(out_dir / "config.jsonl", [{"flags": flag_values(FLAGS), "git_commit": git_commit()}])
    if partial.exists():
        os.replace(partial, out_path)
    print(f"{len(records)} records -> {out_path}")


def validate_policies(FLAGS) -> None:
    """Every --policies / --variants entry builds at the budget, before anything is costed."""
    from experiments.accuracy import parse_budget
    if FLAGS["budgets"].present and len(FLAGS.budgets) != 1:
        raise ValueError(f"--experiment=mpc_cost costs one budget; --budgets={','.join(FLAGS.budgets)}")
    budget = parse_budget(FLAGS.budgets[0])
    for label, name, options in costed_policies(FLAGS):
        if name not in (ORACLE, "full", "no_cache"):
            make_policy(name, budget=budget, **(options or {}))
