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
import numpy as np


# The visibility of every array field of a cache state under MPC, declared where the field is
# defined (`runtime.programs.cache_visibility` reads it and refuses a field that declares
# none): secret (derived from the prompt or the weights), public (token counts and positions,
# public in the threat model: docs/design.md) or nested (a state holding other states, whose
# own fields say).
VISIBILITY = "visibility"
SECRET, PUBLIC, NESTED = "secret", "public", "nested"


def secret_field(**kwargs):
    """A cache field derived from the prompt or the weights."""
    return flax.struct.field(metadata={VISIBILITY: SECRET}, **kwargs)


def public_field(**kwargs):
    """A cache field every party may know (a token count)."""
    return flax.struct.field(metadata={VISIBILITY: PUBLIC}, **kwargs)


def nested_field(**kwargs):
    """A field holding other cache states (their own fields declare)."""
    return flax.struct.field(metadata={VISIBILITY: NESTED}, **kwargs)


@flax.struct.dataclass
class LayerKV:
    """Key/value buffers of one layer.

    k, v: [H_kv, S, d] with S the fixed capacity; length: int32 [] slots [0, length) are in use.
    """

    k: jax.Array = secret_field()
    v: jax.Array = secret_field()
    length: jax.Array = public_field()

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


# ----- sliding-window layers ------------------------------------------------------------------
@flax.struct.dataclass
class WindowKV(LayerKV):
    """Ring buffer of a sliding-window (local) layer: the keys/values of its last R tokens.

    k, v: [H_kv, R, d] with R = min(window, cache capacity); length: int32 [] tokens written so
    far (public, like LayerKV.length). Token at position p lives in slot p mod R, so after
    writing position p the buffer holds positions max(0, p - R + 1) .. p (RoPE is applied
    before caching, so the slot order does not matter to attention). Every slot index is the
    public length modulo R: no secret indexing. `valid()` (LayerKV's) marks every slot once
    length >= R.
    """


def empty_window(num_kv_heads: int, window: int, capacity: int, head_dim: int,
                 dtype=jnp.float32) -> WindowKV:
    """An empty ring buffer of min(window, capacity) slots (a cache of `capacity` tokens never
    needs more)."""
    zeros = jnp.zeros((num_kv_heads, min(window, capacity), head_dim), dtype)
    return WindowKV(k=zeros, v=zeros, length=jnp.zeros((), jnp.int32))


def window_append(layer: WindowKV, k_new: jax.Array, v_new: jax.Array) -> WindowKV:
    """Write one token's key/value ([H_kv, d] each) at slot length mod R (a public index)."""
    slot = jnp.remainder(layer.length, layer.capacity)
    return WindowKV(k=write_slots(layer.k, k_new[:, None, :], slot),
                    v=write_slots(layer.v, v_new[:, None, :], slot), length=layer.length + 1)


def fill_window(layer: WindowKV, k: jax.Array, v: jax.Array, length=None) -> WindowKV:
    """Store the last R of a prompt's keys/values ([H_kv, T, d]) in an empty ring buffer.

    length: tokens in use when the prompt is padded to T (a bucket: an int32 public runtime
    value; default T). Slot s receives the latest real position p < length with p mod R = s.
    """
    T, R = k.shape[1], layer.capacity
    if length is None:
        start = max(T - R, 0)   # static: the last min(T, R) keys, rotated into their slots
        k_last, v_last = k[:, start:], v[:, start:]
        shift = start % R
        if T < R:
            pad = ((0, 0), (0, R - T), (0, 0))
            k_last, v_last = jnp.pad(k_last, pad), jnp.pad(v_last, pad)
        ring_k, ring_v = jnp.roll(k_last, shift, axis=1), jnp.roll(v_last, shift, axis=1)
        count = jnp.asarray(T, jnp.int32)
    else:
        count = jnp.asarray(length, jnp.int32)
        slots = jnp.arange(R)
        positions = jnp.clip(count - 1 - jnp.remainder(count - 1 - slots, R), 0, T - 1)
        ring_k, ring_v = jnp.take(k, positions, axis=1), jnp.take(v, positions, axis=1)
    return WindowKV(k=ring_k.astype(layer.k.dtype), v=ring_v.astype(layer.v.dtype), length=count)


