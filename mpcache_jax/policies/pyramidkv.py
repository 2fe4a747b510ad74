"""PyramidKV: SnapKV's selection with a pyramid of per-layer budgets (more tokens in lower
layers). Every layer keeps the observation window (w = min(window, B) tokens); the rest,
R = B - w tokens per layer on average, is spread as a pyramid: R / beta in the top layer,
2R - R / beta in the bottom one, linear in between (beta = 20, as the authors' code).
Counts are rounded down and capped at the prompt length, so their mean never exceeds B.
The window (32) and kernel (7, max-pool) are SnapKV's here; the authors' scripts vary them.
The pyramid is a layer budget (`Pyramid`) SnapKV holds: the scoring is SnapKV's own.
"""
from __future__ import annotations

import dataclasses
import math

from mpcache_jax.policies.base import LayerBudget
from mpcache_jax.policies.snapkv import SnapKV


@dataclasses.dataclass(frozen=True)
class Pyramid(LayerBudget):
    """Per-layer counts falling linearly from the bottom layer to the top one; every layer
    keeps `window` tokens (capped at the budget) besides its share of the rest."""

    beta: float = 20.0
    window: int = 32

    def __post_init__(self):
        if not self.beta >= 1.0:
            raise ValueError(f"beta={self.beta} must be >= 1 (top layer keeps budget / beta)")

    def counts(self, num_layers, prompt_len, budget):
        if budget == prompt_len or num_layers == 1:
            return (budget,) * num_layers
        window = min(self.window, budget)
        rest = budget - window
        top = rest / self.beta
        bottom = 2 * rest - top
        step = (bottom - top) / (num_layers - 1)
        return tuple(min(prompt_len, window + math.floor(bottom - l * step))
                     for l in range(num_layers))


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV holding a `Pyramid` of its window (beta: the pyramid's top-layer divisor)."""

    name: str = "pyramidkv"
    beta: float = 20.0

    def __post_init__(self):
        object.__setattr__(self, "layer_budget", Pyramid(self.beta, self.window))
        super().__post_init__()


REGISTRY = {"pyramidkv": (PyramidKV, {})}
