"""PrefixKV: a per-layer prompt budget from each layer's importance distribution.

Importance of prompt token n in layer l: the attention it receives summed over all prompt
queries, averaged over heads; normalized to sum 1, sorted in descending order and accumulated
it gives the layer's Lorenz curve P_l(o) (share of the importance held by the top o of the
tokens). One retention ratio p is binary-searched so that the prefix sizes
R_l = min{o : P_l(o) >= p} sum to the global budget (L x B tokens); layer l then keeps its
ceil(R_l T) most important tokens (at least the 4 start tokens and the last 32, the recent
window the method keeps while decoding, which are always kept). Per-layer counts must be static, so the curves are calibrated offline on sample
prompts (`calibrate`; the CLI is experiments/prefixkv_calibrate.py), saved as JSON and applied through `calibration=PATH`.
Without a calibration every layer keeps B tokens (same selection rule). The per-layer counts
are a `LorenzCurves` layer budget, the component any prompt eviction policy can hold:
`mpcache_prefixkv` is MPCache's static eviction holding the same one.

    mpcache prefixkv-calibrate --model=smollm2-135m --out=results/prefixkv/smollm2-135m.json
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np

from mpcache_jax import extent as E
from mpcache_jax.policies.base import LayerBudget, PromptEvictionPolicy, causal_attention_mass
from mpcache_jax.policies.mpcache import MPCache

CALIBRATION_FORMAT = "prefixkv-lorenz-v1"


def lorenz_curve(importance: np.ndarray, grid: int) -> np.ndarray:
    """importance: [T] >= 0 -> [grid + 1]: share of the total held by the top o*T tokens at
    o = 0, 1/grid, ..., 1 (linear between whole token counts)."""
    share = np.sort(np.asarray(importance, np.float64))[::-1]
    cumulative = np.concatenate([[0.0], np.cumsum(share) / max(share.sum(), 1e-30)])
    T = len(share)
    curve = np.interp(np.linspace(0.0, 1.0, grid + 1) * T, np.arange(T + 1), cumulative)
    curve[-1] = 1.0
    return np.minimum(curve, 1.0)


def prefix_ratio(curve: np.ndarray, p: float) -> float:
    """min {o : P(o) >= p} on a curve sampled at o = i / grid (linear in between)."""
    grid = len(curve) - 1
    i = int(np.searchsorted(curve, p, side="left"))
    if i == 0:
        return 0.0
    if i > grid:
        return 1.0
    return (i - 1 + (p - curve[i - 1]) / (curve[i] - curve[i - 1])) / grid


def counts_at(curves, p: float, prompt_len: int, min_keep: int) -> list[int]:
    return [int(min(prompt_len, max(min_keep, math.ceil(prefix_ratio(c, p) * prompt_len - 1e-9))))
            for c in curves]


def search_retention(curves, total: int, prompt_len: int, min_keep: int, iters: int = 60
                     ) -> tuple[float, list[int]]:
    """Binary search for the retention ratio p whose per-layer counts sum to at most `total`,
    as close as possible. curves: [L, grid + 1] -> (p, counts [L])."""
    low, high = 0.0, 1.0
    for _ in range(iters):
        mid = 0.5 * (low + high)
        if sum(counts_at(curves, mid, prompt_len, min_keep)) <= total:
            low = mid
        else:
            high = mid
    return low, counts_at(curves, low, prompt_len, min_keep)


def load_curves(path: str) -> tuple[tuple[float, ...], ...]:
    data = json.loads(pathlib.Path(path).read_text())
    if data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{path} is not a PrefixKV calibration ({CALIBRATION_FORMAT}); make one "
                         "with `mpcache prefixkv-calibrate --out=PATH`")
    return tuple(tuple(float(x) for x in curve) for curve in data["curves"])


@dataclasses.dataclass(frozen=True)
class LorenzCurves(LayerBudget):
    """PrefixKV's per-layer counts: one retention ratio for every layer's Lorenz curve, binary
    searched so the counts sum to the layers' total budget. curves: [L][grid + 1] shares (per
    layer, rising from 0 to 1); floor: the fewest tokens a layer keeps (capped at the
    budget)."""

    curves: tuple = ()
    floor: int = 1

    def __post_init__(self):
        for i, c in enumerate(self.curves):
            a = np.asarray(c)
            if a.ndim != 1 or len(a) < 2 or np.any(np.diff(a) < -1e-9) or abs(a[-1] - 1) > 1e-6:
                raise ValueError(f"curve of layer {i} must rise from 0 to 1 on a grid")

    def counts(self, num_layers, prompt_len, budget):
        if budget == prompt_len:
            return (budget,) * num_layers
        if len(self.curves) != num_layers:
            raise ValueError(f"the PrefixKV calibration has {len(self.curves)} layers but the model "
                             f"has {num_layers}: calibrate on this model")
        _, counts = search_retention(np.asarray(self.curves), num_layers * budget, prompt_len,
                                     min(self.floor, budget))
        return tuple(counts)


def curves_budget(calibration: str | None, curves: tuple | None, floor: int):
    """(curves, layer budget) of a policy given a calibration file or the curves themselves;
    (None, None) without either (every layer keeps the budget)."""
    if calibration is not None and curves is None:
        curves = load_curves(calibration)
    return curves, (None if curves is None else LorenzCurves(curves, floor))


@dataclasses.dataclass(frozen=True)
class PrefixKV(PromptEvictionPolicy):
    """calibration: path of a JSON written by `calibrate`; curves: the same Lorenz curves as a
    tuple of per-layer tuples (filled from the file; static and hashable)."""

    name: str = "prefixkv"
    needs_queries: bool = True
    calibration: str | None = None
    curves: tuple | None = None
    num_sinks: int = 4
    # The recent window the method keeps while decoding ("prune at a fixed distance from the
    # latest token"). Without it the column sums, which favour early tokens (more queries see
    # them), dropped the end of the prompt (the question) and the outputs with it: agreement
    # with `full` 0.00, KL 2-4 nats at 10%, uniform or calibrated (results/prefixkv_diag).
    num_recent: int = 32

    def __post_init__(self):
        super().__post_init__()
        if self.num_sinks < 0 or self.num_recent < 1:
            raise ValueError(f"num_sinks={self.num_sinks} must be >= 0 and num_recent="
                             f"{self.num_recent} >= 1 (the last prompt token is always kept)")
        # the layer budget follows the curves (a start token more than the sinks at least)
        curves, layers = curves_budget(self.calibration, self.curves, self.num_sinks + 1)
        object.__setattr__(self, "curves", curves)
        object.__setattr__(self, "layer_budget", layers)

    def keep_scores(self, layer, q, k, extent, carry):
        length = None if extent.static else extent.length
        return jnp.mean(causal_attention_mass(q, k, length=length), axis=(0, 1)), carry  # [T]

    def forced_keep(self, extent, count):
        if extent.static:
            sinks = min(self.num_sinks, count - 1)
            recent = min(self.num_recent, count - sinks)
        else:
            sinks = jnp.minimum(self.num_sinks, count - 1)
            recent = jnp.minimum(self.num_recent, count - sinks)
        return E.union(E.iota_lt(extent.capacity, sinks), extent.last_tokens(recent))


@dataclasses.dataclass(frozen=True)
class MPCachePrefixKV(MPCache):
    """MPCache's static eviction (votes of its last prompt queries, sinks and recent tokens
    kept, layer sharing of the votes) holding PrefixKV's calibrated per-layer budget instead
    of one budget for every layer. Static only: dynamic selection assumes one budget per
    layer. calibration / curves: as PrefixKV's."""

    name: str = "mpcache_prefixkv"
    static: bool = True
    dynamic: bool = False
    share_group: int = 2        # the paper's static eviction: votes shared by layer pairs
    topk_method: str = "lax"
    calibration: str | None = None
    curves: tuple | None = None

    def __post_init__(self):
        if self.dynamic:
            raise ValueError("mpcache_prefixkv is static eviction only (dynamic=False)")
        # PrefixKV's floor: its 4 start tokens and one more
        curves, layers = curves_budget(self.calibration, self.curves, PrefixKV.num_sinks + 1)
        object.__setattr__(self, "curves", curves)
        object.__setattr__(self, "layer_budget", layers)
        super().__post_init__()


