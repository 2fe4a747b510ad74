"""Decode-step benchmarks on a real policy: `decode` (the decoder layers of one decode step per
policy and cache length, the LM head and the MLP activation once; Figure 10 / 11 analogs and the
oracle floor) and `generate` (secure greedy generation against the plaintext run)."""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from experiments.common import git_commit, write_jsonl
from experiments.cost.harness import CostConfig, Harness, benchmark, median_run
from models import registry
from models.model import Model
from mpcache_jax import primitives as P
from mpcache_jax.policies import make_policy
from runtime import mpc
from runtime.generate import apply_policy

# Cheaper top-k per protocol, measured by `--mpc_bench=topk` (experiments/flags/mpc_topk.flags,
# 32 heads ranked per call, LAN-modelled latency): SPU's lax.top_k sorts the heads one after the
# other (~1200-3000 messages); the pairwise rank ranks every head at once in constant depth
# (15-19 messages) with N(N-1)/2 comparisons: 0.6x lax's bytes (ABY3), about the same (SEMI2K),
# but O(N^2) local work. Counting the simulated compute, the rank is the faster one up to
# RANK_MAX_CANDIDATES candidates per head (mpc_topk.flags, 2026-11-22), lax beyond.
RANK_MAX_CANDIDATES = {"ABY3": 64, "SEMI2K": 128, "CHEETAH": 64}
RANK_ROWS_MEASURED = 32   # rows ranked per call in that measurement (--topk_rows)
ORACLE = "oracle"
NEW_SLOTS = 8  # room for generated tokens in every policy's cache

def topk_method_for(cfg: CostConfig, protocol: str, rows: int, candidates: int) -> str:
    """Pairwise rank while its O(rows x candidates^2) local work stays within what was measured
    to beat lax.top_k (RANK_MAX_CANDIDATES candidates x RANK_ROWS_MEASURED rows), else lax."""
    if cfg.topk_method != "auto":
        return cfg.topk_method
    limit = RANK_ROWS_MEASURED * RANK_MAX_CANDIDATES.get(protocol, 64) ** 2
    return "rank" if rows * candidates ** 2 <= limit else "lax"


def build_policy(cfg: CostConfig, name: str, protocol: str, prompt_len: int, num_kv_heads: int,
                 options: dict | None = None):
    """The registered policy (with `options`, e.g. a --variants entry) with the benchmark's
    budget, softmax and per-protocol top-k method."""
    policy = make_policy(name, budget=cfg.budget, **(options or {}))
    fields = {f.name for f in dataclasses.fields(policy)}
    changes = {"softmax": cfg.softmax}
    if "share_from" in fields and cfg.share_from is not None:
        changes["share_from"] = cfg.share_from
    if "topk_method" in fields:
        # The rows and longest candidate row the policy ranks: MPCache's levels say theirs
        # (clusters, one row per layer or per KV head); token-level selection is costed like
        # the measured per-head case (every prompt token a candidate).
        rows, candidates = policy.ranked_rows(prompt_len, num_kv_heads) or (
            RANK_ROWS_MEASURED, prompt_len)
        method = topk_method_for(cfg, protocol, rows, candidates)
        allowed = getattr(type(policy), "TOPK_METHODS", None)   # a policy that ranks one way
        changes["topk_method"] = method if allowed is None or method in allowed else allowed[0]
    return dataclasses.replace(policy, **changes), cfg.budget

