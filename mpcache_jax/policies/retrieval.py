"""Baselines that select cached tokens per decode step (LongCache, Quest, InfLLM, ArkVale,
PQCache). Each policy lives in its own module; this module collects their registry lines.

Two registered settings differ from the classes' (the originals') defaults, because every
registered policy follows the project's budget rule at this project's budgets (5-20% of
prompts of a few hundred to a few thousand tokens):
- quest: dense_layers=0. Quest's first 2 dense layers attend to every prompt token, above any
  budget; `make_policy("quest", b, dense_layers=2)` gives the original.
- infllm: blocks of 16 tokens. A 128-token block plus the initial and local tokens does not
  fit budgets under ~170 tokens; `page_size=128` gives the original for long prompts.
"""
from __future__ import annotations

from mpcache_jax.policies.arkvale import ArkVale
from mpcache_jax.policies.infllm import InfLLM
from mpcache_jax.policies.longcache import LongCache
from mpcache_jax.policies.pqcache import PQCache
from mpcache_jax.policies.quest import Quest

REGISTRY: dict = {
    "longcache": (LongCache, {}),
    "quest": (Quest, {"dense_layers": 0}),
    "infllm": (InfLLM, {"page_size": 16}),
    "arkvale": (ArkVale, {}),
    "arkvale_mad": (ArkVale, {"bound": "mad"}),
    "pqcache": (PQCache, {}),
}
