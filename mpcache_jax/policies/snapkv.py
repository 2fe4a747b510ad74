"""SnapKV: the last `window` prompt queries (the observation window) vote for the earlier
tokens; votes are summed over the window and over the query heads of each KV head, smoothed
by a 1-D max-pool (kernel 7) along the sequence, and each KV head keeps its top tokens. The
window itself is always kept (it takes min(window, budget) of the budget).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mpcache_jax import extent as E
from mpcache_jax.policies.base import PromptEvictionPolicy, window_attention_mass


def max_pool_1d(x: jnp.ndarray, kernel: int) -> jnp.ndarray:
    """Same-length 1-D max-pool over the last axis (stride 1, zero padding; inputs are >= 0).

    x: [..., T] -> [..., T]: out[t] = max(x[t - kernel//2 : t + kernel//2 + 1]).
    """
    half = kernel // 2
    T = x.shape[-1]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, kernel - 1 - half)])
    return jnp.max(jnp.stack([padded[..., i:i + T] for i in range(kernel)]), axis=0)


@dataclasses.dataclass(frozen=True)
class SnapKV(PromptEvictionPolicy):
    name: str = "snapkv"
    needs_queries: bool = True
    window: int = 32
    kernel: int = 7

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"window={self.window} must be >= 1 and kernel={self.kernel} a "
                             "positive odd number (SnapKV: window 32, kernel 7)")

    def observation_window(self, prompt_len: int) -> int:
        return min(self.window, prompt_len)

    def keep_scores(self, layer, q, k, extent, carry):
        key = (self, "window")
        window = extent.count(self.observation_window, key)
        votes = jnp.sum(window_attention_mass(q, k, window, extent=extent,
                                              window_max=extent.bound(self.observation_window, key)),
                        axis=1)                                               # [H_kv, T]
        prefix = E.iota_lt(extent.capacity, extent.length - window)
        return max_pool_1d(votes * prefix, self.kernel), carry

    def forced_keep(self, extent, count):
        return extent.last_tokens(jnp.minimum(self.window, count) if not extent.static
                                  else min(self.window, count))


REGISTRY = {"snapkv": (SnapKV, {})}
