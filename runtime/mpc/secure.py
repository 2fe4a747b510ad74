"""Secure generation: the step programs (`runtime.programs`) compiled once and driven
under MPC, one token at a time, on any backend.

    session = SecureSession(backend, model, params, policy)
    result = session.generate(prompt_ids, max_new_tokens=8)   # tokens, per-step RunCost, wall

The weights are shared once per session; prefill (with the policy's static eviction) and the
decode step are compiled once per prompt length (positions are public runtime inputs, so one
decode program serves every step); the KV cache stays secret-shared between steps. Only each
step's sampled token is revealed, to the client, who feeds it back as a secret one-hot row.

The same loop runs on every backend (`xla`, `spu_sim`, and one party of a multi-process run,
`runtime.distributed`): a party that does not own an input passes its shape
(`jax.ShapeDtypeStruct`) instead of the value, learns revealed values only when it is their
owner, and follows the client's public decisions (stop after an end-of-turn token).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from runtime import programs
from runtime.mpc.backends import CLIENT, PUBLIC, SECRET, SERVER, secret_reveals  # noqa: F401
from runtime.mpc.profile_log import RunCost
from mpcache_jax.policy import AttentionPolicy
from runtime.programs import (StepPrograms, cache_visibility, onehot, shape_of)


# How the prompt is prefilled: "secure" (the private run) or "clear" (decode benchmarks: the
# model owner prefills a public prompt in plaintext and secret-shares the cache).
PREFILL_MODES = ("secure", "clear")


# ----- sessions -------------------------------------------------------------------------------
@dataclasses.dataclass
class StepCost:
    phase: str          # "prefill" | "decode"
    position: int
    wall_s: float
    cost: RunCost | None


@dataclasses.dataclass
class SecureGeneration:
    tokens: list[int] | None     # None on a party that is not the client
    steps: list[StepCost]
    compile_s: float
    logits: list[np.ndarray] | None = None   # with reveal_logits, on the client


class SecureSession:
    """Weights shared once; prefill/decode programs compiled once per prompt length; the KV
    cache stays shared. `params`: the weights (on the server) or their ShapeDtypeStruct tree
    (a party that does not own them)."""

    def __init__(self, backend, model, params, policy: AttentionPolicy):
        self.backend, self.model, self.policy = backend, model, policy
        self._params_shape = shape_of(params)
        owns_weights = not any(isinstance(leaf, jax.ShapeDtypeStruct)
                               for leaf in jax.tree_util.tree_leaves(params))
        self._params_clear = params if owns_weights else None   # for prefill="clear" only
        self.params = backend.share(params, SECRET, owner=SERVER)
        self._compiled: dict = {}
        self._clear_prefill: dict = {}     # (prompt_len, max_new_tokens) -> jitted plaintext prefill

    @property
    def vocab(self) -> int:
        return self.model.cfg.vocab_size

    def programs(self, prompt_len: int, max_new_tokens: int) -> StepPrograms:
        return StepPrograms(self.model, self.policy, prompt_len, max_new_tokens)

    def compile(self, progs: StepPrograms):
        """(prefill program, decode program, decode cache visibility), compiled once per shape.
        The decode program's cache visibility starts from the compiled prefill's outputs."""
        key = (progs.prompt_len, progs.max_new_tokens)
        if key not in self._compiled:
            ps = self._params_shape
            prefill = self.backend.compile(progs.prefill, progs.prefill_args(ps),
                                           progs.prefill_visibility())
            out = jax.tree_util.tree_unflatten(prefill.out_tree, prefill.out_visibility)
            cache_vis = progs.steady_cache_visibility(ps, out[2])
            decode = self.backend.compile(progs.decode, progs.decode_args(ps),
                                          (SECRET, SECRET, PUBLIC, cache_vis))
            self._compiled[key] = (prefill, decode, cache_vis)
        return self._compiled[key]

    def prefill_in_clear(self, progs: StepPrograms, compiled, prompt_ids: Sequence[int]):
        """Decode benchmarks only -- neither the prompt nor the cache stays private: the model
        owner runs the prefill program (with the policy's compression) in plaintext on a
        public prompt and secret-shares its outputs; the decode steps that follow are the
        secure ones, whose cost does not depend on the values they compute on. Saves the
        secure prefill's time and memory (a [T, V] one-hot product and T x T attention per
        head), which bound the prompt length of a multi-process run.

        Every party calls this with the same public prompt_ids. Public outputs (slot counters)
        depend on public inputs only, so a party without the weights computes them itself
        on zero weights. -> ((token, logits, cache) shared as the compiled prefill's outputs,
        wall seconds)."""
        if prompt_ids is None:
            raise ValueError('prefill="clear" needs the public prompt_ids on every party')
        params = self._params_clear
        if params is None:
            params = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype),
                                            self._params_shape)
        start = time.perf_counter()
        key = (progs.prompt_len, progs.max_new_tokens)
        if key not in self._clear_prefill:     # `progs.prefill` is a new function each time
            self._clear_prefill[key] = jax.jit(progs.prefill)
        outputs = self._clear_prefill[key](params, onehot(prompt_ids, self.vocab),
                                           progs.empty_cache())
        visibility = jax.tree_util.tree_unflatten(compiled.out_tree, compiled.out_visibility)
        owner = self._params_clear is not None
        values = jax.tree_util.tree_map(
            lambda vis, x: np.asarray(x) if owner or vis == PUBLIC
            else jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), visibility, outputs)
        shared = self.backend.share(values, visibility, owner=SERVER)
        return shared, time.perf_counter() - start

    def decode(self, program, token: int | None, pos: int, cache_shared):
        """One secure decode step from a shared cache -> (token or None, logits_shared,
        cache_shared, RunCost, wall_s). Only the token is revealed, to the client (who passes
        the previous token; the other parties pass None)."""
        tok = self.backend.share(onehot(token, self.vocab) if token is not None else
                                 jax.ShapeDtypeStruct((self.vocab,), jnp.float32),
                                 SECRET, owner=CLIENT)
        pos_sh = self.backend.share(np.int32(pos), PUBLIC)
        (tok_out, logits, cache_shared), cost, wall = self.backend.run(
            program, self.params, tok, pos_sh, cache_shared)
        return self._reveal_token(tok_out), logits, cache_shared, cost, wall

    def _reveal_token(self, shared) -> int | None:
        value = self.backend.reveal(shared, to=CLIENT)
        return None if value is None else int(value)

    def generate(self, prompt_ids: Sequence[int] | None, max_new_tokens: int, *,
                 prompt_len: int | None = None, stop_ids: Sequence[int] = (),
                 on_step: Callable[[StepCost, int | None], None] | None = None,
                 on_phase: Callable[[str], None] | None = None,
                 reveal_logits: bool = False, prefill: str = "secure") -> SecureGeneration:
        """Greedy secure generation of up to `max_new_tokens` tokens (the first from prefill),
        stopping after a token in `stop_ids`. A party that is not the client passes
        prompt_ids=None and the public prompt_len. `on_step(step, token)` after each step
        (token None off the client): progress bars, streaming. `on_phase(name)` as a phase
        begins: "compile" (both programs; instant when compiled before), then "prefill" (the
        first step, secure or clear); decode begins when on_step reports the prefill.
        reveal_logits also opens each step's logits to the client (tests: it reveals more
        than the tokens).
        prefill="clear" (decode benchmarks, not private): see `prefill_in_clear`; every party
        passes the public prompt_ids, and the prefill step is recorded without an MPC cost."""
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill={prefill!r}; use one of {PREFILL_MODES}")
        T = len(prompt_ids) if prompt_ids is not None else prompt_len
        if T is None:
            raise ValueError("give prompt_ids, or prompt_len on a party without the prompt")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
        progs = self.programs(T, max_new_tokens)
        if on_phase:
            on_phase("compile")
        start = time.perf_counter()
        prefill_prog, decode, cache_vis = self.compile(progs)
        compile_s = time.perf_counter() - start
        if on_phase:
            on_phase("prefill")
        if prefill == "clear":
            (tok, logits, cache_sh), wall = self.prefill_in_clear(progs, prefill_prog, prompt_ids)
            cost = None
        else:
            prompt = self.backend.share(
                onehot(prompt_ids, self.vocab) if prompt_ids is not None else
                jax.ShapeDtypeStruct((T, self.vocab), jnp.float32), SECRET, owner=CLIENT)
            empty = progs.empty_cache()   # public zeros and counters
            cache_sh = self.backend.share(empty, cache_visibility(empty), owner=CLIENT)
            (tok, logits, cache_sh), cost, wall = self.backend.run(prefill_prog, self.params,
                                                                   prompt, cache_sh)
        cache_sh = self.backend.to_visibility(cache_sh, cache_vis)
        token = self._reveal_token(tok)
        tokens = [token] if token is not None else None
        revealed = []

        def keep_logits(shared):
            if reveal_logits:
                value = self.backend.reveal(shared, to=CLIENT)
                if value is not None:
                    revealed.append(np.asarray(value))
        keep_logits(logits)
        steps = [StepCost("prefill" if prefill == "secure" else "prefill_clear", T, wall,
                          cost)]
        stops = {int(s) for s in stop_ids}
        if on_step:
            on_step(steps[-1], token)
        for step in range(max_new_tokens - 1):
            stop = self.backend.agree(token in stops if token is not None else None, owner=CLIENT)
            if stop:
                break
            token, logits, cache_sh, cost, wall = self.decode(decode, token, T + step, cache_sh)
            keep_logits(logits)
            if tokens is not None:
                tokens.append(token)
            steps.append(StepCost("decode", T + step, wall, cost))
            if on_step:
                on_step(steps[-1], token)
        return SecureGeneration(tokens, steps, compile_s, revealed if revealed else None)
