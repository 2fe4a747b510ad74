"""PQCache: approximate top-k tokens by product quantization of the keys.

Per layer and KV head the prompt keys (after the initial tokens) are split into m sub-spaces
(default 2) and each sub-space is clustered into 2^b centroids (default b = 6) by k-means run
as array code (fixed iterations, one-hot assignments, matmul updates). A decode step scores
token j by sum over sub-spaces of q_sub . centroid[code_j] (the group's queries summed),
attends to the initial tokens, the local window and the top-k tokens by that score.
The local window holds the `local_ratio` share of the budget of most recent tokens; generated
tokens fill it as decoding goes on, so prompt tokens age out of it into the top-k pool. New
tokens get the code of their nearest centroid as they are appended (the same code they
would get on leaving the window, since centroids are fixed after prefill); under this
project's budget rule generated tokens are always attended, so those codes are kept for the
index's completeness and never change a selection.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import primitives as P
from mpcache_jax.policies.quest import PageSelectionPolicy


def split_subspaces(x: jax.Array, subspaces: int) -> jax.Array:
    """[..., d] -> [..., m, ceil(d/m)] (the last sub-space zero-padded when m does not divide
    d; zero channels change neither distances nor dot products)."""
    d = x.shape[-1]
    width = -(-d // subspaces)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width * subspaces - d)])
    return x.reshape(*x.shape[:-1], subspaces, width)


def pq_encode(k: jax.Array, subspaces: int, bits: int, iters: int, count=None):
    """k: [H_kv, N, d] -> (centroids [H_kv, m, 2^b, ceil(d/m)], codes int32 [H_kv, m, N]).
    count: rows holding keys (the rest is padding, left out of the clustering); default N."""
    parts = split_subspaces(k, subspaces).transpose(0, 2, 1, 3)             # [H_kv, m, N, d/m]
    if count is None or isinstance(count, (int, np.integer)):
        return P.kmeans(parts, num_centroids=2 ** bits, iters=iters,
                        count=None if count is None else int(count))
    return P.kmeans_runtime_count(parts, count, num_centroids=2 ** bits, iters=iters)


def pq_reconstruct(centroids: jax.Array, codes: jax.Array, d: int) -> jax.Array:
    """Inverse of pq_encode up to quantization: -> [H_kv, N, d]."""
    onehot = P.indices_onehot(codes, centroids.shape[-2], centroids.dtype)   # [H_kv, m, N, K]
    parts = jnp.einsum("kmnc,kmcd->kmnd", onehot, centroids)
    Hkv, m, N, dm = parts.shape
    return parts.transpose(0, 2, 1, 3).reshape(Hkv, N, m * dm)[..., :d]


@flax.struct.dataclass
class PQIndex:
    """centroids: [H_kv, m, 2^b, d/m]; codes: int32 [H_kv, m, N] of the prompt's middle
    tokens; new_codes: int32 [H_kv, m, max_new] of generated tokens."""

    centroids: jax.Array
    codes: jax.Array
    new_codes: jax.Array


@dataclasses.dataclass(frozen=True)
class PQCache(PageSelectionPolicy):
    name: str = "pqcache"
    page_size: int = 1
    num_initial: int = 4
    local_ratio: float = 0.25
    subspaces: int = 2
    bits: int = 6
    kmeans_iters: int = 10

    def __post_init__(self):
        if self.page_size != 1:
            raise ValueError(f"PQCache selects single tokens: page_size must be 1, got "
                             f"{self.page_size}")
        if self.subspaces < 1 or self.bits < 1 or self.kmeans_iters < 1:
            raise ValueError(f"subspaces={self.subspaces}, bits={self.bits} and kmeans_iters="
                             f"{self.kmeans_iters} must all be >= 1")
        super().__post_init__()

    def static_local(self, budget):
        return 0  # the local window slides over generated tokens: see forced_pages

    def window_tokens(self, prompt_len: int) -> int:
        return int(self.local_ratio * P.budget_tokens(self.budget, prompt_len))

    def check_layout(self, lay, prompt_len):
        if self.window_tokens(prompt_len) >= lay.selected:
            raise ValueError(f"policy {self.name!r}: the local window of "
                             f"{self.window_tokens(prompt_len)} "
                             f"tokens leaves no top-k token in a budget of {lay.selected} "
                             "(after the initial tokens); lower local_ratio or raise the budget")

    def digest(self, layer, k_mid, valid_mid, q, k_prompt, lay, new_capacity):
        centroids, codes = pq_encode(k_mid, self.subspaces, self.bits, self.kmeans_iters,
                                     lay.middle)
        new_codes = jnp.zeros(codes.shape[:2] + (new_capacity,), jnp.int32)
        return PQIndex(centroids, codes, new_codes)

    def page_scores(self, qg, extras, lay):
        q_parts = split_subspaces(jnp.sum(qg, axis=1), self.subspaces)       # [H_kv, m, d/m]
        per_centroid = jnp.einsum("kmd,kmcd->kmc", q_parts, extras.centroids)
        onehot = P.indices_onehot(extras.codes, extras.centroids.shape[-2], qg.dtype)
        return jnp.einsum("kmnc,kmc->kn", onehot, per_centroid)

    def forced_pages(self, state, lay):
        # Prompt tokens still inside the window: the last (window - generated) of them.
        window = lay.count(self.window_tokens, (self, "window"))
        in_window = jnp.maximum(window - state.new.length, 0)
        position = jnp.arange(lay.num_pages)
        return ((position >= lay.middle - in_window) & (position < lay.middle)).astype(state.k.dtype)

    def after_select(self, state, mask, k_new, lay):
        index = state.extras
        parts = split_subspaces(k_new, self.subspaces)[:, :, None, :]        # [H_kv, m, 1, d/m]
        code = P.nearest_centroid(parts, index.centroids)                     # [H_kv, m, 1]
        slot = state.new.length - 1
        new_codes = jax.lax.dynamic_update_slice(index.new_codes, code, (0, 0, slot))
        return state.replace(extras=index.replace(new_codes=new_codes))
