"""Baselines that select cached tokens per decode step (LongCache, Quest, InfLLM, ArkVale,
PQCache). Each policy lives in its own module; this module collects their registry lines.
"""
from __future__ import annotations

from mpcache_jax.policies.arkvale import ArkVale
from mpcache_jax.policies.infllm import InfLLM
from mpcache_jax.policies.longcache import LongCache
from mpcache_jax.policies.pqcache import PQCache
from mpcache_jax.policies.quest import Quest

REGISTRY: dict = {
    "longcache": (LongCache, {}),
    "quest": (Quest, {}),
    "infllm": (InfLLM, {}),
    "arkvale": (ArkVale, {}),
    "arkvale_mad": (ArkVale, {"bound": "mad"}),
    "pqcache": (PQCache, {}),
}
