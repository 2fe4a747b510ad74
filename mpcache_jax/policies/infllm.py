"""InfLLM: initial tokens + a local window + the memory blocks most relevant to the query.

The prompt between the initial tokens and the local window is cut into blocks of 128; each
block is represented by its r = 4 representative keys, the ones that receive the most
attention from the block's own queries at prefill (the model's causal attention, normalised
over every earlier prompt key, summed over the block's queries and the query heads of the
GQA group). A block's relevance to the current query is sum_g sum_r q_g . k_r, one matmul
with the summed representatives.
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


def attention_received(q: jax.Array, k: jax.Array, start: int, block_size: int,
                       valid: jax.Array) -> jax.Array:
    """Attention each key of a blocked region receives from the queries of its own block.

    The region is prompt positions [start, start + N) (N a multiple of block_size; the padded
    tail is marked 0 in valid [N]). q: [H, N, d] the region's queries; k: [H_kv, start + N, d]
    the prompt keys up to the region's end (padding rows anywhere past the prompt). Attention
    is the model's causal softmax over every earlier prompt key, so a block's first keys get
    no more than their share. Returns [H_kv, N / s, s]: sum over the block's queries (and the
    query heads of the GQA group) of the attention each key receives.
    """
    H, N, d = q.shape
    Hkv, s = k.shape[0], block_size
    C = N // s
    qb = q.reshape(Hkv, H // Hkv, C, s, d)
    positions = start + np.arange(N).reshape(C, s)                      # absolute query positions

    def normaliser(args):  # log-sum-exp of one block's queries over all earlier keys
        qc, pos = args                                                  # [H_kv, G, s, d], [s]
        logits = jnp.einsum("kgid,ktd->kgit", qc, k) / np.sqrt(d)
        causal = jnp.arange(k.shape[1])[None, :] <= pos[:, None]
        top = jnp.max(jnp.where(causal, logits, attention.MAX_FILL), axis=-1, keepdims=True)
        shifted = jnp.where(causal, logits - top, attention.MASK_LOGIT)  # no exp of big values
        total = jnp.sum(jnp.exp(shifted) * causal, axis=-1)
        return top[..., 0] + jnp.log(total)

    lse = jax.lax.map(normaliser, (jnp.moveaxis(qb, 2, 0), jnp.asarray(positions)))
    lse = jnp.moveaxis(lse, 0, 2)                                        # [H_kv, G, C, s]
    kb = k[:, start:start + N].reshape(Hkv, C, s, d)
    logits = jnp.einsum("kgcid,kcjd->kgcij", qb, kb) / np.sqrt(d)
    vb = valid.reshape(C, s)
    mask = np.tril(np.ones((s, s), np.float32)) * vb[:, :, None] * vb[:, None, :]
    probs = jnp.exp(jnp.minimum(logits - lse[..., None], 0.0)) * mask   # [H_kv, G, C, s, s]
    return jnp.sum(probs, axis=(1, 3))


def representative_mask(received: jax.Array, count: int, valid: jax.Array) -> jax.Array:
    """The `count` most-attended keys of each block: received [H_kv, C, s] -> 0/1 same shape
    (padding, valid [C * s] = 0, is chosen only after every real token)."""
    C, s = received.shape[-2:]
    return P.topk_mask(received, min(count, s), valid=valid.reshape(C, s))


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

    def digest(self, layer, k_mid, valid_mid, q, k_prompt, lay, new_capacity):
        i0 = lay.initial
        q_mid = self.arrange(q, lay)[:, i0:i0 + lay.padded]
        k_upto = jnp.concatenate([k_prompt[:, :i0], k_mid], axis=1)    # keys up to the region's end
        received = attention_received(q_mid, k_upto, i0, lay.page_size, valid_mid)
        reps = representative_mask(received, self.representatives, valid_mid)
        Hkv, _, d = k_mid.shape
        blocks = k_mid.reshape(Hkv, lay.num_pages, lay.page_size, d)
        return jnp.einsum("kcs,kcsd->kcd", reps, blocks)                # summed representatives

    def page_scores(self, qg, extras, lay):
        return jnp.einsum("kd,kcd->kc", jnp.sum(qg, axis=1), extras)
