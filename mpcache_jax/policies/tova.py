"""TOVA (Token Omission Via Attention): keep the tokens the current query attends to most,
averaged over all heads of the layer (one kept set per layer).

Prefill: the last prompt query cuts the prompt to the budget. Decode: after each step's
attention, the token (new one included) with the lowest head-averaged attention from this
step's query is dropped once the buffer is full (buffer and budget rule:
base.DecodeEvictionPolicy).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mpcache_jax.policies.base import DecodeEvictionPolicy, window_attention_mass


@dataclasses.dataclass(frozen=True)
class TOVA(DecodeEvictionPolicy):
    name: str = "tova"
    needs_queries: bool = True

    def keep_scores(self, layer, q, k, extent, carry):
        mass = window_attention_mass(q, k, 1, extent=extent, window_max=1)
        return jnp.mean(mass, axis=(0, 1)), carry                              # [T]

    def step_scores(self, previous, probs):
        return jnp.broadcast_to(jnp.mean(probs, axis=(0, 1)), previous.shape)


REGISTRY = {"tova": (TOVA, {})}
