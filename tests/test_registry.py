"""Properties every registered policy must have (the registry is enumerated, so a new policy
is covered as soon as it is registered):

1. budget 100% gives the `full` logits (llama-tiny and gpt2-tiny, a few decode steps);
2. a decode step attends to at most the budget of prompt tokens (value-tag probe below);
3. the jitted decode step compiles once per policy and is reused across steps.

The probe: a synthetic dense cache whose value vectors are one-hot tags (token j's value is
e_j, head_dim >= prompt + new tokens), compressed by the policy itself and decoded through its
own `attend`. The attention output of a head is then sum_j p_j e_j, so its nonzero entries are
exactly the tokens that head attended to with nonzero weight, whatever the policy gathers,
clusters or masks internally. A policy holding a per-layer budget (a `LayerBudget`) is held
to its own per-layer counts, whose mean must not exceed the budget.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpcache_jax import analysis
from mpcache_jax import primitives as P
from mpcache_jax.cache import LayerKV
from mpcache_jax.policies import (POLICY_NAMES, make_policy, policy_class, policy_family,
                                  seam_violations)
from mpcache_jax.policies.base import DecodeEvictionPolicy, PromptEvictionPolicy
from mpcache_jax.policies.snapkv import SnapKV
from mpcache_jax.policy import FULL, PrefillAux
from models import registry
from runtime.generate import compress_cache
from tests.decode_helpers import teacher_forced_logits

NO_BUDGET = ("full", "no_cache")
BUDGETED = tuple(n for n in POLICY_NAMES if n not in NO_BUDGET)


def _load(name):
    lm = registry.load(name)
    tokens = np.random.RandomState(0).randint(0, lm.model.cfg.vocab_size, size=110)
    return lm.model, lm.params, tokens


@pytest.fixture(scope="module",
                params=["llama-tiny", pytest.param("gpt2-tiny", marks=pytest.mark.slow)])
def tiny(request):
    return _load(request.param)


@pytest.fixture(scope="module")
def llama():
    return _load("llama-tiny")


def _decode_logits(model, params, tokens, policy, prompt_len=100, steps=4):
    """Logits of `steps` teacher-forced decode steps; asserts the jitted step is reused."""
    return teacher_forced_logits(model, params, tokens, policy, prompt_len, steps,
                                 check_one_compile=True)[0]


@pytest.fixture(scope="module")
def full_logits(tiny):
    model, params, tokens = tiny
    return _decode_logits(model, params, tokens, make_policy("full"))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_full_budget_equals_full(tiny, full_logits, name):
    model, params, tokens = tiny
    got = _decode_logits(model, params, tokens, make_policy(name, 1.0))
    assert np.abs(got - full_logits).max() <= 1e-5


@pytest.mark.parametrize("name", BUDGETED)
def test_compiles_once_with_eviction(llama, name):
    model, params, tokens = llama
    _decode_logits(model, params, tokens, make_policy(name, 0.5))


# --- budget probe -------------------------------------------------------------------------
LAYERS, HEADS, KV_HEADS, PROMPT, STEPS = 4, 4, 2, 200, 3
DIM = 208                      # >= PROMPT + STEPS, divisible by small sub-space counts


@functools.partial(jax.jit, static_argnames="policy")
def _probe_step(policy, q, k_new, v_new, cache):
    """One decode step of every layer with the same v_new. q: [L, H, d]; k_new: [L, H_kv, d]."""
    carry = policy.init_carry()
    outs, states = [], []
    for layer, state in enumerate(cache):
        out, state, carry = policy.attend(layer, q[layer], k_new[layer], v_new, state, carry)
        outs.append(out)
        states.append(state)
    return jnp.stack(outs), tuple(states)


def _probe_inputs():
    """The synthetic dense cache and prefill aux of the probe, and its decode steps' inputs."""
    rng = np.random.RandomState(3)
    tags = np.eye(PROMPT + STEPS, DIM, dtype=np.float32)
    cache = []
    for _ in range(LAYERS):
        k = np.zeros((KV_HEADS, PROMPT + STEPS, DIM), np.float32)
        k[:, :PROMPT] = rng.randn(KV_HEADS, PROMPT, DIM)
        v = np.zeros_like(k)
        v[:, :PROMPT] = tags[:PROMPT]
        cache.append(LayerKV(jnp.asarray(k), jnp.asarray(v), jnp.asarray(PROMPT, jnp.int32)))
    queries = tuple(jnp.asarray(rng.randn(HEADS, PROMPT, DIM), jnp.float32) for _ in range(LAYERS))
    steps = [(jnp.asarray(rng.randn(LAYERS, HEADS, DIM), jnp.float32),
              jnp.asarray(rng.randn(LAYERS, KV_HEADS, DIM), jnp.float32),
              jnp.broadcast_to(jnp.asarray(tags[PROMPT + step]), (KV_HEADS, DIM)))
             for step in range(STEPS)]
    return tuple(cache), PrefillAux(queries, PROMPT), steps


