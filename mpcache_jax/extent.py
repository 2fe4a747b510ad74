"""Prompt lengths that are static, or public values known only at run time (bucketing).

A policy sizes its buffers from the prompt length T (budgets, kept counts, windows, pages).
With a static T every such count is a Python int and the program is compiled for exactly that
prompt (what the MPC programs do: token counts are public, shapes exact). For many prompts of
different lengths (a LongBench file), prompts are instead padded to a bucket of `capacity`
slots and T becomes a public runtime value: one compilation serves every T of the bucket.

`Extent` hides the difference. A count that depends on T is written once as a Python
function of an int, `fn(t)`, and

    extent.count(fn, key)   # fn(T) as an int (static T) or an int32 scalar (runtime T: a
                            # lookup in the public table [fn(t) for t in the bucket's range])
    extent.bound(fn, key)   # a static int >= every value count() can take: shapes use it

so a runtime T gives exactly the counts an exact-length program would use.
`key` = (owner, *name), e.g. (policy, "kept"): the owner (a policy) keeps the table in its own
memo (`AttentionPolicy.tables`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

def _table(fn: Callable[[int], int], key: Hashable, low: int, high: int) -> np.ndarray:
    """[high + 1] int32: fn(t) for t in [low, high] (0 elsewhere, and where fn raises: such
    lengths are refused before a run by the policy's check_prompt). key = (owner, *name): the
    table is kept in the owner's own memo (`AttentionPolicy.tables`), not in this module."""
    owner, name = key[0], tuple(key[1:])

    def build():
        table = np.zeros(high + 1, np.int32)
        for t in range(max(low, 1), high + 1):
            try:
                table[t] = fn(t)
            except ValueError:
                table[t] = 0
        return table
    return owner.memo(("extent",) + name + (low, high), build)


@dataclasses.dataclass(frozen=True)
class Extent:
    """The prompt occupies `capacity` slots; `length` (<= capacity) of them hold tokens.
    length: a Python int (= capacity: static prompt) or an int32 scalar (bucketed prompt, with
    `low` <= length the smallest length the bucket holds)."""

    capacity: int
    length: int | jax.Array
    low: int = 1

    @property
    def static(self) -> bool:
        return isinstance(self.length, (int, np.integer))

    def count(self, fn: Callable[[int], int], key: Hashable):
        if self.static:
            return fn(int(self.length))
        return jnp.asarray(_table(fn, key, self.low, self.capacity))[self.length]

    def bound(self, fn: Callable[[int], int], key: Hashable) -> int:
        if self.static:
            return fn(int(self.length))
        return int(_table(fn, key, self.low, self.capacity).max())

    def valid(self) -> np.ndarray | jax.Array:
        """[capacity] 0/1 float: slots holding a prompt token."""
        if self.static:
            return np.ones(self.capacity, np.float32)
        return (jnp.arange(self.capacity) < self.length).astype(jnp.float32)

    def last_tokens(self, count) -> np.ndarray | jax.Array:
        """[capacity] 0/1 float: the last `count` prompt tokens (count: int or int32 scalar)."""
        if self.static and isinstance(count, (int, np.integer)):
            positions = np.arange(self.capacity)
            return ((positions >= self.length - count) & (positions < self.length)).astype(np.float32)
        positions = jnp.arange(self.capacity)
        return ((positions >= self.length - count) & (positions < self.length)).astype(jnp.float32)


def of(aux) -> Extent:
    """The prompt extent of a PrefillAux."""
    if aux.length is None:
        return Extent(aux.prompt_len, aux.prompt_len)
    return Extent(aux.prompt_len, aux.length, aux.min_length)


def iota_lt(n: int, bound) -> np.ndarray | jax.Array:
    """[n] 0/1 float: index < bound (numpy when bound is a Python int)."""
    if isinstance(bound, (int, np.integer)):
        return (np.arange(n) < bound).astype(np.float32)
    return (jnp.arange(n) < bound).astype(jnp.float32)


def at(n: int, index) -> np.ndarray | jax.Array:
    """[n] 0/1 float: index == i (numpy when index is a Python int)."""
    if isinstance(index, (int, np.integer)):
        return (np.arange(n) == index).astype(np.float32)
    return (jnp.arange(n) == index).astype(jnp.float32)


def union(*masks):
    """Element-wise max of 0/1 masks (numpy when every mask is numpy: static programs keep
    their masks as constants)."""
    if all(isinstance(m, np.ndarray) for m in masks):
        return np.maximum.reduce(masks)
    out = masks[0]
    for m in masks[1:]:
        out = jnp.maximum(out, m)
    return out
