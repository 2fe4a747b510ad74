"""MPC cost benchmarks (`--experiment=mpc_cost`, run by experiments/mpc_cost.py).

harness.py: CostConfig, the protocol/backend loop and records, the registry BENCHMARKS.
decode.py: the decode step of each policy and secure generation on a real model.
primitives.py: gathers, top-k, matmuls, the norm and round-cutting alternatives.
Importing the package registers every benchmark.
"""
from experiments.cost import decode, primitives  # noqa: F401  (registers the benchmarks)
from experiments.cost.harness import BENCHMARKS, CostConfig, Harness, benchmark

__all__ = ["BENCHMARKS", "CostConfig", "Harness", "benchmark", "decode", "primitives"]
