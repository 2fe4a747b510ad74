"""Secure generation: prefill + static eviction + decode steps compiled once and run under MPC.

Threat model (MPCache, Appendix B.1): the server secret-shares the weights, the client its
prompt; token counts and positions are public; every value derived from the prompt or the
weights (activations, scores, selected indices, one-hot matrices, the KV cache) stays secret.
Only the sampled token of each step is revealed, to the client, who feeds it back as a secret
one-hot row (a secret token id would otherwise need a secret-index embedding gather).

Programs (the same jittable functions run on every backend):

    prefill_fn(model, policy, max_new)(params, prompt_onehot [T, V], cache) -> (token, logits, cache)
    decode_fn(model, policy)(params, token_onehot [V], pos, cache)          -> (token, logits, cache)
    forward_fn(model)(params, tokens_onehot [T, V])                          -> (token, logits)

`token` is the greedy argmax (int32, secret until revealed); `logits` stay secret (tests
reveal them to compare with plaintext; generation never does). In the cache only the
`length` counters are public inputs (the public position of the next slot).

    session = SecureSession(backend, model, params, policy)
    result = session.generate(prompt_ids, max_new_tokens=8)   # tokens, per-step RunCost, wall
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax.mpc.backends import (CLIENT, PUBLIC, SECRET, SERVER, broadcast_visibility,
                                      dependency_visibility)
from mpcache_jax.mpc.costs import RunCost
from mpcache_jax.policy import AttentionPolicy, PrefillAux
from models.transformer import DecoderLM

PUBLIC_CACHE_FIELDS = ("length",)


def cache_visibility(cache) -> Any:
    """SECRET for every cache leaf except token counters (`length`: public slot positions)."""
    def flag(path, _leaf):
        last = path[-1] if path else None
        name = getattr(last, "name", getattr(last, "key", None))
        return PUBLIC if name in PUBLIC_CACHE_FIELDS else SECRET
    return jax.tree_util.tree_map_with_path(flag, cache)


def steady_cache_visibility(model, policy: AttentionPolicy, params_shape, cache_example,
                            cache_vis) -> Any:
    """Cache visibility that decode steps preserve: start from `cache_vis` (e.g. the prefill's
    outputs) and make secret every leaf a decode step turns secret (e.g. the empty buffer of
    generated tokens), until a decode step maps the visibility to itself."""
    args = (params_shape, jax.ShapeDtypeStruct((model.cfg.vocab_size,), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.int32), cache_example)
    fn = decode_fn(model, policy)
    flags = broadcast_visibility(cache_vis, cache_example)
    tree = jax.tree_util.tree_structure(cache_example)
    for _ in range(8):
        out = dependency_visibility(fn, args, (SECRET, SECRET, PUBLIC,
                                               jax.tree_util.tree_unflatten(tree, flags)))[2]
        out_flags = broadcast_visibility(out, cache_example)
        merged = [SECRET if SECRET in (a, b) else PUBLIC for a, b in zip(flags, out_flags)]
        if merged == flags:
            return jax.tree_util.tree_unflatten(tree, flags)
        flags = merged
    raise RuntimeError("cache visibility did not reach a fixed point")


def greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def decode_fn(model, policy: AttentionPolicy):
    """(params, token_onehot [V], pos int32 [], cache) -> (token, logits [V], cache)."""
    def secure_decode(params, token_onehot, pos, cache):
        logits, cache = model.module.apply({"params": params}, token_onehot, pos, cache, policy,
                                           method=DecoderLM.decode)
        return greedy(logits), logits, cache
    return secure_decode


def decode_layers_fn(model, policy: AttentionPolicy):
    """(params, token_onehot [V], pos, cache) -> (hidden [1, D], cache): the decoder layers of
    a decode step without the LM head (cost runs: the head does not depend on the policy)."""
    def secure_decode_layers(params, token_onehot, pos, cache):
        return model.module.apply({"params": params}, token_onehot, pos, cache, policy,
                                  method=DecoderLM.decode_hidden)
    return secure_decode_layers


def forward_layers_fn(model):
    """(params, tokens_onehot [T, V]) -> hidden [1, D] of the last position: the decoder layers
    of a no-KV-cache decode step (recompute prompt + generated tokens)."""
    def secure_forward_layers(params, tokens_onehot):
        return model.module.apply({"params": params}, tokens_onehot,
                                  method=DecoderLM.forward_hidden)
    return secure_forward_layers


def head_fn(model):
    """(params, hidden [1, D]) -> (token, logits [V]): final norm, LM head, greedy argmax."""
    def secure_head(params, hidden):
        logits = model.module.apply({"params": params}, hidden, method=DecoderLM.lm_logits)[0]
        return greedy(logits), logits
    return secure_head


def prefill_fn(model, policy: AttentionPolicy, max_new_tokens: int):
    """(params, prompt_onehot [T, V], empty cache) -> (token, logits [V], policy cache).
    Static eviction (`policy.compress`) runs inside the same program."""
    def secure_prefill(params, prompt_onehot, cache):
        T = prompt_onehot.shape[0]
        logits, dense, queries = model.module.apply(
            {"params": params}, prompt_onehot, cache, policy.needs_queries, False,
            method=DecoderLM.prefill)
        cache = policy.compress(dense, PrefillAux(queries=queries, prompt_len=T), max_new_tokens)
        return greedy(logits), logits, cache
    return secure_prefill


def forward_fn(model):
    """(params, tokens_onehot [T, V]) -> (token, logits [V]): the no-KV-cache decode step
    (recomputes the whole sequence; `no_cache` policy)."""
    def secure_forward(params, tokens_onehot):
        logits = model.module.apply({"params": params}, tokens_onehot)[-1]
        return greedy(logits), logits
    return secure_forward


def onehot(ids, vocab: int) -> np.ndarray:
    return np.asarray(jax.nn.one_hot(np.asarray(ids), vocab, dtype=jnp.float32))


# ----- leakage check ------------------------------------------------------------------------
_DEF = re.compile(r"^\s*(?P<res>%[\w#:]+(?:\s*,\s*%[\w#:]+)*)\s*=\s*(?P<body>.*)$")
_VALUE = re.compile(r"%[\w]+(?:#\d+)?")


def secret_reveals(ir: str) -> list[str]:
    """Lines of a compiled pphlo module where a secret operand yields a public result (a
    reveal inside the program), plus any explicit reveal custom call. Empty = the program only
    makes public what was public on input."""
    secret: set[str] = set()
    bad = []
    for line in ir.splitlines():
        if "func.func" in line or "reducer(" in line or line.strip().startswith("^"):
            for name, typ in re.findall(r"(%\w+): (tensor<[^>]*(?:<[^>]*>)?[^>]*>)", line):
                if "secret" in typ:
                    secret.add(name)
            continue
        if "reveal" in line:
            bad.append(line.strip())
            continue
        m = _DEF.match(line)
        if not m:
            continue
        results = [r.split(":")[0].strip() for r in m["res"].split(",")]
        body = m["body"]
        type_part = body.rsplit("->", 1)[1] if "->" in body else body.rsplit(" : ", 1)[-1]
        operands = [v.split("#")[0] for v in _VALUE.findall(body.split(" : ")[0])]
        secret_in = any(v in secret for v in operands)
        result_types = re.findall(r"tensor<[^ ]*", type_part)
        if "secret" in type_part:
            secret.update(results)
        if secret_in and any("secret" not in t for t in result_types):
            bad.append(line.strip())
    return bad


# ----- sessions -------------------------------------------------------------------------------
@dataclasses.dataclass
class StepCost:
    phase: str          # "prefill" | "decode" | "forward"
    position: int
    wall_s: float
    cost: RunCost | None


@dataclasses.dataclass
class SecureGeneration:
    tokens: list[int]
    steps: list[StepCost]
    compile_s: float


class SecureSession:
    """Weights shared once; prefill/decode programs compiled once (positions are public
    runtime inputs, so one decode program serves every step); the KV cache stays shared."""

    def __init__(self, backend, model, params, policy: AttentionPolicy):
        self.backend, self.model, self.policy = backend, model, policy
        self.params = backend.share(params, SECRET, owner=SERVER)
        self._params_shape = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), params)
        self._programs: dict = {}

    @property
    def vocab(self) -> int:
        return self.model.cfg.vocab_size

    def _program(self, key, fn, args, vis):
        if key not in self._programs:
            self._programs[key] = self.backend.compile(fn, args, vis)
        return self._programs[key]

    def prefill_program(self, prompt_len: int, capacity: int, max_new_tokens: int):
        cache = self.model.init_cache(capacity)
        args = (self._params_shape, np.zeros((prompt_len, self.vocab), np.float32), cache)
        vis = (SECRET, SECRET, cache_visibility(cache))
        return self._program(("prefill", prompt_len, capacity, max_new_tokens),
                             prefill_fn(self.model, self.policy, max_new_tokens), args, vis)

    def decode_program(self, cache_example, cache_vis=None):
        """cache_vis: visibility of the cache leaves (default: `length` public, rest secret;
        pass the prefill's output visibility so that public-by-construction masks stay public)."""
        args = (self._params_shape, np.zeros((self.vocab,), np.float32), np.int32(0),
                cache_example)
        vis = (SECRET, SECRET, PUBLIC,
               cache_vis if cache_vis is not None else cache_visibility(cache_example))
        key = ("decode", jax.tree_util.tree_structure(cache_example),
               tuple(np.shape(x) for x in jax.tree_util.tree_leaves(cache_example)))
        return self._program(key, decode_fn(self.model, self.policy), args, vis)

    def forward_program(self, seq_len: int):
        args = (self._params_shape, np.zeros((seq_len, self.vocab), np.float32))
        return self._program(("forward", seq_len), forward_fn(self.model), args,
                             (SECRET, SECRET))

    def decode(self, token: int, pos: int, cache_shared, cache_example, cache_vis=None):
        """One secure decode step from a shared cache -> (token, logits_shared, cache_shared,
        RunCost, wall_s). Only `token` is revealed."""
        program = self.decode_program(cache_example, cache_vis)
        tok = self.backend.share(onehot(token, self.vocab), SECRET, owner=CLIENT)
        pos_sh = self.backend.share(np.int32(pos), PUBLIC)
        (tok_out, logits, cache_shared), cost, wall = self.backend.run(
            program, self.params, tok, pos_sh, cache_shared)
        return int(self.backend.reveal(tok_out)), logits, cache_shared, cost, wall

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> SecureGeneration:
        """Greedy secure generation of `max_new_tokens` tokens (the first from prefill)."""
        T = len(prompt_ids)
        capacity = T + max_new_tokens
        start = time.perf_counter()
        prefill = self.prefill_program(T, capacity, max_new_tokens)
        cache0 = self.model.init_cache(capacity)
        fn = prefill_fn(self.model, self.policy, max_new_tokens)
        cache_example = jax.eval_shape(fn, self._params_shape,
                                       jax.ShapeDtypeStruct((T, self.vocab), jnp.float32),
                                       cache0)[2]
        prefill_out = jax.tree_util.tree_unflatten(prefill.out_tree, prefill.out_visibility)
        cache_vis = steady_cache_visibility(self.model, self.policy, self._params_shape,
                                            cache_example, prefill_out[2])
        if max_new_tokens > 1:
            self.decode_program(cache_example, cache_vis)
        compile_s = time.perf_counter() - start
        prompt = self.backend.share(onehot(prompt_ids, self.vocab), SECRET, owner=CLIENT)
        cache_sh = self.backend.share(cache0, cache_visibility(cache0), owner=CLIENT)
        (tok, _, cache_sh), cost, wall = self.backend.run(prefill, self.params, prompt, cache_sh)
        cache_sh = self.backend.to_visibility(cache_sh, cache_vis)
        token = int(self.backend.reveal(tok))
        tokens, steps = [token], [StepCost("prefill", T, wall, cost)]
        for step in range(max_new_tokens - 1):
            token, _, cache_sh, cost, wall = self.decode(token, T + step, cache_sh, cache_example,
                                                         cache_vis)
            tokens.append(token)
            steps.append(StepCost("decode", T + step, wall, cost))
        return SecureGeneration(tokens, steps, compile_s)
