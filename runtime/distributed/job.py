"""The public side of a node config's job and each owner's private input.

Every party builds the same model geometry and policy from the job (public); the model owner
loads the weights, every other party only their shapes; the prompt owner loads its prompt (a
private file, or `seq_len` random ids for benchmarks). The programs are the session's step
programs (`runtime.programs`), run by `mpc.secure.SecureSession` on each party's
`NodeBackend`; `plaintext_session` runs the same session on the XLA backend (the reference
the tests compare the secure tokens and logits with).
"""
from __future__ import annotations

import pathlib

import numpy as np

from models import registry
from models.model import Model
from runtime.distributed.bounds import make_job_policy
from runtime.distributed.options import JobSpec
from mpcache_jax.policy import AttentionPolicy


def build(job: JobSpec) -> tuple[Model, AttentionPolicy]:
    """The job's model geometry and configured policy (public: every party builds them)."""
    cfg = registry.get_config(job.model, num_layers=job.num_layers)
    return Model(cfg), make_job_policy(job)


def weight_shapes(job: JobSpec):
    """The weights' ShapeDtypeStruct tree (public; what a party without the weights passes)."""
    model, _ = build(job)
    return model.param_shapes()


def load_weights(job: JobSpec) -> dict:
    """The model owner's private input (random weights for random-weight models)."""
    return registry.load(job.model, num_layers=job.num_layers, seed=job.seed).params


def prompt_text_ids(job: JobSpec, text: str, tokenizer) -> list[int]:
    """A prompt text's token ids as the prompt owner encodes them (the model's chat template
    when job.chat); a launcher that holds the text counts them the same way."""
    return tokenizer.encode_request(text, chat=job.chat)


def load_prompt(job: JobSpec, prompt_file: str | None = None) -> tuple[list[int], tuple[int, ...]]:
    """The prompt owner's private input -> (token ids, stop ids). From `prompt_file` (text,
    wrapped in the model's chat template when job.chat), else job.prompt_ids, else `seq_len`
    random ids drawn with job.prompt_seed (benchmarks, models without a tokenizer)."""
    vocab = registry.get_config(job.model).vocab_size
    if prompt_file is not None:
        path = pathlib.Path(prompt_file)
        if not path.is_file():
            raise ValueError(f"--prompt_file={prompt_file!r} is not a readable file")
        tokenizer = registry.load(job.model, num_layers=job.num_layers).tokenizer
        if tokenizer is None:
            raise ValueError(f"model {job.model!r} has no tokenizer: give job.prompt_ids or "
                             "job.seq_len random ids instead of a prompt file")
        return prompt_text_ids(job, path.read_text(), tokenizer), tuple(tokenizer.stop_ids)
    if job.prompt_ids is not None:
        ids = [int(t) for t in job.prompt_ids]
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"job.prompt_ids must lie in [0, {vocab})")
        return ids, ()
    rng = np.random.default_rng(job.prompt_seed)
    return rng.integers(0, vocab, job.seq_len).tolist(), ()


def plaintext_session(job: JobSpec, prompt_ids, reveal_logits: bool = True):
    """The job's generation under XLA with the same session loop (tests compare against it)."""
    from runtime import mpc
    model, policy = build(job)
    session = mpc.SecureSession(mpc.make_backend("xla"), model, load_weights(job), policy)
    return session.generate(prompt_ids, job.max_new_tokens, reveal_logits=reveal_logits)
