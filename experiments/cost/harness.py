"""The cost harness: a typed CostConfig built from the flags, the loop over protocols and
backends, the records (every party's cost, printed and appended to a results file) and the
registry of benchmarks (`@benchmark(name)`; the benchmarks live in decode.py and
primitives.py)."""
from __future__ import annotations

import dataclasses
import pathlib

from experiments.common import git_commit, write_jsonl
from mpcache_jax.policies import make_policy
from runtime import mpc


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
    lm_head: bool = True             # decode bench: cost the LM head + argmax once
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
                    if self.bench == "decode":   # now, not mid-run
                        for T in self.seq_lens:
                            policy.check_prompt(T)

    @classmethod
    def from_flags(cls, FLAGS) -> "CostConfig":
        from experiments.options import parse_budget, parse_variants
        if FLAGS["budgets"].present and len(FLAGS.budgets) != 1:
            raise ValueError(f"--experiment=mpc_cost costs one budget; --budgets="
                             f"{','.join(FLAGS.budgets)}")
        fields = {f.name for f in dataclasses.fields(cls)} - {
            "bench", "protocols", "policies", "budget", "share_from", "seq_lens", "topk_sizes",
            "repeats", "decode_steps", "layers", "lm_head"}
        try:
            layers = tuple(int(i) for i in FLAGS.layers) if FLAGS.layers else None
        except ValueError:
            raise ValueError(f"--layers={','.join(FLAGS.layers)} must list layer indices, "
                             f"e.g. --layers=4,5,10,11") from None
        return cls(layers=layers, bench=FLAGS.mpc_bench,
                   protocols=protocols_of(FLAGS.backend, FLAGS.protocol, FLAGS.runtime_config),
                   policies=tuple(parse_variants(FLAGS.policies, FLAGS.variants)),
                   budget=parse_budget(FLAGS.budgets[0]),
                   share_from=FLAGS.mpc_share_from, repeats=FLAGS.mpc_repeats,
                   decode_steps=FLAGS.mpc_decode_steps, lm_head=FLAGS.mpc_lm_head,
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
        print_row(rec)
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

def print_row(rec):
    print(f"  {rec['protocol']:7s} T={rec['seq_len']:5d} {rec['policy']:16s} "
          f"comm {rec['comm_bytes'] / 1e6:10.2f} MB  msgs {rec['messages']:7d}  "
          f"LAN net {rec['lan_latency_s']:7.3f} s  WAN net {rec['wan_latency_s']:7.2f} s  "
          f"compute {rec['compute_s']:7.2f} s  wall {rec['wall_s']:7.2f} s", flush=True)
