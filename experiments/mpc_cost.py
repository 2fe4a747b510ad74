"""`--experiment=mpc_cost`: cost of secure decode steps (and of their building blocks) under MPC.

Every benchmark is a function registered in BENCHMARKS (`--mpc_bench=NAME`; `@benchmark`)
that takes a typed CostConfig (built once from the flags, or directly in code) and a Harness
(the loop over protocols and backends, and the records: every party's cost, printed and
appended to DIR/results.jsonl.partial, renamed to results.jsonl when the run has finished).

  decode        per-token decode cost of each policy at each cache length (Figure 10 / 11
                analogs, the oracle floor): the decoder layers of one decode step
                (`--num_layers` of them) under SPU on a cache prefilled in plaintext (cost does
                not depend on values) and secret-shared; the policy-independent LM head +
                argmax is measured once as `lm_head`. `no_cache` recomputes prompt + generated
                tokens through the layers each step; `oracle` (a registered policy) attends to
                exactly the budgeted prompt tokens chosen publicly and for free.
  gather        Table 2: token-level vs cluster-level one-hot gathers of 25% of the keys.
  gather_dtype  one-hot gather as fixed-point, cast, integer-from-comparison, gather_rows.
  repeat_noise  the same program run again reports the same bytes summed over the parties.
  topk          lax.top_k vs pairwise-rank top-k on [rows, N] secret scores (Appendix B.5).
  norm          one RMSNorm scale: the shipped one-rsqrt form vs two rsqrts.
  rounds        the softmax row max and q . K in fewer rounds (alternatives, not shipped).
  matmul        one secret matmul per shape and operand type (time vs output size vs MACs).
  generate      secure greedy generation of --prompt vs the plaintext run (per-step costs).
Each run prints the ratios measured in that run and writes DIR/results.jsonl.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import ensure_dir, flag_values, git_commit, write_jsonl
from runtime import mpc
from mpcache_jax import primitives as P
from runtime.generate import apply_policy
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
RANK_ROWS_MEASURED = 32   # rows ranked per call in that measurement (--topk_rows)
ORACLE = "oracle"
NEW_SLOTS = 8  # room for generated tokens in every policy's cache


def mpc_config(settings, protocol: str) -> mpc.MPCConfig:
    """The SPU configuration of `protocol` (settings: anything with a `runtime_config` JSON
    file/text attribute, the flags or a CostConfig)."""
    if settings.runtime_config:
        return mpc.from_json(settings.runtime_config, protocol=protocol)
    return mpc.MPCConfig(protocol=protocol)


def protocols_of(backend: str, protocol: str | None, runtime_config: str | None) -> tuple:
    if backend == "xla":
        return ("PLAINTEXT",)
    if protocol:
        return tuple(p.strip().upper() for p in protocol.split(",") if p.strip())
    if runtime_config:
        return (mpc.from_json(runtime_config).protocol,)
    return ("ABY3",)


@dataclasses.dataclass(frozen=True)
class CostConfig:
    """Everything a cost benchmark reads (CostConfig.from_flags maps the CLI onto it).

    policies: (label, registered name, options) per costed policy (--policies + --variants);
    budget: ratio of the prompt or token count; protocols: validated SPU protocols
    ("PLAINTEXT" on the xla backend)."""

    bench: str = "decode"
    backend: str = "spu_sim"
    protocols: tuple = ("ABY3",)
    runtime_config: str | None = None
    model: str = "llama-tiny"
    weights_path: str | None = None
    cache_dir: str | None = None
    seed: int = 0
    num_layers: int | None = None
    layers: tuple | None = None      # these layers instead of the first num_layers
    activation_impl: str = "exact"
    policies: tuple = (("full", "full", {}),)
    budget: float | int = 0.1
    seq_lens: tuple = (1024,)
    topk_method: str = "auto"
    share_from: int | None = None
    softmax: str = "reciprocal"
    no_cache_max_len: int = 512
    repeats: int = 1
    decode_steps: int = 1
    gather_tokens: int = 1024
    gather_clusters: int = 64
    gather_dim: int = 128
    topk_rows: int = 32
    topk_sizes: tuple = (16, 32, 64, 128, 256)
    prompt: str = "What is the capital of France?"
    system_prompt: str | None = None
    chat: bool = True
    max_new_tokens: int = 8

    def __post_init__(self):
        if self.bench not in BENCHMARKS:
            raise ValueError(f"--mpc_bench={self.bench!r} is not a benchmark; use one of "
                             f"{', '.join(BENCHMARKS)}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"--mpc_repeats={self.repeats!r} must be an integer >= 1")
        if not isinstance(self.decode_steps, int) or self.decode_steps < 1:
            raise ValueError(f"--mpc_decode_steps={self.decode_steps!r} must be an integer >= 1")
        if self.decode_steps > 1 and self.repeats > 1:
            raise ValueError("--mpc_repeats repeats one decode step; with --mpc_decode_steps="
                             f"{self.decode_steps} every step is measured once: drop one of them")
        if self.layers is not None and self.num_layers is not None:
            raise ValueError(f"--layers={','.join(map(str, self.layers))} and --num_layers="
                             f"{self.num_layers} both pick layers: give one")
        if self.backend not in mpc.BACKENDS:
            raise ValueError(f"--backend={self.backend!r}; use one of {mpc.BACKENDS}")
        for p in self.protocols:   # every protocol before any work
            if p != "PLAINTEXT":
                mpc_config(self, p)
        if self.bench in ("decode", "generate"):
            for label, name, options in self.policies:
                if name not in ("full", "no_cache"):
                    policy = make_policy(name, budget=self.budget, **(options or {}))
                    check = getattr(policy, "check_prompt", None)
                    if self.bench == "decode" and check:   # now, not mid-run
                        for T in self.seq_lens:
                            check(T)

    @classmethod
    def from_flags(cls, FLAGS) -> "CostConfig":
        from experiments.accuracy import parse_budget, parse_variants
        if FLAGS["budgets"].present and len(FLAGS.budgets) != 1:
            raise ValueError(f"--experiment=mpc_cost costs one budget; --budgets="
                             f"{','.join(FLAGS.budgets)}")
        fields = {f.name for f in dataclasses.fields(cls)} - {
            "bench", "protocols", "policies", "budget", "share_from", "seq_lens", "topk_sizes",
            "repeats", "decode_steps", "layers"}
        try:
            layers = tuple(int(i) for i in FLAGS.layers) if FLAGS.layers else None
        except ValueError:
            raise ValueError(f"--layers={','.join(FLAGS.layers)} must list layer indices, "
                             f"e.g. --layers=4,5,10,11") from None
        return cls(layers=layers, bench=FLAGS.mpc_bench,
                   protocols=protocols_of(FLAGS.backend, FLAGS.protocol, FLAGS.runtime_config),
                   policies=tuple(parse_variants(FLAGS)), budget=parse_budget(FLAGS.budgets[0]),
                   share_from=FLAGS.mpc_share_from, repeats=FLAGS.mpc_repeats,
                   decode_steps=FLAGS.mpc_decode_steps,
                   seq_lens=tuple(int(t) for t in FLAGS.seq_lens),
                   topk_sizes=tuple(int(n) for n in FLAGS.topk_sizes),
                   **{name: getattr(FLAGS, name) for name in fields})

    def mpc(self, protocol: str) -> mpc.MPCConfig | None:
        return None if self.backend == "xla" else mpc_config(self, protocol)


class Harness:
    """The protocol/backend loop and the records of one cost run.

        for protocol, mpc_cfg, backend in harness.backends(): ...
            harness.record("topk", protocol, mpc_cfg, cost, wall, policy=..., seq_len=...)
    """

    def __init__(self, cfg: CostConfig, out_path: pathlib.Path):
        self.cfg, self.out_path, self.records = cfg, out_path, []

    def backends(self):
        """(protocol, its MPCConfig or None on xla, a fresh backend) per protocol."""
        for protocol in self.cfg.protocols:
            mpc_cfg = self.cfg.mpc(protocol)
            yield protocol, mpc_cfg, mpc.make_backend(self.cfg.backend, mpc_cfg)

    def record(self, bench: str, protocol: str, mpc_cfg, cost, wall: float, *, policy: str,
               seq_len: int, model: str | None = None, num_layers: int = 0,
               extra: dict | None = None) -> dict:
        """One measured program: every party's cost (mpc.cost_fields: comm_bytes = bytes sent
        summed over the parties, per-party bytes / actions / compute; zeros on plaintext),
        written and printed."""
        parties = mpc_cfg.parties if mpc_cfg else 1
        fields = (mpc.cost_fields(cost, wall, parties) if cost is not None else
                  {"comm_bytes": 0, "messages": 0, "party_send_bytes": [], "party_recv_bytes": [],
                   "party_send_actions": [], "party_compute_s": [], "party_attribution": "",
                   "wall_s": round(wall, 4), "compute_s": wall,
                   "lan_latency_s": 0.0, "wan_latency_s": 0.0, "lan_total_s": wall,
                   "wan_total_s": wall, "phase_breakdown": {}, "ops": {}})
        return self.record_fields(bench, protocol, mpc_cfg, fields, policy=policy,
                                  seq_len=seq_len, model=model, num_layers=num_layers,
                                  extra=extra)

    def record_fields(self, bench: str, protocol: str, mpc_cfg, fields: dict, *, policy: str,
                      seq_len: int, model: str | None = None, num_layers: int = 0,
                      extra: dict | None = None) -> dict:
        """`record` from cost fields already computed (e.g. averaged over decode steps)."""
        rec = {"bench": bench, "policy": policy, "protocol": protocol,
               "parties": mpc_cfg.parties if mpc_cfg else 1, "seq_len": seq_len,
               "model": model or self.cfg.model, "num_layers": num_layers, **fields, **(extra or {}),
               "runtime_config": mpc_cfg.runtime_json() if mpc_cfg else None,
               "git_commit": git_commit()}
        self.add(rec)
        _print_row(rec)
        return rec

    def add(self, rec: dict) -> dict:
        """Any other record (summaries) into the same results file."""
        self.records.append(rec)
        write_jsonl(self.out_path, [rec], append=True)
        return rec


BENCHMARKS: dict = {}


def benchmark(name: str):
    """Register `fn(cfg: CostConfig, harness: Harness)` as `--mpc_bench=name`."""
    def register(fn):
        BENCHMARKS[name] = fn
        return fn
    return register


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
        rows, candidates = RANK_ROWS_MEASURED, prompt_len
        if hasattr(policy, "ranked_rows"):
            rows, candidates = policy.ranked_rows(prompt_len, num_kv_heads)
        changes["topk_method"] = topk_method_for(cfg, protocol, rows, candidates)
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
    head_params = {k: loaded.params[k] for k in ("final_norm", "lm_head")}
    del loaded
    rng = np.random.RandomState(cfg.seed)
    layers = {"num_layers": cfgm.num_layers}
    picked = {"layers": list(cfg.layers)} if cfg.layers else {}
    new_slots = max(NEW_SLOTS, cfg.decode_steps)
    for protocol, mpc_cfg, backend in harness.backends():
        # LM head + argmax: policy independent, once per protocol.
        head_model = Model(full_cfg)
        head = backend.compile(mpc.head_fn(head_model), (head_params,
                                                         np.zeros((1, cfgm.hidden_size), np.float32)),
                               (mpc.SECRET, mpc.SECRET))
        hidden = backend.share(rng.randn(1, cfgm.hidden_size).astype(np.float32) * 0.1, mpc.SECRET)
        _, cost, wall = backend.run(head, backend.share(head_params, mpc.SECRET, owner=mpc.SERVER),
                                    hidden)
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
                extra = {"scope": "decoder_layers", "budget": budget, **picked,
                         "topk_method": getattr(policy, "topk_method", None),
                         "share_from": getattr(policy, "share_from", None),
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


def median_run(run, repeats: int, fields_of=mpc.cost_fields):
    """Run a program `repeats` times (run() -> (RunCost or None, wall)); returns the cost and
    wall of the run with the median compute, and every run's compute (None for one run).
    Bytes and messages are a property of the program: a repeat that changes them is an
    error, not noise."""
    results = [run() for _ in range(repeats)]
    if repeats == 1 or results[0][0] is None:
        return results[0][0], results[0][1], None
    fields = [fields_of(*r) for r in results]
    counts = {(f["comm_bytes"], f["messages"]) for f in fields}
    if len(counts) != 1:
        raise RuntimeError(f"the same program reported different costs on repeated runs: "
                           f"{sorted(counts)}")
    order = sorted(range(repeats), key=lambda i: fields[i]["compute_s"])
    mid = order[repeats // 2]
    return results[mid][0], results[mid][1], [f["compute_s"] for f in fields]


def _print_row(rec):
    print(f"  {rec['protocol']:7s} T={rec['seq_len']:5d} {rec['policy']:16s} "
          f"comm {rec['comm_bytes'] / 1e6:10.2f} MB  msgs {rec['messages']:7d}  "
          f"LAN net {rec['lan_latency_s']:7.3f} s  WAN net {rec['wan_latency_s']:7.2f} s  "
          f"compute {rec['compute_s']:7.2f} s  wall {rec['wall_s']:7.2f} s", flush=True)


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
                print(f"    per party MB " + " ".join(
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
    """Issue 12 item 2: two ways to cut the rounds of the attention every policy runs, on one
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
                                   extra={"phase": step.phase, "budget": budget})
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


def run(FLAGS):
    cfg = CostConfig.from_flags(FLAGS)
    out_dir = ensure_dir(FLAGS.output_dir or "results/mpc_cost")
    out_path = out_dir / "results.jsonl"
    # Records accumulate in results.jsonl.partial; an earlier run's results.jsonl stays intact
    # until this run has finished and replaces it.
    partial = out_dir / "results.jsonl.partial"
    partial.unlink(missing_ok=True)
    print(f"mpc_cost {cfg.bench}: backend={cfg.backend} protocols={list(cfg.protocols)} "
          f"model={cfg.model} num_layers={cfg.num_layers} -> {out_path}")
    harness = Harness(cfg, partial)
    BENCHMARKS[cfg.bench](cfg, harness)
    write_jsonl(out_dir / "config.jsonl", [{"flags": flag_values(FLAGS), "git_commit": git_commit()}])
    if partial.exists():
        os.replace(partial, out_path)
    print(f"{len(harness.records)} records -> {out_path}")