# ----- decode (Figures 10 / 11, limit) -------------------------------------------------------------
@benchmark("decode")
def bench_decode(cfg: CostConfig, harness: Harness):
    loaded = registry.load(cfg.model, weights_path=cfg.weights_path, cache_dir=cfg.cache_dir,
                           seed=cfg.seed, num_layers=cfg.num_layers, layers=cfg.layers)
    full_cfg = loaded.model.cfg.replace(activation_impl=cfg.activation_impl)
    seq_lens = cfg.seq_lens
    # The decoder layers do not depend on the vocabulary: cost them with a 256-token vocabulary
    # (the one-hot embedding of the new token shrinks accordingly) so that only the layers'
    # weights are secret-shared; the real-vocabulary LM head is costed once on its own.
    # Random weights; positions extended to the longest cache (GPT-2 geometry has 1024).
    cfgm = full_cfg.replace(vocab_size=256,
                            max_position=max(full_cfg.max_position, max(seq_lens) + NEW_SLOTS + 1))
    model = Model(cfgm)
    params = model.init_params(cfg.seed)
    params_shape = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    head_params = ({k: loaded.params[k] for k in ("final_norm", "lm_head")} if cfg.lm_head
                   else None)
    del loaded
    rng = np.random.RandomState(cfg.seed)
    layers = {"num_layers": cfgm.num_layers}
    picked = {"layers": list(cfg.layers)} if cfg.layers else {}
    new_slots = max(NEW_SLOTS, cfg.decode_steps)
    for protocol, mpc_cfg, backend in harness.backends():
        if head_params is not None:   # LM head + argmax: policy independent, once per protocol
            head_model = Model(full_cfg)
            head = backend.compile(mpc.head_fn(head_model),
                                   (head_params, np.zeros((1, cfgm.hidden_size), np.float32)),
                                   (mpc.SECRET, mpc.SECRET))
            hidden = backend.share(rng.randn(1, cfgm.hidden_size).astype(np.float32) * 0.1,
                                   mpc.SECRET)
            _, cost, wall = backend.run(head, backend.share(head_params, mpc.SECRET,
                                                            owner=mpc.SERVER), hidden)
            harness.record("decode", protocol, mpc_cfg, cost, wall, policy="lm_head", seq_len=0,
                           **layers, extra={"scope": "lm_head", "vocab_size": full_cfg.vocab_size})
        # MLP activation alone (exp/reciprocal of SiLU share op classes with the softmax).
        from models.transformer import activation_fn
        act = activation_fn(cfgm.activation, cfgm.activation_impl)
        x_act = rng.randn(cfgm.num_layers, cfgm.intermediate_size).astype(np.float32)
        prog = backend.compile(lambda x: act(x), (x_act,), mpc.SECRET)
        _, cost, wall = backend.run(prog, backend.share(x_act, mpc.SECRET))
        harness.record("decode", protocol, mpc_cfg, cost, wall, policy="mlp_activation",
                       seq_len=0, **layers, extra={"scope": "mlp_activation",
                                                   "activation_impl": cfgm.activation_impl})
        params_sh = backend.share(params, mpc.SECRET, owner=mpc.SERVER)
        for T in seq_lens:
            prompt = rng.randint(0, cfgm.vocab_size, T)
            logits, dense, aux = model.prefill(params, list(prompt), model.init_cache(T + new_slots),
                                               return_queries=True)
            for label, name, options in cfg.policies:
                policy, budget = build_policy(cfg, name, protocol, T, cfgm.num_kv_heads, options)
                settings = vars(policy)       # the dataclass's fields
                extra = {"scope": "decoder_layers", "budget": P.budget_record(budget), **picked,
                         "topk_method": settings.get("topk_method"),
                         "share_from": settings.get("share_from"),
                         "softmax": policy.softmax}
                if policy.recomputes:
                    if T > cfg.no_cache_max_len:
                        print(f"  skip no_cache at {T} > --no_cache_max_len={cfg.no_cache_max_len}")
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
                    progs = mpc.StepPrograms(model, policy, T, new_slots)
                    vis = progs.decode_visibility(params_shape)
                    t0 = time.perf_counter()
                    prog = backend.compile(mpc.decode_layers_fn(model, policy),
                                           progs.decode_args(params_shape), vis)
                    extra["compile_s"] = round(time.perf_counter() - t0, 2)
                    cache = apply_policy(policy, dense, aux, new_slots)
                    cache_sh = backend.share(cache, vis[3], owner=mpc.CLIENT)
                    tok = backend.share(mpc.onehot(int(np.argmax(logits)), cfgm.vocab_size),
                                        mpc.SECRET, owner=mpc.CLIENT)
                    if cfg.decode_steps > 1:
                        fields = generation_cost(backend, prog, params_sh, tok, cache_sh, T,
                                                 cfg.decode_steps, mpc_cfg.parties)
                        harness.record_fields("decode", protocol, mpc_cfg, fields, policy=label,
                                              seq_len=T, **layers, extra=extra)
                        del cache_sh
                        continue
                    pos = backend.share(np.int32(T), mpc.PUBLIC)
                    cost, wall, runs = median_run(
                        lambda: backend.run(prog, params_sh, tok, pos, cache_sh)[1:], cfg.repeats)
                    if runs:
                        extra["compute_runs_s"] = runs
                    del cache_sh
                harness.record("decode", protocol, mpc_cfg, cost, wall, policy=label,
                               seq_len=T, **layers, extra=extra)
            del dense
    ratios = print_decode_ratios(harness.records)
    write_jsonl(harness.out_path.parent / "ratios.jsonl", ratios)


# Per-step fields of a generation kept in its record's `steps` list.
STEP_FIELDS = ("comm_bytes", "messages", "compute_s", "lan_total_s", "wan_total_s")


