"""The public program of a node config's job: secure greedy generation with one policy.

`secure_generation(params, prompt)` runs prefill, the policy's compression and
`max_new_tokens - 1` decode steps as ONE jax function, so SPU compiles it into one executable
that every party runs. Weights and prompt are its only (secret) inputs; token counts and
positions are static (public), so cache appends need no secret indexing.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models import registry
from models.model import Model
from models.transformer import DecoderLM
from mpcache_jax.policies import make_policy
from mpcache_jax.policy import AttentionPolicy, PrefillAux
from mpcache_jax.distributed.config import JobSpec


@dataclasses.dataclass(frozen=True)
class GenerationProgram:
    """Static description of the generation: model, policy and shapes (hashable, public)."""

    model: Model
    policy: AttentionPolicy
    seq_len: int
    max_new_tokens: int
    with_logits: bool = False

    def __call__(self, params: dict, prompt: jax.Array) -> tuple[jax.Array, ...]:
        """params: the model's pytree; prompt: int32 [T]. Returns (tokens int32 [N],) or, with
        `with_logits`, (tokens, logits [N, V]) where logits[i] produced tokens[i] (greedy)."""
        module, T, N = self.model.module, self.seq_len, self.max_new_tokens
        cache = self.model.init_cache(T + N)
        logits, cache, queries = module.apply({"params": params}, prompt, cache,
                                              self.policy.needs_queries, False,
                                              method=DecoderLM.prefill)
        state = self.policy.compress(cache, PrefillAux(queries=queries, prompt_len=T), N)
        tokens, step_logits = [], []
        for step in range(N):
            token = jnp.argmax(logits).astype(jnp.int32)
            tokens.append(token)
            step_logits.append(logits)
            if step + 1 < N:
                logits, state = module.apply({"params": params}, token, jnp.int32(T + step),
                                             state, self.policy, method=DecoderLM.decode)
        if self.with_logits:
            return jnp.stack(tokens), jnp.stack(step_logits)
        return (jnp.stack(tokens),)


def _frozen(value):
    """JSON lists -> tuples, so policy options stay hashable (policies are static jit args)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def build_program(job: JobSpec) -> GenerationProgram:
    cfg = registry.get_config(job.model, num_layers=job.num_layers)
    options = {k: _frozen(v) for k, v in job.policy_options.items()}
    policy = make_policy(job.policy, job.budget, **options)
    return GenerationProgram(Model(cfg), policy, job.seq_len, job.max_new_tokens,
                             with_logits=job.reveal_logits)


def load_weights(job: JobSpec) -> dict:
    """The model owner's private input (random weights for random-weight models)."""
    return registry.load(job.model, num_layers=job.num_layers, seed=job.seed).params


def load_prompt(job: JobSpec, vocab_size: int) -> np.ndarray:
    """The prompt owner's private input: int32 [seq_len]."""
    if job.prompt_ids is not None:
        ids = np.asarray(job.prompt_ids, np.int32)
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"job.prompt_ids must lie in [0, {vocab_size})")
        return ids
    return np.random.default_rng(job.prompt_seed).integers(0, vocab_size, job.seq_len,
                                                           dtype=np.int32)


def plaintext_reference(job: JobSpec) -> tuple[np.ndarray, np.ndarray]:
    """The same program under XLA (tests compare the secure run against it)."""
    program = dataclasses.replace(build_program(job), with_logits=True)
    params = load_weights(job)
    tokens, logits = jax.jit(program)(params, load_prompt(job, program.model.cfg.vocab_size))
    return np.asarray(tokens), np.asarray(logits)
