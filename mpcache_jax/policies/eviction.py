"""Baselines that evict prompt tokens by attention statistics: H2O and TOVA (also while
decoding), SnapKV, PrefixKV and PyramidKV (per-layer budgets). Each policy is a small module;
this module collects their registry lines.
"""
from __future__ import annotations

from mpcache_jax.policies import h2o, prefixkv, pyramidkv, snapkv, tova

REGISTRY: dict = {**h2o.REGISTRY, **tova.REGISTRY, **snapkv.REGISTRY, **prefixkv.REGISTRY,
                  **pyramidkv.REGISTRY}
