"""Which prompt tokens a policy keeps and attends to: the mechanism metrics of the fidelity
suite (e.g. does an answer's span survive MPCache's static eviction, and is it selected at the
decode step that writes the answer?).

    masks = prompt_keep_masks(policy, dense_cache, aux)        # per layer [H_kv, T] 0/1
    probe = SelectionProbe(inner=policy)                        # decode as `policy`, recording
    cache = apply_policy(probe, dense_cache, aux, max_new)      # ... the attended slots
    logits, cache = model.decode_step(params, token, pos, cache, probe)
    slots = [layer.attended for layer in cache]                 # per layer [H_kv, S] 0/1
    attended = attended_positions(slots, masks)                 # per layer [H_kv, T] 0/1
    span_coverage(masks[l], spans)                              # share of the answer kept

Analysis only: nothing here runs in the programs that are costed under MPC.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax.cache import nested_field, policy_layers, secret_field
from mpcache_jax.policy import FULL, AttentionPolicy


def supports_mechanism(policy: AttentionPolicy) -> bool:
    """Policies whose kept region is a static eviction of the prompt (`prompt_keep`) and that
    say which of its slots a step attends to (`attended_slots`)."""
    from mpcache_jax.policies.base import PromptEvictionPolicy
    from mpcache_jax.policies.quest import PageSelectionPolicy
    return isinstance(policy, PromptEvictionPolicy) and not isinstance(policy, PageSelectionPolicy)


@functools.partial(jax.jit, static_argnames=("policy",))
def _keep_masks(policy, cache, aux):
    cache = policy_layers(cache)
    Hkv = cache[0].k.shape[0]
    return tuple(jnp.broadcast_to(item[0], (Hkv, item[0].shape[-1])) > 0.5
                 for item in policy.prompt_keep(cache, aux))


def prompt_keep_masks(policy, cache, aux) -> list[np.ndarray]:
    """Per layer bool [H_kv, T]: the prompt tokens the policy's static eviction keeps."""
    return [np.asarray(m) for m in _keep_masks(policy, cache, aux)]


@flax.struct.dataclass
class ProbeState:
    """inner: the policy's own layer state; attended: int32 [H_kv, S] slots of its kept region
    that the last decode step attended to."""

    inner: Any = nested_field()
    attended: jax.Array = secret_field()


@dataclasses.dataclass(frozen=True)
class SelectionProbe(AttentionPolicy):
    """Decodes exactly as `inner` and records, per layer, which kept-region slots each step
    attends to (`inner.attended_slots`, evaluated on the same query, state and carry)."""

    inner: AttentionPolicy = FULL
    name: str = "probe"

    def __post_init__(self):
        super().__post_init__()
        if not supports_mechanism(self.inner):
            raise ValueError(f"policy {self.inner.name!r} does not report the slots it attends to")
        object.__setattr__(self, "needs_queries", self.inner.needs_queries)

    def compress(self, cache, aux, max_new_tokens):
        states = self.inner.compress(cache, aux, max_new_tokens)
        return tuple(ProbeState(s, jnp.zeros(self.inner.attended_shape(s), jnp.int32))
                     for s in states)

    def free_slots(self, cache) -> int:
        return self.inner.free_slots(tuple(s.inner for s in cache))

    def init_carry(self):
        return self.inner.init_carry()

    def attend(self, layer, q, k_new, v_new, state: ProbeState, carry):
        slots = self.inner.attended_slots(layer, q, state.inner, carry)
        out, inner, carry = self.inner.attend(layer, q, k_new, v_new, state.inner, carry)
        return out, ProbeState(inner, slots.astype(jnp.int32)), carry


def attended_positions(slots: Sequence[np.ndarray], keep_masks: Sequence[np.ndarray]
                       ) -> list[np.ndarray]:
    """Map each layer's attended kept-region slots [H_kv, S] back to prompt positions: bool
    [H_kv, T] (slot j of a head holds the j-th prompt token its static eviction kept)."""
    out = []
    for attended, keep in zip(slots, keep_masks):
        attended = np.asarray(attended) > 0
        mask = np.zeros(keep.shape, bool)
        for h in range(keep.shape[0]):
            kept = np.flatnonzero(keep[h])
            mask[h, kept] = attended[h, :len(kept)]
        out.append(mask)
    return out


def span_coverage(mask: np.ndarray, spans: Sequence[tuple[int, int]]) -> float:
    """Share of the tokens in `spans` ([start, end) prompt positions) that `mask` ([H_kv, T]
    or [T], bool) marks, averaged over heads."""
    positions = np.concatenate([np.arange(a, b) for a, b in spans]) if spans else np.zeros(0, int)
    if positions.size == 0:
        return float("nan")
    mask = np.atleast_2d(np.asarray(mask, bool))
    return float(mask[:, positions].mean())
