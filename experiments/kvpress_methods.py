"""The methods the kvpress cross-check compares (experiments/kvpress_crosscheck.py): each
kvpress press beside our registered policy and its variants, and kvpress's own scoring rules
re-implemented on our model (diagnostic variants, not registered policies)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from mpcache_jax.policies import make_policy
from mpcache_jax.policies.base import (GivenCounts, causal_attention_mass,
                                       window_attention_mass)
from mpcache_jax.policies.h2o import H2O
from mpcache_jax.policies.snapkv import SnapKV

# --- kvpress's rules on our model (diagnostic variants, not registered policies) ------------

def avg_pool_1d(x: jnp.ndarray, kernel: int) -> jnp.ndarray:
    """torch's avg_pool1d(kernel, stride 1, padding kernel // 2) with count_include_pad: the
    zero-padded window sum over the last axis divided by `kernel`."""
    half = kernel // 2
    T = x.shape[-1]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, half)])
    return sum(padded[..., i:i + T] for i in range(kernel)) / kernel


def static_length(extent) -> int:
    """The prompt length handed to keep_scores: an int (static-length policy API) or an
    mpcache_jax.extent.Extent (bucketing API); the diagnostic rules need a static length."""
    if isinstance(extent, (int, np.integer)):
        return int(extent)
    if not extent.static:
        raise ValueError("the kvpress-rule diagnostics support static prompt lengths only")
    return int(extent.length)


@dataclasses.dataclass(frozen=True)
class KvpressSnapKVRule(SnapKV):
    """kvpress's SnapKVPress / PyramidKVPress selection: window votes average-pooled (ours:
    max-pooled), the window kept, and the given kept count per layer (window included)."""

    name: str = "kvpress_snapkv_rule"
    counts: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "layer_budget", GivenCounts(tuple(self.counts)))
        super().__post_init__()

    def keep_scores(self, layer, q, k, extent, carry):
        prompt_len = static_length(extent)
        window = min(self.window, prompt_len)
        votes = jnp.sum(window_attention_mass(q, k, window), axis=1)          # [H_kv, T]
        prefix = (np.arange(prompt_len) < prompt_len - window).astype(np.float32)
        return avg_pool_1d(votes * prefix, self.kernel), carry


@dataclasses.dataclass(frozen=True)
class KvpressObservedAttentionRule(H2O):
    """kvpress's ObservedAttentionPress: attention received averaged over the queries that
    can see the token (ours: summed), no protected recent window, no eviction while decoding
    (use with decode_window=None)."""

    name: str = "kvpress_observed_attention_rule"

    def keep_scores(self, layer, q, k, extent, carry):
        prompt_len = static_length(extent)
        received = jnp.sum(causal_attention_mass(q, k), axis=1)              # [H_kv, T]
        return received / np.arange(prompt_len, 0, -1, dtype=np.float32), carry

    def forced_keep(self, extent, count):
        return None


# --- the methods both sides implement ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Method:
    """One method: the kvpress press (+ options) and our variants.

    variants(budget, counts) -> [(label, policy)]; counts = kvpress's kept count per layer for
    this prompt and budget (a tuple of L ints), known after the kvpress side ran.
    """

    name: str
    press: str
    press_options: dict
    variants: Callable[[float, tuple], list]


def _uniform(counts) -> int:
    if len(set(counts)) != 1:
        raise ValueError(f"expected one kept count for every layer, got {sorted(set(counts))}")
    return int(counts[0])


def _pyramid_with_kvpress_hp(budget: float, counts, window: int):
    """Ours closest to kvpress's PyramidKVPress: its window and kernel; where kvpress fell back
    to one count for every layer, our SnapKV with that count, else our pyramid."""
    if len(set(counts)) == 1:
        return make_policy("snapkv", int(counts[0]), window=window, kernel=5)
    return make_policy("pyramidkv", budget, window=window, kernel=5)


METHODS = (
    Method("streaming_llm", "StreamingLLMPress", {}, lambda b, c: [
        ("ours", make_policy("streaming_llm", b)),
        ("ours+kvp.hp", make_policy("streaming_llm", _uniform(c), num_sinks=4)),
    ]),
    Method("snapkv", "SnapKVPress", {}, lambda b, c: [
        ("ours", make_policy("snapkv", b)),
        ("ours+kvp.hp", make_policy("snapkv", _uniform(c), window=64, kernel=5)),
        ("kvpress rule", KvpressSnapKVRule(budget=_uniform(c), window=64, kernel=5,
                                           counts=tuple(c))),
    ]),
    Method("tova", "TOVAPress", {}, lambda b, c: [
        ("ours", make_policy("tova", b)),
        ("ours+kvp.hp", make_policy("tova", _uniform(c), decode_window=None)),
    ]),
    Method("h2o", "ObservedAttentionPress", {}, lambda b, c: [
        ("ours", make_policy("h2o", b)),
        ("ours+kvp.hp", make_policy("h2o", _uniform(c), decode_window=None)),
        ("kvpress rule", KvpressObservedAttentionRule(budget=_uniform(c), decode_window=None)),
    ]),
    # kvpress's PyramidKVPress falls back to uniform SnapKV budgets unless the top layer's
    # share (kept / beta) reaches its window: never at <= 1280 kept tokens with window 64.
    Method("pyramidkv", "PyramidKVPress", {}, lambda b, c: [
        ("ours", make_policy("pyramidkv", b)),
        ("ours+kvp.hp", _pyramid_with_kvpress_hp(b, c, window=64)),
        ("kvpress rule", KvpressSnapKVRule(budget=max(c), window=64, kernel=5,
                                           counts=tuple(c))),
    ]),
    # With a 4-token window kvpress's pyramid does engage at 10-20% of ~1k tokens.
    Method("pyramidkv_w4", "PyramidKVPress", {"window_size": 4}, lambda b, c: [
        ("ours+kvp.hp", _pyramid_with_kvpress_hp(b, c, window=4)),
        ("kvpress rule", KvpressSnapKVRule(budget=max(c), window=4, kernel=5,
                                           counts=tuple(c))),
    ]),
)
METHOD_NAMES = tuple(m.name for m in METHODS)


def run_key(method: Method, budget: float) -> str:
    return f"{method.name}@{budget:g}"
