"""`--experiment=mpc_cost`: cost of secure decode steps (and of their building blocks) under MPC.

Every benchmark is a function registered in BENCHMARKS (`--mpc_bench=NAME`; `@benchmark`;
the harness and the benchmarks live in experiments/cost/) that takes a typed CostConfig (built once from the flags, or directly in code) and a Harness
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

import os

from experiments.common import ensure_dir, flag_values, git_commit, write_jsonl
from experiments.cost import BENCHMARKS, CostConfig, Harness


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
