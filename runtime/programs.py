"""The step programs of generation, defined once for every backend, with the visibility of
each input and output.

Threat model (MPCache, Appendix B.1): the server holds the weights, the client the prompt;
token counts and positions are public; every value derived from the prompt or the weights
(activations, scores, selections, one-hot matrices, the KV cache) stays secret. Only the
sampled token of each step is revealed, to the client, who feeds it back as a secret one-hot
row (a secret token id would otherwise need a secret-index embedding gather).

    progs = StepPrograms(model, policy, prompt_len=T, max_new_tokens=N)
    progs.prefill    (params, prompt [T] ids or one-hot [T, V], empty cache) -> (token, logits, cache)
                     dense prefill + the policy's compression (static eviction) in one program
                     (of the global layers: a model's sliding-window layers keep their window)
    progs.decode     (params, token [] id or one-hot [V], pos [], cache) -> (token, logits, cache)
    progs.prefill_args(params_shape) / progs.prefill_visibility()
    progs.decode_args(params_shape)  / progs.decode_visibility(params_shape)

Every backend compiles these (`mpc.backends`: XLA, the SPU simulator; `distributed`: one SPU
party per process) and the session loop (`mpc.secure.SecureSession`) drives them. Plaintext
entry points with ids instead of one-hots (`models.model.Model.prefill/decode_step`) call
the same model functions (`models.model.dense_prefill`, `decode_logits`); the cost benchmarks add
`decode_layers`, `forward_layers` and `head` (the decode step split around the LM head).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax.cache import (NESTED, PUBLIC, SECRET, VISIBILITY, policy_layers,
                               with_policy_layers)
from mpcache_jax.policy import AttentionPolicy, PrefillAux
from models.model import decode_logits, dense_prefill
from models import transformer

# SECRET / PUBLIC: the visibility flags, as the cache states declare theirs.


def greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def prefill_fn(model, policy: AttentionPolicy, max_new_tokens: int):
    """(params, prompt, empty cache) -> (token, logits [V], policy cache): prefill and the
    policy's compression (static eviction) in one program."""
    def prefill(params, prompt, cache):
        logits, dense, queries = dense_prefill(model, params, prompt, cache, policy.needs_queries)
        aux = PrefillAux(queries=queries, prompt_len=prompt.shape[0],
                         normalized_keys=model.cfg.qk_norm)
        compressed = policy.compress(policy_layers(dense), aux, max_new_tokens)
        return greedy(logits), logits, with_policy_layers(dense, compressed)
    return prefill


def decode_fn(model, policy: AttentionPolicy):
    """(params, token, pos, cache) -> (token, logits [V], cache)."""
    def decode(params, token, pos, cache):
        logits, cache = decode_logits(model, policy, params, token, pos, cache)
        return greedy(logits), logits, cache
    return decode


def decode_layers_fn(model, policy: AttentionPolicy):
    """(params, token, pos, cache) -> (hidden [1, D], cache): a decode step's decoder layers
    without the LM head (cost runs: the head does not depend on the policy)."""
    def decode_layers(params, token, pos, cache):
        return transformer.decode_hidden(model.cfg, params, token, pos, cache, policy)
    return decode_layers


def forward_layers_fn(model):
    """(params, tokens [T, V]) -> hidden [1, D] of the last position: the decoder layers of a
    no-KV-cache decode step (recompute prompt + generated tokens)."""
    def forward_layers(params, tokens):
        return transformer.forward_hidden(model.cfg, params, tokens)
    return forward_layers


def head_fn(model):
    """(params, hidden [1, D]) -> (token, logits [V]): final norm, LM head, greedy argmax."""
    def head(params, hidden):
        logits = transformer.lm_logits(model.cfg, params, hidden)[0]
        return greedy(logits), logits
    return head


def onehot(ids, vocab: int) -> np.ndarray:
    """Token ids -> float32 one-hot rows (how the client's tokens enter a secure program)."""
    return np.asarray(jax.nn.one_hot(np.asarray(ids), vocab, dtype=jnp.float32))


# ----- visibility ----------------------------------------------------------------------------------
def broadcast_visibility(visibility, tree) -> list[str]:
    """Flat list of SECRET/PUBLIC, one per leaf of `tree`, from a prefix pytree of flags."""
    flags = jax.tree_util.tree_map(
        lambda flag, sub: [flag] * len(jax.tree_util.tree_leaves(sub)), visibility, tree,
        is_leaf=lambda x: x in (SECRET, PUBLIC))
    flat = [f for group in jax.tree_util.tree_leaves(flags, is_leaf=lambda x: isinstance(x, list))
            for f in group]
    bad = sorted({f for f in flat if f not in (SECRET, PUBLIC)})
    if bad:
        raise ValueError(f"visibility flags must be {SECRET!r} or {PUBLIC!r}, got {bad}")
    return flat


