"""Cache fields declare their visibility where they are defined; the step programs read the
declarations (runtime.programs.cache_visibility) instead of guessing from a field's name."""
import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import registry
from mpcache_jax.cache import LayerKV, public_field
from mpcache_jax.policies import POLICY_NAMES, make_policy
from mpcache_jax.policy import AttentionPolicy
from runtime.generate import apply_policy
from runtime.programs import PUBLIC, SECRET, StepPrograms, cache_visibility


def _public_leaves(cache) -> set[str]:
    flags = cache_visibility(cache)
    return {jax.tree_util.keystr(path) for path, flag in
            jax.tree_util.tree_flatten_with_path(flags)[0] if flag == PUBLIC}


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "no_cache"])
def test_every_policy_state_declares_its_fields_and_only_counters_are_public(name):
    lm = registry.load("llama-tiny", num_layers=2)
    prompt = list(np.random.RandomState(0).randint(0, 256, 100))
    policy = make_policy(name, 0.5)
    _, dense, aux = lm.model.prefill(lm.params, prompt, lm.model.init_cache(104),
                                     return_queries=policy.needs_queries)
    cache = apply_policy(policy, dense, aux, 4)
    public = _public_leaves(cache)
    assert all(path.endswith(".length") for path in public), public


@flax.struct.dataclass
class TaggedKV(LayerKV):
    """A state with one more array field that forgot to declare its visibility."""
    tag: jax.Array = None


@flax.struct.dataclass
class LeakyKV(LayerKV):
    """A field declared public whose value is computed from secrets."""
    peek: jax.Array = public_field(default=None)


@dataclasses.dataclass(frozen=True)
class ExtraFieldPolicy(AttentionPolicy):
    """`full`'s attention over a LayerKV subclass with one more field (`extra`), set at
    compress to zeros and, when `from_key`, to the new key's sum at every step."""
    name: str = "extra_field"
    state_type: type = TaggedKV
    extra: str = "tag"
    from_key: bool = False

    def compress(self, cache, aux, max_new_tokens):
        return tuple(self.state_type(layer.k, layer.v, layer.length, jnp.zeros(()))
                     for layer in cache)

    def attend(self, layer, q, k_new, v_new, state, carry):
        out, appended, carry = super().attend(layer, q, k_new, v_new, state, carry)
        extra = {self.extra: jnp.sum(k_new)} if self.from_key else {}
        return out, state.replace(k=appended.k, v=appended.v, length=appended.length,
                                  **extra), carry


def _decode_visibility(policy):
    lm = registry.load("llama-tiny", num_layers=2)
    progs = StepPrograms(lm.model, policy, 16, 4)
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lm.params)
    return progs.decode_visibility(shapes)


def test_a_field_without_a_declared_visibility_cannot_enter_a_secure_program():
    with pytest.raises(ValueError, match=r"TaggedKV\.tag declares no visibility: define it "
                                         r"with mpcache_jax\.cache\.secret_field\(\)"):
        _decode_visibility(ExtraFieldPolicy())


def test_a_field_declared_public_that_depends_on_a_secret_is_refused():
    with pytest.raises(ValueError, match=r"\.peek are declared public but depend on a secret"):
        _decode_visibility(ExtraFieldPolicy(state_type=LeakyKV, extra="peek", from_key=True))
    declared = cache_visibility(LeakyKV(jnp.zeros(2), jnp.zeros(2), jnp.zeros(()), jnp.zeros(())))
    assert (declared.k, declared.length, declared.peek) == (SECRET, PUBLIC, PUBLIC)


def test_step_programs_build_each_program_once():
    lm = registry.load("llama-tiny", num_layers=2)
    progs = StepPrograms(lm.model, make_policy("mpcache", 0.5), 16, 4)
    assert progs.prefill is progs.prefill and progs.decode is progs.decode
