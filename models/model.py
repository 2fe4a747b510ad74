"""`Model`: a hashable handle on one configuration with jitted prefill / decode entry points.

    model = Model(cfg)
    params = model.init_params(seed=0)               # or a loader's params
    cache = model.init_cache(capacity=T + max_new)
    logits, cache, aux = model.prefill(params, tokens, cache)
    logits, cache = model.decode_step(params, token, pos, cache)            # full attention
    logits, cache = model.decode_step(params, token, pos, cache, policy)    # any eviction policy

Inputs are validated here, before tracing, so bad input gives a message instead of an error
from inside JAX. The jitted functions take the model and the policy as static arguments:
one compilation per (model, policy, shapes), reused across decode steps.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax.cache import (KVCache, LayerStack, SplitCache, empty_cache, empty_window,
                               model_layers, policy_layers)
from mpcache_jax.policy import FULL, AttentionPolicy, PrefillAux
from models import transformer
from models.config import ModelConfig


# ----- the model functions (pure; `Model` jits them, runtime.programs compiles them per backend) ---
def dense_prefill(model: "Model", params, tokens, cache, return_queries: bool,
                  all_logits: bool = False, length=None):
    """(logits [V] or [T, V], dense cache, per-layer queries or None). tokens: ids [T] or
    one-hot [T, V]; length: real tokens of a bucketed prompt (runtime), default T."""
    return transformer.prefill(model.cfg, params, tokens, cache, return_queries, all_logits,
                               length)


def decode_logits(model: "Model", policy: AttentionPolicy, params, token, pos, cache,
                  min_rows: int = 1):
    """One decode step -> (logits [V], cache). token: id [] or one-hot [V]; pos: public.
    min_rows: see `transformer.dense` (plaintext XLA decoding passes 2)."""
    return transformer.decode(model.cfg, params, token, pos, cache, policy, min_rows)


# One-row products on XLA (`transformer.dense`): the plaintext decode step computes its
# projections on two rows.
XLA_MIN_ROWS = 2


@functools.partial(jax.jit, static_argnames=("model",))
def _forward(model, params, tokens):
    return transformer.forward(model.cfg, params, tokens)


@functools.partial(jax.jit, static_argnames=("model", "return_queries", "all_logits"))
def _prefill(model, params, tokens, cache, return_queries, all_logits, length=None):
    return dense_prefill(model, params, tokens, cache, return_queries, all_logits, length)


@functools.partial(jax.jit, static_argnames=("model", "policy"), donate_argnames=("cache",))
def _decode(model, params, token, pos, cache, policy):
    return decode_logits(model, policy, params, token, pos, cache, XLA_MIN_ROWS)


def tie_lm_head(params: dict) -> dict:
    """Set lm_head/kernel to a contiguous copy of embed/embedding.T (faster than x @ E.T in jit)."""
    params = dict(params)
    params["lm_head"] = {"kernel": jnp.asarray(np.ascontiguousarray(
        np.asarray(params["embed"]["embedding"]).T))}
    return params


@dataclasses.dataclass(frozen=True)
class Model:
    cfg: ModelConfig

    # ----- construction -------------------------------------------------------------------
    def init_params(self, seed: int = 0) -> dict:
        """Random parameters (normal(0.02) kernels, unit norms), LM head tied if configured."""
        params = jax.jit(transformer.init_params, static_argnums=(0, 1))(self.cfg, seed)
        return tie_lm_head(params) if self.cfg.tie_embeddings else params

    def param_shapes(self) -> dict:
        """ShapeDtypeStruct tree of init_params' (what a party without the weights knows)."""
        return jax.tree_util.tree_map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32),
                                      transformer.param_shapes(self.cfg),
                                      is_leaf=lambda x: isinstance(x, tuple))

    def init_cache(self, capacity: int, dtype=jnp.float32, stacked: bool = False) -> KVCache:
        """An empty cache for `capacity` tokens: one LayerKV per layer (a tuple; `stacked`: a
        LayerStack, whose decode steps run the layers as one loop: `transformer.decode_hidden`),
        or, for a model with sliding-window layers, a SplitCache (a LayerKV per global layer, a
        WindowKV ring buffer of min(window, capacity) slots per local layer)."""
        c = self.cfg
        if not c.has_local_layers:
            layers = empty_cache(c.num_layers, c.num_kv_heads, capacity, c.head_dim, dtype)
            return LayerStack.of(layers) if stacked else layers
        full = empty_cache(1, c.num_kv_heads, capacity, c.head_dim, dtype)[0]
        states = [empty_window(c.num_kv_heads, c.sliding_window, capacity, c.head_dim, dtype)
                  if local else full for local in c.local_layers]
        return SplitCache.from_layers(states, c.local_layers)

    # ----- validation ---------------------------------------------------------------------
    def _check_tokens(self, tokens) -> jax.Array:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.shape[0] == 0:
            raise ValueError(f"tokens must be a non-empty 1-D sequence of ids, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}); got range "
                             f"[{arr.min()}, {arr.max()}]")
        if arr.shape[0] > self.cfg.max_position:
            raise ValueError(f"{arr.shape[0]} tokens exceed the model's context of "
                             f"{self.cfg.max_position} positions ({self.cfg.name})")
        return jnp.asarray(arr, jnp.int32)

    def _check_position(self, pos: int):
        if not 0 <= int(pos) < self.cfg.max_position:
            raise ValueError(f"position {int(pos)} is outside the model's context of "
                             f"{self.cfg.max_position} positions ({self.cfg.name})")

    # ----- entry points -------------------------------------------------------------------
    def forward(self, params, tokens) -> jax.Array:
        """Logits [T, V] for every position, recomputing the whole sequence (no cache)."""
        return _forward(self, params, self._check_tokens(tokens))

    def prefill(self, params, tokens, cache: KVCache, *, return_queries: bool = False,
                all_logits: bool = False, length: int | None = None, min_length: int = 1):
        """Run the prompt through the model, filling an empty dense cache.

        Returns (logits, cache, aux): logits [V] for the last prompt token ([T, V] with
        all_logits), the cache with slots [0, T) filled, and a PrefillAux (prompt queries per
        layer when return_queries, for policies that score tokens at prefill).

        Bucketed prompts: `tokens` padded at the end to the bucket's T slots, `length` the
        number of real tokens (a public runtime value: one compilation per bucket) and
        `min_length` the smallest length the bucket holds (sizes the policies' tables).
        """
        tokens = self._check_tokens(tokens)
        T = tokens.shape[0]
        if length is not None:
            if all_logits:
                raise ValueError("all_logits is not available for a bucketed (padded) prompt")
            if not min_length <= int(length) <= T:
                raise ValueError(f"length={length} must lie in [min_length={min_length}, {T}] "
                                 "(the prompt's real tokens within its bucket)")
        count = len(cache.local) if isinstance(cache, SplitCache) else len(cache)
        if count != self.cfg.num_layers:
            raise ValueError(f"cache has {count} layers, the model has {self.cfg.num_layers}")
        first = policy_layers(cache)[0]
        capacity = first.capacity
        if int(first.length) != 0:
            raise ValueError("prefill needs an empty cache (model.init_cache); this one already "
                             f"holds {int(first.length)} tokens")
        if T > capacity:
            raise ValueError(f"prompt of {T} tokens is longer than the cache capacity {capacity}; "
                             "create the cache with capacity >= prompt length + new tokens")
        if length is None:
            logits, cache, queries = _prefill(self, params, tokens, cache, return_queries,
                                              all_logits)
            return logits, cache, PrefillAux(queries=queries, prompt_len=T,
                                             normalized_keys=self.cfg.qk_norm)
        length = jnp.asarray(length, jnp.int32)
        logits, cache, queries = _prefill(self, params, tokens, cache, return_queries, all_logits,
                                          length)
        return logits, cache, PrefillAux(queries=queries, prompt_len=T, length=length,
                                         min_length=min_length,
                                         normalized_keys=self.cfg.qk_norm)

    def decode_step(self, params, token, pos, cache: KVCache,
                    policy: AttentionPolicy = FULL):
        """One new token at absolute position `pos` -> (logits [V], updated cache).

        The cache argument is donated (updated in place); use the returned cache.
        """
        if not isinstance(pos, jax.core.Tracer):
            self._check_position(pos)
        if not isinstance(token, jax.core.Tracer):
            self._check_tokens([int(np.asarray(token))])
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(cache)):
            if policy.free_slots(policy_layers(cache)) <= 0:
                raise ValueError("the KV cache is full: allocate more room for new tokens "
                                 "(capacity >= prompt length + max_new_tokens)")
        return _decode(self, params, jnp.asarray(token, jnp.int32), jnp.asarray(pos, jnp.int32),
                       cache, policy)
