"""InfLLM: initial tokens + a local window + the memory blocks most relevant to the query.

The prompt between the initial tokens and the local window is cut into blocks of 128; each
block is represented by its r = 4 representative keys, the ones that receive the most
attention from the block's own queries at prefill (causal, softmax within the block, summed
over the queries and the query heads of the GQA group). A block's relevance to the current
query is sum_g sum_r q_g . k_r, one matmul with the summed representatives.
Deviation from the original (128 initial tokens, 4096-token local window): the initial and
local tokens are sized for this project's budgets (4 tokens, a quarter of the budget).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax import attention
from mpcache_jax import primitives as P
from mpcache_jax.policies.quest import PageSelectionPolicy


def representative_mask(q: jax.Array, k: jax.Array, valid: jax.Array, block_size: int,
                        count: int) -> jax.Array:
    """The `count` keys of each block that its own queries attend to most.

    q: [H, N, d]; k: [H_kv, N, d]; valid: [N] 0/1 (padding neither votes nor is chosen
    before real tokens); N a multiple of block_size. Returns 0/1 [H_kv, N / s, s].
    """
    H, N, d = q.shape
    Hkv, s = k.shape[0], block_size
    C = N // s
    qb = q.reshape(Hkv, H // Hkv, C, s, d)
    kb = k.reshape(Hkv, C, s, d)
    logits = jnp.einsum("kgcid,kcjd->kgcij", qb, kb) / np.sqrt(d)
    vb = valid.reshape(C, s)
    causal = np.tril(np.ones((s, s), np.float32))
    probs = attention.masked_softmax(logits, causal * vb[:, None, :])   # [H_kv, G, C, s, s]
    received = jnp.einsum("kgcij,ci->kcj", probs, vb)                   # votes of valid queries
    return P.topk_mask(received, min(count, s), valid=vb)


@dataclasses.dataclass(frozen=True)
class InfLLM(PageSelectionPolicy):
    name: str = "infllm"
    needs_queries: bool = True
    page_size: int = 128
    representatives: int = 4
    num_initial: int = 4
    local_ratio: float = 0.25

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.representatives <= self.page_size:
            raise ValueError(f"representatives={self.representatives} must be in [1, block size "
                             f"{self.page_size}]")

    def digest(self, layer, k_mid, valid_mid, q, lay, new_capacity):
        i0, pad = lay.initial, lay.padded - lay.middle
        q_mid = jnp.pad(q[:, i0:i0 + lay.middle], ((0, 0), (0, pad), (0, 0)))
        reps = representative_mask(q_mid, k_mid, valid_mid, lay.page_size, self.representatives)
        Hkv, _, d = k_mid.shape
        blocks = k_mid.reshape(Hkv, lay.num_pages, lay.page_size, d)
        return jnp.einsum("kcs,kcsd->kcd", reps, blocks)                # summed representatives

    def page_scores(self, qg, extras, lay):
        return jnp.einsum("kd,kcd->kc", jnp.sum(qg, axis=1), extras)