@flax.struct.dataclass
class SplitCache:
    """KV cache of a model with sliding-window layers.

    evicting: the states of the global layers, in model order: what an eviction policy
    compresses and attends over (its layer index counts these layers only, so cross-layer
    settings such as `share_from` count evicting layers); window: one WindowKV per local layer,
    in model order (a local layer's window is already a bounded cache: policies never see it);
    local: static, per model layer True for a local layer.
    A model without local layers keeps a plain tuple (one state per layer) instead.
    """

    evicting: tuple = nested_field()
    window: tuple = nested_field()
    local: tuple = flax.struct.field(pytree_node=False)

    def per_layer(self) -> list:
        """The states in model order."""
        evicting, window = iter(self.evicting), iter(self.window)
        return [next(window) if is_local else next(evicting) for is_local in self.local]

    @classmethod
    def from_layers(cls, states, local) -> "SplitCache":
        """Split per-layer states (model order) by the `local` flags."""
        local = tuple(bool(x) for x in local)
        return cls(evicting=tuple(s for s, is_local in zip(states, local) if not is_local),
                   window=tuple(s for s, is_local in zip(states, local) if is_local), local=local)


@flax.struct.dataclass
class LayerStack:
    """The states of several layers with one structure, stacked on a leading axis.

    stacked: a layer state (LayerKV, a policy's PrunedLayer, ...) whose every leaf has the
    layer axis in front. The model's layer loop reads and writes one layer of it per step
    (`lax.scan`); as a sequence it gives each layer's state (`stack[i]`, `len`, iteration),
    which is how policies' `compress` walks the layers. Build one with `LayerStack.of`.
    """

    stacked: Any = nested_field()

    @classmethod
    def of(cls, states) -> "LayerStack":
        """Stack per-layer states that share one structure and shape (`stackable`)."""
        states = list(states)
        if not stackable(states):
            raise ValueError("these layer states differ in structure or shape and cannot be "
                             "stacked; keep them as a tuple")
        return cls(jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states))

    def __len__(self) -> int:
        return int(jax.tree_util.tree_leaves(self.stacked)[0].shape[0])

    def __getitem__(self, index: int):
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"a LayerStack is indexed by a layer number, not {type(index).__name__}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"layer {index} of a stack of {n}")
        return jax.tree_util.tree_map(lambda x: x[index], self.stacked)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def stackable(states) -> bool:
    """Whether per-layer states have one tree structure (static fields included) and equal
    leaf shapes and dtypes, so that they stack."""
    states = list(states)
    if not states:
        return False
    first = jax.tree_util.tree_structure(states[0])
    shapes = [(np.shape(x), jnp.result_type(x)) for x in jax.tree_util.tree_leaves(states[0])]
    if not shapes:
        return False
    return all(jax.tree_util.tree_structure(s) == first and
               [(np.shape(x), jnp.result_type(x)) for x in jax.tree_util.tree_leaves(s)] == shapes
               for s in states[1:])


def stack_if_uniform(states):
    """A LayerStack of the states when they stack, else the tuple of them."""
    states = tuple(states)
    return LayerStack.of(states) if stackable(states) else states


def policy_layers(cache):
    """The layers an eviction policy manages: every layer of a plain cache (a tuple or a
    LayerStack), the global (evicting) layers of a SplitCache."""
    return cache.evicting if isinstance(cache, SplitCache) else cache


def with_policy_layers(cache, layers):
    """`cache` with its policy-managed layers replaced by `layers` (a plain cache keeps its
    form: a LayerStack when the new states stack, else a tuple)."""
    if isinstance(cache, SplitCache):
        return cache.replace(evicting=tuple(layers))
    if isinstance(layers, LayerStack):
        return layers
    if isinstance(cache, LayerStack):
        return stack_if_uniform(layers)
    return layers


def model_layers(cache) -> list:
    """One state per model layer, in model order (local layers' ring buffers included)."""
    return cache.per_layer() if isinstance(cache, SplitCache) else list(cache)
