"""Fixed-capacity KV cache buffers.

A cache is a tuple with one state per layer. The dense state `LayerKV` holds key/value
buffers of a fixed capacity and the number of slots in use; appending writes at that
(public) slot, so no shape changes during generation. Eviction policies keep their own
per-layer states, built from `LayerKV` pieces.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class LayerKV:
    """Key/value buffers of one layer.

    k, v: [H_kv, S, d] with S the fixed capacity; length: int32 [] slots [0, length) are in use.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def valid(self) -> jax.Array:
        """[S] float 0/1 mask of slots in use."""
        return (jnp.arange(self.capacity) < self.length).astype(self.k.dtype)


KVCache = tuple[Any, ...]


def empty_layer(num_kv_heads: int, capacity: int, head_dim: int, dtype=jnp.float32) -> LayerKV:
    zeros = jnp.zeros((num_kv_heads, capacity, head_dim), dtype)
    return LayerKV(k=zeros, v=zeros, length=jnp.zeros((), jnp.int32))


def empty_cache(num_layers: int, num_kv_heads: int, capacity: int, head_dim: int,
                dtype=jnp.float32) -> KVCache:
    """A dense cache of `capacity` slots per layer, all empty."""
    if capacity <= 0:
        raise ValueError(f"cache capacity must be positive, got {capacity}")
    return tuple(empty_layer(num_kv_heads, capacity, head_dim, dtype) for _ in range(num_layers))


def write_slots(buf: jax.Array, values: jax.Array, start) -> jax.Array:
    """Write `values` [H_kv, n, d] into `buf` [H_kv, S, d] at slots [start, start + n).

    `start` is public (token counts are public in our threat model), so this is a plain
    dynamic-update-slice on every backend.
    """
    return jax.lax.dynamic_update_slice(buf, values.astype(buf.dtype), (0, start, 0))


def append_token(layer: LayerKV, k_new: jax.Array, v_new: jax.Array) -> LayerKV:
    """Append one token's key/value ([H_kv, d] each) at slot `layer.length`."""
    return LayerKV(
        k=write_slots(layer.k, k_new[:, None, :], layer.length),
        v=write_slots(layer.v, v_new[:, None, :], layer.length),
        length=layer.length + 1,
    )


def fill_prefix(layer: LayerKV, k: jax.Array, v: jax.Array, length=None) -> LayerKV:
    """Store a prompt's keys/values ([H_kv, T, d]) in slots [0, T) of an empty layer.
    length: tokens in use when the prompt is padded (a bucket; default T): the next token is
    appended at slot `length`, over the padding."""
    T = k.shape[1]
    if T > layer.capacity:
        raise ValueError(f"prompt of {T} tokens does not fit a cache of capacity {layer.capacity}")
    return LayerKV(k=write_slots(layer.k, k, 0), v=write_slots(layer.v, v, 0),
                   length=jnp.asarray(T if length is None else length, jnp.int32))