def dependency_visibility(fn, args: tuple, visibility) -> Any:
    """SECRET/PUBLIC for every output of `fn(*args)`: public only when it depends on public
    inputs alone (dependency analysis of the jaxpr, `secret_outputs`). `args` may hold
    jax.ShapeDtypeStruct leaves."""
    flags = broadcast_visibility(visibility, args)
    closed = jax.make_jaxpr(fn)(*args)
    secret = secret_outputs(closed.jaxpr, [f == SECRET for f in flags])
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(fn, *args))
    return jax.tree_util.tree_unflatten(out_tree, [SECRET if s else PUBLIC for s in secret])


def secret_outputs(jaxpr, secret_in: list[bool]) -> list[bool]:
    """Which outputs of `jaxpr` depend on a secret input. Loops, conditionals and calls are
    followed into their bodies, as SPU sees them: a loop's carried value is secret when its
    initial value or any iteration makes it so (a fixed point), so a public counter carried
    beside secret values stays public; a conditional on a secret predicate makes every output
    secret (SPU runs both branches and selects). Other operations: secret when any input is."""
    secret = {}

    def is_secret(v):
        return not isinstance(v, jax.core.Literal) and secret.get(id(v), False)
    for v, flag in zip(jaxpr.invars, secret_in):
        secret[id(v)] = flag
    for v in jaxpr.constvars:
        secret[id(v)] = False
    for eqn in jaxpr.eqns:
        ins = [is_secret(v) for v in eqn.invars]
        outs = _secret_outputs_of(eqn, ins)
        for v, flag in zip(eqn.outvars, outs):
            secret[id(v)] = flag
    return [is_secret(v) for v in jaxpr.outvars]


def _secret_outputs_of(eqn, ins: list[bool]) -> list[bool]:
    name, params = eqn.primitive.name, eqn.params
    inner = lambda closed, flags: secret_outputs(closed.jaxpr, flags)
    if name == "scan":
        consts, carry = params["num_consts"], params["num_carry"]
        c_in, carry_in, xs_in = ins[:consts], ins[consts:consts + carry], ins[consts + carry:]
        while True:
            out = inner(params["jaxpr"], c_in + carry_in + xs_in)
            merged = [a or b for a, b in zip(carry_in, out[:carry])]
            if merged == carry_in:
                return out[:carry] + out[carry:]
            carry_in = merged
    if name == "while":
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        cond_c, body_c, carry_in = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        while True:
            out = inner(params["body_jaxpr"], body_c + carry_in)
            merged = [a or b for a, b in zip(carry_in, out)]
            if merged == carry_in:
                if inner(params["cond_jaxpr"], cond_c + carry_in)[0]:
                    return [True] * len(carry_in)
                return carry_in
            carry_in = merged
    if name == "cond":
        if ins[0]:
            return [True] * len(eqn.outvars)
        branches = [inner(branch, ins[1:]) for branch in params["branches"]]
        return [any(flags) for flags in zip(*branches)]
    if name in ("pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
                "custom_vjp_call", "custom_vjp_call_jaxpr"):
        sub = params.get("jaxpr") or params.get("call_jaxpr") or params.get("fun_jaxpr")
        if sub is not None:
            closed = sub if hasattr(sub, "jaxpr") else jax.core.ClosedJaxpr(sub, ())
            if len(closed.jaxpr.invars) == len(ins):
                return inner(closed, ins)
    return [any(ins)] * len(eqn.outvars)


def cache_visibility(cache) -> Any:
    """SECRET/PUBLIC for every cache leaf, as each state declares its fields where they are
    defined (`mpcache_jax.cache.secret_field` / `public_field` / `nested_field`): a tree of the
    cache's structure with a flag per leaf. A field holding arrays that declares no visibility
    is an error naming it: nothing is secret or public by how a field is spelled."""
    if cache is None:
        return None
    if isinstance(cache, (tuple, list)):
        return type(cache)(cache_visibility(x) for x in cache)
    if isinstance(cache, dict):
        return {k: cache_visibility(v) for k, v in cache.items()}
    if not dataclasses.is_dataclass(cache) or isinstance(cache, type):
        raise ValueError(f"a cache leaf of type {type(cache).__name__} is not inside a cache "
                         "state with declared fields (mpcache_jax.cache.secret_field / "
                         "public_field)")
    flags = {}
    for field in dataclasses.fields(cache):
        if not field.metadata.get("pytree_node", True):
            continue                                   # static: part of the program's shape
        value = getattr(cache, field.name)
        declared = field.metadata.get(VISIBILITY)
        if declared is None:
            if not jax.tree_util.tree_leaves(value):
                flags[field.name] = value              # nothing to share (None, empty)
                continue
            raise ValueError(f"{type(cache).__name__}.{field.name} declares no visibility: "
                             "define it with mpcache_jax.cache.secret_field(), public_field() "
                             "or nested_field()")
        if declared == NESTED:
            flags[field.name] = cache_visibility(value)
        else:
            flags[field.name] = jax.tree_util.tree_map(lambda _, flag=declared: flag, value)
    return dataclasses.replace(cache, **flags)