def generation_cost(backend, prog, params_sh, token_sh, cache_sh, prompt_len: int, steps: int,
                    parties: int) -> dict:
    """Run `steps` decode steps of a decode-layers program from a shared cache (each step's
    cache feeds the next; the fed token is the same one-hot every step: costs do not depend on
    values) -> the record fields averaged over the steps (bytes, messages, compute, the
    modelled network times...), with each step's own in `steps`."""
    per_step = []
    for step in range(steps):
        pos = backend.share(np.int32(prompt_len + step), mpc.PUBLIC)
        (_, cache_sh), cost, wall = backend.run(prog, params_sh, token_sh, pos, cache_sh)
        per_step.append(mpc.cost_fields(cost, wall, parties))
    return average_steps(per_step)


def average_steps(per_step: list[dict]) -> dict:
    """The mean of every numeric field (lists element-wise) over the steps, `messages` rounded
    up; `steps` = each step's STEP_FIELDS; phase/op breakdowns are the first step's."""
    out = dict(per_step[0])
    for key, value in per_step[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(np.mean([s[key] for s in per_step]))
        elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
            out[key] = [float(x) for x in np.mean([s[key] for s in per_step], axis=0)]
    out["comm_bytes"] = int(round(out["comm_bytes"]))
    out["messages"] = int(math.ceil(out["messages"]))
    out["steps"] = [{k: s[k] for k in STEP_FIELDS} for s in per_step]
    return out

def print_decode_ratios(records) -> list[dict]:
    """Per (protocol, seq_len): each policy's bytes, messages, modelled LAN / WAN time + compute
    relative to full (and longcache), its overhead above the oracle floor, and for a
    generation of several steps the most and least expensive step (a refreshing policy's
    selection step vs its reuse steps)."""
    rows = [r for r in records if r.get("scope") == "decoder_layers"]
    act = {r["protocol"]: r for r in records if r.get("scope") == "mlp_activation"}
    keys = sorted({(r["protocol"], r["seq_len"]) for r in rows})
    print("\nratios measured in this run (decoder layers of one decode step; with "
          "--mpc_decode_steps, the mean step of the generation):")
    print("(comm = bytes sent summed over the parties; LAN / WAN = modelled network time "
          "(comm / parties / bandwidth + messages x RTT; LAN 377 MB/s 0.3 ms, WAN 40 MB/s 80 ms) "
          "+ the simulated compute)")
    print(f"{'protocol':8s} {'T':>5s} {'policy':16s} {'comm MB':>9s} {'msgs':>6s} "
          f"{'LAN+c s':>8s} {'WAN+c s':>8s} {'full/x comm':>11s} {'x/full msgs':>11s} "
          f"{'full/x LAN+c':>12s} {'full/x WAN+c':>12s} {'x/oracle LAN+c':>14s} "
          f"{'x-oracle MB':>11s}")
    out = []
    for proto, T in keys:
        group = {r["policy"]: r for r in rows if r["protocol"] == proto and r["seq_len"] == T}
        full, lc, orc = group.get("full"), group.get("longcache"), group.get(ORACLE)
        for name, r in group.items():
            def ratio(base, key, inverse=False):
                if not base or not r[key] or not base[key]:
                    return None
                return r[key] / base[key] if inverse else base[key] / r[key]
            row = {"protocol": proto, "seq_len": T, "policy": name,
                   "comm_mb": r["comm_bytes"] / 1e6, "messages": r["messages"],
                   "lan_s": r["lan_latency_s"], "lan_total_s": r["lan_total_s"],
                   "wan_total_s": r["wan_total_s"],
                   "full_over_x_comm": ratio(full, "comm_bytes"),
                   "x_over_full_messages": ratio(full, "messages", inverse=True),
                   "full_over_x_lan": ratio(full, "lan_latency_s"),
                   "full_over_x_lan_total": ratio(full, "lan_total_s"),
                   "full_over_x_wan_total": ratio(full, "wan_total_s"),
                   "x_over_oracle_lan_total": ratio(orc, "lan_total_s", inverse=True),
                   "longcache_over_x_comm": ratio(lc, "comm_bytes"),
                   "longcache_over_x_lan": ratio(lc, "lan_latency_s"),
                   "over_oracle_mb": (r["comm_bytes"] - orc["comm_bytes"]) / 1e6 if orc else None,
                   "over_oracle_lan_s": r["lan_latency_s"] - orc["lan_latency_s"] if orc else None,
                   "mlp_activation_mb": act[proto]["comm_bytes"] / 1e6 if proto in act else None}
            if r.get("steps"):
                by_total = sorted(r["steps"], key=lambda step: step["lan_total_s"])
                row["costliest_step"], row["cheapest_step"] = by_total[-1], by_total[0]
            out.append(row)
            f = lambda v, fmt: format(v, fmt) if v is not None else "-"
            print(f"{proto:8s} {T:5d} {name:16s} {row['comm_mb']:9.2f} {row['messages']:6d} "
                  f"{row['lan_total_s']:8.2f} {row['wan_total_s']:8.2f} "
                  f"{f(row['full_over_x_comm'], '.2f'):>11s} "
                  f"{f(row['x_over_full_messages'], '.3f'):>11s} "
                  f"{f(row['full_over_x_lan_total'], '.2f'):>12s} "
                  f"{f(row['full_over_x_wan_total'], '.2f'):>12s} "
                  f"{f(row['x_over_oracle_lan_total'], '.2f'):>14s} "
                  f"{f(row['over_oracle_mb'], '.2f'):>11s}")
            for which in ("costliest_step", "cheapest_step"):
                if which in row:
                    step = row[which]
                    print(f"{'':31s}{which.replace('_', ' ')}: {step['comm_bytes'] / 1e6:.2f} MB, "
                          f"{step['messages']} msgs, LAN+c {step['lan_total_s']:.2f} s, "
                          f"WAN+c {step['wan_total_s']:.2f} s")
    for proto, r in act.items():
        print(f"{proto}: MLP activation alone ({r['num_layers']} layers): "
              f"{r['comm_bytes'] / 1e6:.2f} MB, LAN {r['lan_latency_s']:.3f} s")
    return out

# ----- secure generation (real model) ----------------------------------------------------------------
@benchmark("generate")
def bench_generate(cfg: CostConfig, harness: Harness):
    """Greedy secure generation (prefill + static eviction + decode steps under MPC) vs the
    plaintext run of the same programs; records time and communication per step."""
    from experiments.common import with_model_numerics
    loaded = with_model_numerics(registry.load(
        cfg.model, weights_path=cfg.weights_path, cache_dir=cfg.cache_dir, seed=cfg.seed,
        num_layers=cfg.num_layers, layers=cfg.layers), cfg)
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer; secure generation needs one")
    prompt_ids = tok.encode_request(cfg.prompt, chat=cfg.chat, system=cfg.system_prompt)
    for protocol in cfg.protocols:
        mpc_cfg = cfg.mpc(protocol)
        for label, name, options in cfg.policies:
            policy, budget = build_policy(cfg, name, protocol, len(prompt_ids),
                                          loaded.model.cfg.num_kv_heads, options)
            plain = mpc.SecureSession(mpc.make_backend("xla"), loaded.model, loaded.params,
                                      policy).generate(prompt_ids, cfg.max_new_tokens)
            backend = mpc.make_backend(cfg.backend, mpc_cfg)
            t0 = time.perf_counter()
            secure = mpc.SecureSession(backend, loaded.model, loaded.params, policy).generate(
                prompt_ids, cfg.max_new_tokens)
            total = time.perf_counter() - t0
            decode = [s for s in secure.steps if s.phase == "decode" and s.cost is not None]
            match = secure.tokens == plain.tokens
            print(f"  {protocol} {label}: secure {secure.tokens}\n  {' ' * len(protocol)} {label}: "
                  f"plain  {plain.tokens} -> {'SAME' if match else 'DIFFERENT'} tokens; "
                  f"text {tok.decode(secure.tokens)!r}")
            for step in secure.steps:
                if step.cost is not None:
                    harness.record("generate", protocol, mpc_cfg, step.cost, step.wall_s,
                                   policy=label, seq_len=step.position,
                                   num_layers=loaded.model.cfg.num_layers,
                                   extra={"phase": step.phase,
                                          "budget": P.budget_record(budget)})
            summary = harness.add({
                "bench": "generate_summary", "policy": label, "protocol": protocol,
                "model": cfg.model, "prompt_tokens": len(prompt_ids),
                "tokens_secure": secure.tokens, "tokens_plain": plain.tokens,
                "same_tokens": match, "text": tok.decode(secure.tokens),
                "total_s": round(total, 2), "compile_s": round(secure.compile_s, 2),
                "decode_s_per_token": round(float(np.mean([s.wall_s for s in decode])), 3)
                if decode else None,
                "decode_comm_bytes_per_token": int(np.mean(
                    [mpc.cost_fields(s.cost, 0, mpc_cfg.parties)["comm_bytes"] for s in decode]))
                if decode and mpc_cfg else None,
                "git_commit": git_commit()})
            print(f"  summary: {summary}")