def _attended(policy, with_states: bool = False):
    """Per decode step, [L, H, T + STEPS] 0/1: which tokens each head attended to (and, with
    with_states, each step's layer states)."""
    cache, aux, steps = _probe_inputs()
    state = compress_cache(policy, cache, aux, STEPS)
    seen, states = [], []
    for q, k_new, v_new in steps:
        out, state = _probe_step(policy, q, k_new, v_new, state)
        seen.append(np.asarray(out) > 0)
        states.append(state)
    return (seen, states) if with_states else seen


def test_probe_sees_every_token_under_full_attention():
    for name in NO_BUDGET:
        for step, seen in enumerate(_attended(make_policy(name))):
            np.testing.assert_array_equal(seen[..., :PROMPT].sum(-1), PROMPT)
            np.testing.assert_array_equal(seen[..., PROMPT:].sum(-1), step + 1)


@pytest.mark.parametrize("budget", [0.25, pytest.param(64, marks=pytest.mark.slow),
                                    pytest.param(P.Budget(0.1, 48), marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", BUDGETED)
def test_attends_to_at_most_budget_prompt_tokens(name, budget):
    policy = make_policy(name, budget)
    limit = P.budget_tokens(budget, PROMPT)
    per_layer = np.full(LAYERS, limit)
    if isinstance(policy, PromptEvictionPolicy) and policy.layer_budget is not None:
        per_layer = np.asarray(policy.kept_counts(LAYERS, PROMPT))
        assert per_layer.mean() <= limit
    for step, seen in enumerate(_attended(policy)):
        prompt = seen[..., :PROMPT].sum(-1)                       # [L, H]
        assert (prompt >= 1).all()
        assert (prompt <= per_layer[:, None]).all(), (
            f"{name} step {step}: prompt tokens attended per layer/head {prompt.tolist()} > "
            f"budget {per_layer.tolist()}")
        assert (seen[..., PROMPT:].sum(-1) <= step + 1).all()


@pytest.mark.parametrize("name", [n for n in BUDGETED
                                  if analysis.supports_mechanism(make_policy(n, 0.25))])
def test_the_mechanism_probe_reports_the_prompt_tokens_a_step_attends(name):
    """SelectionProbe (the fidelity suite's mechanism metrics) decodes as the policy and names
    the prompt tokens each step attends to: per KV head, the tokens its query heads saw by the
    value tags."""
    policy = make_policy(name, 0.25)
    seen = _attended(policy)
    probed, states = _attended(analysis.SelectionProbe(inner=policy), with_states=True)
    cache, aux, _ = _probe_inputs()
    keep = analysis.prompt_keep_masks(policy, compress_cache(FULL, cache, aux, STEPS), aux)
    group = HEADS // KV_HEADS
    for step in range(STEPS):
        np.testing.assert_array_equal(probed[step], seen[step])       # decodes as the policy
        slots = [np.asarray(layer.attended) for layer in states[step]]
        reported = analysis.attended_positions(slots, keep)           # L x [H_kv, T]
        for layer in range(LAYERS):
            saw = seen[step][layer, :, :PROMPT].reshape(KV_HEADS, group, PROMPT).any(axis=1)
            np.testing.assert_array_equal(reported[layer], saw, err_msg=f"{name} step {step} "
                                          f"layer {layer}")
        assert 0 < np.mean([r.sum() for r in reported]) < KV_HEADS * PROMPT


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_registered_policy_keeps_to_its_family_seam(name):
    assert seam_violations(policy_class(name)) == []


def test_the_seam_check_names_redefined_machinery_and_a_missing_required_hook():
    @dataclasses.dataclass(frozen=True)
    class Rewrites(SnapKV):
        def compress(self, cache, aux, max_new_tokens):
            return super().compress(cache, aux, max_new_tokens)

    @dataclasses.dataclass(frozen=True)
    class Half(DecodeEvictionPolicy):
        def keep_scores(self, layer, q, k, extent, carry):
            return k[..., 0], carry

    assert seam_violations(Rewrites) == [
        "Rewrites.compress redefines PromptEvictionPolicy's shared machinery; a "
        "PromptEvictionPolicy writes only keep_scores, forced_keep, compress_carry, check_prompt"]
    assert seam_violations(Half) == [
        "Half does not write DecodeEvictionPolicy's required hook step_scores"]
    assert policy_family(Rewrites) is PromptEvictionPolicy and policy_family(Half) is DecodeEvictionPolicy


def test_the_seam_check_holds_mpcache_variants_to_settings_only():
    """MPCache is a family whose variants differ in settings, not code (HOOKS = ()):
    `mpcache_prefixkv` is checked against it (it holds a layer budget and writes no method);
    a variant that rewrites MPCache's scoring is named."""
    from mpcache_jax.policies.mpcache import MPCache
    from mpcache_jax.policies.prefixkv import MPCachePrefixKV

    @dataclasses.dataclass(frozen=True)
    class Rescored(MPCache):
        def keep_scores(self, layer, q, k, extent, carry):
            return k[..., 0], carry

    assert policy_family(policy_class("mpcache_prefixkv")) is MPCache
    assert seam_violations(MPCachePrefixKV) == []
    assert seam_violations(Rescored) == [
        "Rescored.keep_scores redefines MPCache's shared machinery; a MPCache writes no "
        "method (its variants differ in settings)"]