def shape_of(tree) -> Any:
    """The ShapeDtypeStruct tree of `tree` (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
        if not isinstance(x, jax.ShapeDtypeStruct) else x, tree)


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    """The prefill and decode programs of one generation shape and their input visibility.

    The decode program's cache visibility is the steady one: the prefill's outputs (masks of
    kept slots derived from public counts stay public), with every leaf a decode step makes
    secret made secret, until a step maps the visibility to itself.
    """

    model: Any                       # models.model.Model
    policy: AttentionPolicy
    prompt_len: int
    max_new_tokens: int

    @property
    def capacity(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def vocab(self) -> int:
        return self.model.cfg.vocab_size

    @functools.cached_property
    def prefill(self):
        """The prefill program (built once per instance: one function object, so a jit or a
        backend compile keyed by it is reused)."""
        return prefill_fn(self.model, self.policy, self.max_new_tokens)

    @functools.cached_property
    def decode(self):
        return decode_fn(self.model, self.policy)

    def empty_cache(self):
        return self.model.init_cache(self.capacity)

    # prefill ------------------------------------------------------------------------------------
    def prefill_args(self, params_shape) -> tuple:
        return (params_shape, jax.ShapeDtypeStruct((self.prompt_len, self.vocab), jnp.float32),
                shape_of(self.empty_cache()))

    def prefill_visibility(self) -> tuple:
        return (SECRET, SECRET, cache_visibility(self.empty_cache()))

    def prefill_output_visibility(self, params_shape):
        return dependency_visibility(self.prefill, self.prefill_args(params_shape),
                                     self.prefill_visibility())

    # decode -------------------------------------------------------------------------------------
    def cache_example(self, params_shape):
        """ShapeDtypeStruct tree of the policy's decode cache."""
        return jax.eval_shape(self.prefill, *self.prefill_args(params_shape))[2]

    def decode_args(self, params_shape) -> tuple:
        return (params_shape, jax.ShapeDtypeStruct((self.vocab,), jnp.float32),
                jax.ShapeDtypeStruct((), jnp.int32), self.cache_example(params_shape))

    def decode_visibility(self, params_shape, start=None) -> tuple:
        return (SECRET, SECRET, PUBLIC, self.steady_cache_visibility(params_shape, start))

    def steady_cache_visibility(self, params_shape, start=None):
        """start: the prefill's output cache visibility (default: by dependency analysis; a
        backend passes its compiled prefill's)."""
        args = self.decode_args(params_shape)
        cache_example = args[3]
        tree = jax.tree_util.tree_structure(cache_example)
        declared = broadcast_visibility(cache_visibility(cache_example), cache_example)
        if start is None:
            start = self.prefill_output_visibility(params_shape)[2]
        flags = broadcast_visibility(start, cache_example)
        for _ in range(8):
            out = dependency_visibility(self.decode, args, (
                SECRET, SECRET, PUBLIC, jax.tree_util.tree_unflatten(tree, flags)))[2]
            out_flags = broadcast_visibility(out, cache_example)
            merged = [SECRET if SECRET in (a, b) else PUBLIC for a, b in zip(flags, out_flags)]
            if merged == flags:
                break
            flags = merged
        else:
            raise RuntimeError("cache visibility did not reach a fixed point")
        # A field declared public must be computed from public values only (a counter): one that
        # depends on a secret would be revealed by sharing it as public.
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(cache_example)[0]]
        leaks = [path for path, want, got in zip(paths, declared, flags)
                 if want == PUBLIC and got == SECRET]
        if leaks:
            raise ValueError(f"cache field(s) {', '.join(leaks[:4])} are declared public but "
                             "depend on a secret in the step programs; declare them "
                             "secret_field()")
        return jax.tree_util.tree_unflatten(tree, flags)