def layer_importance(queries, cache, prompt_len: int) -> np.ndarray:
    """[L, T] column-sum attention averaged over heads, from a prefill with return_queries."""
    rows = []
    for q, layer in zip(queries, cache):
        mass = causal_attention_mass(q, layer.k[:, :prompt_len])
        rows.append(np.asarray(jnp.mean(mass, axis=(0, 1))))
    return np.stack(rows)


def calibrate(model, params, prompts, grid: int = 100) -> dict:
    """Average Lorenz curves per layer over sample prompts (lists of token ids)."""
    curves = []
    for ids in prompts:
        _, cache, aux = model.prefill(params, ids, model.init_cache(len(ids)), return_queries=True)
        imp = layer_importance(aux.queries, cache, len(ids))
        curves.append([lorenz_curve(row, grid) for row in imp])
    mean = np.mean(np.asarray(curves), axis=0)
    mean[:, -1] = 1.0
    return {"format": CALIBRATION_FORMAT, "model": model.cfg.name, "grid": grid,
            "num_layers": int(mean.shape[0]), "prompt_tokens": [len(p) for p in prompts],
            "curves": np.round(mean, 6).tolist()}


REGISTRY = {"prefixkv": (PrefixKV, {}), "mpcache_prefixkv": (MPCachePrefixKV, {})}
