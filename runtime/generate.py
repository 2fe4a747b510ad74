"""Autoregressive generation with a fixed-capacity KV cache and any attention policy."""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mpcache_jax.cache import LayerStack, policy_layers, with_policy_layers
from mpcache_jax.policy import FULL, AttentionPolicy, PrefillAux
from models import transformer
from models.model import XLA_MIN_ROWS, decode_logits


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; otherwise softmax(logits / temperature) restricted to the top-p mass."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample_token(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits: [V] -> int32 token id."""
    if temperature == 0.0:
        return jnp.argmax(logits).astype(jnp.int32)
    probs = jax.nn.softmax(logits / temperature)
    order = jnp.argsort(-probs)
    sorted_probs = probs[order]
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    keep_sorted = (jnp.cumsum(sorted_probs) - sorted_probs) < top_p
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    masked = jnp.where(keep, jnp.log(probs + 1e-30), -jnp.inf)
    return jax.random.categorical(key, masked).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("policy", "max_new_tokens"))
def compress_cache(policy: AttentionPolicy, cache, aux: PrefillAux, max_new_tokens: int):
    """Jitted `policy.compress` (one compilation per policy, prompt length and budget) of the
    layers the policy manages (`cache.policy_layers`: a model's sliding-window layers keep
    their ring buffers)."""
    return with_policy_layers(cache, policy.compress(policy_layers(cache), aux, max_new_tokens))


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]          # generated ids (stop token included if one was produced)
    prompt_len: int
    stopped: bool              # True when a stop id ended generation early
    step_logits: list[np.ndarray] | None = None  # logits that produced each token (if kept)


def apply_policy(policy: AttentionPolicy, cache, aux: PrefillAux, max_new_tokens: int):
    """The policy's decode cache from a dense prefill cache, never aliasing `cache`.

    Decode steps donate their cache argument; a policy that keeps the dense cache as it is
    (`full`) gets a copy, so the prefill cache can serve further policies.
    """
    if aux.length is not None:  # bucketed: the policy checks the real length here
        check_serves(policy, int(aux.length), aux)
    return unaliased(compress_cache(policy, cache, aux, max_new_tokens), cache)


def check_serves(policy: AttentionPolicy, prompt_len: int, aux: PrefillAux) -> None:
    """Raise ValueError saying what to change when `policy` cannot serve a prompt of
    `prompt_len` real tokens (its check_prompt) or, for a prompt padded to a bucket
    (aux.length set), the bucket's slots (its check_bucketed)."""
    policy.check_prompt(prompt_len)
    if aux.length is not None:
        policy.check_bucketed(prompt_len, aux.min_length, aux.prompt_len)


# Token id written into the padding of a bucketed prompt (never attended: causal attention
# keeps it away from the real tokens, and decoding overwrites it).
PAD_ID = 0


def bucket_of(length: int, edges: Sequence[int]) -> tuple[int, int]:
    """(smallest length, capacity) of the bucket holding a prompt of `length` tokens: the
    first edge >= length; its smallest length is one more than the edge below."""
    edges = sorted(set(int(e) for e in edges))
    for i, edge in enumerate(edges):
        if length <= edge:
            return (edges[i - 1] + 1 if i else 1), edge
    raise ValueError(f"a prompt of {length} tokens is longer than the largest bucket "
                     f"({edges[-1]}); add a larger bucket edge")


def prefill_prompt(model, params, prompt_ids: Sequence[int], max_new_tokens: int,
                   return_queries: bool = False, bucket: tuple[int, int] | None = None):
    """Prefill into a dense cache with room for `max_new_tokens` more -> (logits, cache, aux).

    bucket: (smallest length, capacity) to pad the prompt to `capacity` slots with its length
    as a runtime value (one compilation of prefill, compress and decode per bucket; the
    result equals the unpadded run's up to float rounding)."""
    T = len(prompt_ids)
    capacity = T if bucket is None else bucket[1]
    if bucket is not None and not bucket[0] <= T <= capacity:
        raise ValueError(f"a prompt of {T} tokens is outside its bucket [{bucket[0]}, {capacity}]")
    if capacity + max_new_tokens > model.cfg.max_position:
        raise ValueError(f"prompt ({capacity}) + max_new_tokens ({max_new_tokens}) exceed the "
                         f"model's context of {model.cfg.max_position} positions")
    cache = model.init_cache(capacity + max_new_tokens)
    if bucket is None:
        return model.prefill(params, list(prompt_ids), cache, return_queries=return_queries)
    padded = list(prompt_ids) + [PAD_ID] * (capacity - T)
    return model.prefill(params, padded, cache, return_queries=return_queries, length=T,
                         min_length=bucket[0])


def _sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    return sample_token.__wrapped__(logits, key, temperature, top_p)


def _loop(model, policy: AttentionPolicy, params, logits, cache, start_pos, key, stop_ids, forced,
          steps: int, temperature: float, top_p: float, keep_logits: bool):
    """The decode loop of one sample (see `decode_loop`). It decodes after the last token too
    (one step more, whose results are dropped) instead of branching on `done` around the
    step (a branch whose one side passes the whole cache through)."""
    tokens = jnp.full((steps,), -1, jnp.int32)
    rows = jnp.zeros((steps,) + logits.shape, logits.dtype) if keep_logits else None

    def body(state):
        step, logits, cache, key, tokens, rows, _, _ = state
        key, sub = jax.random.split(key)
        token = forced[step] if forced is not None else _sample(logits, sub, temperature, top_p)
        tokens = tokens.at[step].set(token)
        if keep_logits:
            rows = rows.at[step].set(logits)
        stopped = (jnp.any(token == stop_ids) if forced is None and stop_ids.size
                   else jnp.zeros((), bool))
        done = stopped | (step + 1 >= steps)
        logits, cache = decode_logits(model, policy, params, token, start_pos + step, cache,
                                      XLA_MIN_ROWS)
        return step + 1, logits, cache, key, tokens, rows, done, stopped

    state = (jnp.zeros((), jnp.int32), logits, cache, key, tokens, rows, jnp.zeros((), bool),
             jnp.zeros((), bool))
    step, _, cache, _, tokens, rows, _, stopped = jax.lax.while_loop(
        lambda state: ~state[6], body, state)
    return tokens, step, stopped, rows, cache


def _stacked_params(model, params, cache):
    """The weights in the form the decode step reads best: stacked for a layer loop (a
    LayerStack cache), one entry per layer for layers run one after another (slicing stacked
    weights there would copy them every step)."""
    if isinstance(cache, LayerStack) and transformer.scans_layers(model.cfg):
        return transformer.stack_layers(params)
    return transformer.unstack_layers(params)


@functools.partial(jax.jit, static_argnames=("model", "policy", "steps", "temperature", "top_p",
                                             "keep_logits"),
                   donate_argnames=("cache",))
def decode_loop(model, policy: AttentionPolicy, params, logits, cache, start_pos, key, stop_ids,
                forced=None, *, steps: int, temperature: float = 0.0, top_p: float = 1.0,
                keep_logits: bool = False):
    """Up to `steps` tokens in one program: the loop runs on the device (`lax.while_loop`), the
    stop test included; nothing returns to the host between tokens.

    logits: [V] the prompt's last-position logits; cache: the policy's decode cache (donated);
    start_pos: int32 [] position of the first new token; key: the sampling key (split once per
    token, as `sample_token` is called in turn); stop_ids: int32 [n] (may be empty);
    forced: int32 [steps] tokens to feed instead of sampling (teacher forcing: no stop test).
    Each step takes a token from the current logits (or `forced`) and decodes it; the loop
    ends after a stop token or the last step (that step's decoding is dropped).

    Returns (tokens int32 [steps] (-1 past the end), count int32 [], stopped bool [],
    logits of every step [steps, V] when keep_logits, else None, the final cache: returned so
    that the loop runs in the donated cache's buffers)."""
    return _loop(model, policy, _stacked_params(model, params, cache), logits, cache, start_pos, key,
                 stop_ids, forced, steps, temperature, top_p, keep_logits)


@functools.partial(jax.jit, static_argnames=("model", "policy", "steps", "keep_logits"),
                   donate_argnames=("cache",))
def decode_loop_batch(model, policy: AttentionPolicy, params, logits, cache, start_pos,
                      stop_ids, forced=None, n_forced=None, limit=None, *, steps: int,
                      keep_logits: bool = False):
    """`decode_loop` (greedy) for a batch of samples at once: logits [B, V], cache (a batch of
    caches: `stack_samples`), start_pos [B]. The weights are read once per step for the whole
    batch; the loop runs until every sample has stopped (a sample that stopped keeps its
    results). Each step decodes every sample (one after its last too, dropped): the caches
    hold prompt + steps tokens.

    forced: int32 [B, steps] tokens to feed; n_forced: int32 [B], how many of them sample i
    takes before it decodes greedily (default: all `steps` when `forced` is given, else none);
    a forced step has no stop test. limit: int32 [B], the steps of sample i (<= steps, default
    steps). With these as runtime values one compiled program serves a policy's free run, its
    teacher-forced run and the reference's.

    The loop is over the batch (`lax.while_loop` of a `vmap`ped decode step), not a `vmap` of
    the one-sample loop: a batched loop would select every sample's whole cache each step,
    and vmap would re-batch the layers' whole jaxpr once per carry element it finds batched
    (5 passes: 6 s of tracing per program on SmolLM2's 30 unrolled layers).

    Returns (tokens int32 [B, steps] (-1 past each sample's end), count int32 [B],
    stopped bool [B], logits of each step [B, steps, V] (zeros past the end) when
    keep_logits, else None, the final cache)."""
    params = _stacked_params(model, params, cache)
    batch = logits.shape[0]
    key = jax.random.PRNGKey(0)       # greedy: the key is never used
    if forced is None:
        forced = jnp.zeros((batch, steps), jnp.int32)
        n_forced = jnp.zeros((batch,), jnp.int32) if n_forced is None else n_forced
    elif n_forced is None:
        n_forced = jnp.full((batch,), steps, jnp.int32)
    limit = jnp.full((batch,), steps, jnp.int32) if limit is None else jnp.minimum(limit, steps)
    decode_all = jax.vmap(
        lambda token, pos, cache: decode_logits(model, policy, params, token, pos, cache,
                                                XLA_MIN_ROWS),
        in_axes=(0, 0, sample_axes(cache)), out_axes=(0, sample_axes(cache)))
    greedy = jax.vmap(lambda row: _sample(row, key, 0.0, 1.0))

    def body(state):
        step, logits, cache, tokens, rows, count, stopped, done = state
        active = ~done
        free = step >= n_forced
        token = jnp.where(free, greedy(logits), forced[:, step])
        is_stop = (jnp.any(token[:, None] == stop_ids[None, :], axis=1) & free
                   if stop_ids.size else jnp.zeros((batch,), bool))
        tokens = tokens.at[:, step].set(jnp.where(active, token, -1))
        if keep_logits:
            rows = rows.at[:, step].set(jnp.where(active[:, None], logits, 0.0))
        count = jnp.where(active, step + 1, count)
        stopped = jnp.where(active, is_stop, stopped)
        done = done | is_stop | (step + 1 >= limit)
        logits, cache = decode_all(token, start_pos + step, cache)
        return step + 1, logits, cache, tokens, rows, count, stopped, done

    rows = jnp.zeros((batch, steps) + logits.shape[1:], logits.dtype) if keep_logits else None
    state = (jnp.zeros((), jnp.int32), logits, cache, jnp.full((batch, steps), -1, jnp.int32),
             rows, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool),
             jnp.zeros((batch,), bool))
    _, _, cache, tokens, rows, count, stopped, _ = jax.lax.while_loop(
        lambda state: ~jnp.all(state[7]), body, state)
    return tokens, count, stopped, rows, cache


@functools.partial(jax.jit, static_argnames=("policy", "max_new_tokens"))
def compress_batch(policy: AttentionPolicy, cache, aux: PrefillAux, max_new_tokens: int):
    """`compress_cache` of a batch of samples (`stack_samples`)."""
    def one(cache, aux):
        return with_policy_layers(cache, policy.compress(policy_layers(cache), aux,
                                                         max_new_tokens))
    in_axes = (sample_axes(cache), 0)
    return jax.vmap(one, in_axes=in_axes, out_axes=_axes_of_output(one, cache, aux, in_axes))(
        cache, aux)


def _axes_of_output(fn, cache, aux, in_axes):
    """vmap out_axes for fn's output: the sample axis behind the layer axis of a LayerStack's
    leaves (`sample_axes`), in front elsewhere."""
    def unbatched(tree, axes):
        return jax.tree_util.tree_map(
            lambda x, a: jax.ShapeDtypeStruct(x.shape[:a] + x.shape[a + 1:], x.dtype), tree, axes)
    out = jax.eval_shape(fn, unbatched(cache, in_axes[0]),
                         unbatched(aux, jax.tree_util.tree_map(lambda _: 0, aux)))
    return sample_axes(out)


def sample_axes(tree):
    """The axis that holds the samples of a batch, per leaf of a batched tree (or of one
    sample's): 1 in a LayerStack, behind its layer axis (so that the layer loop's updates of one
    layer stay in place), 0 elsewhere."""
    def axes(node):
        if isinstance(node, LayerStack):
            return LayerStack(jax.tree_util.tree_map(lambda _: 1, node.stacked))
        return jax.tree_util.tree_map(lambda _: 0, node)
    return jax.tree_util.tree_map(axes, tree, is_leaf=lambda x: isinstance(x, LayerStack))


def stack_samples(trees):
    """Per-sample pytrees of one structure (caches, PrefillAux) -> one batch: every array leaf
    gets a sample axis (`sample_axes`: behind a LayerStack's layer axis, else in front)."""
    axes = jax.tree_util.tree_leaves(sample_axes(trees[0]))
    leaves = [jax.tree_util.tree_leaves(t) for t in trees]
    treedef = jax.tree_util.tree_structure(trees[0])
    stacked = [jnp.stack(xs, axis=a) for a, xs in zip(axes, zip(*leaves))]
    return jax.tree_util.tree_unflatten(treedef, stacked)


def take_sample(tree, index: int):
    """Sample `index` of a batch made by `stack_samples`."""
    axes = jax.tree_util.tree_leaves(sample_axes(tree))
    leaves = jax.tree_util.tree_leaves(tree)
    treedef = jax.tree_util.tree_structure(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.take(x, index, axis=a) for a, x in zip(axes, leaves)])


def unaliased(out, inputs):
    """`out`, copied where it shares a buffer with `inputs` (a decode loop donates its cache:
    a policy that keeps the dense cache as it is must not hand over the one other policies
    still read)."""
    in_leaves = {id(x) for x in jax.tree_util.tree_leaves(inputs)}
    if any(id(x) in in_leaves for x in jax.tree_util.tree_leaves(out)):
        return jax.tree_util.tree_map(jnp.copy, out)
    return out


def check_decode_room(model, policy: AttentionPolicy, cache, start_pos: int, steps: int) -> None:
    """Before a decode loop of `steps` tokens (steps - 1 decode steps): every position fits
    the model's context and the cache has room for every new token."""
    last = start_pos + steps - 2
    if steps > 1 and not 0 <= last < model.cfg.max_position:
        raise ValueError(f"position {last} is outside the model's context of "
                         f"{model.cfg.max_position} positions ({model.cfg.name})")
    if steps > 1 and policy.free_slots(policy_layers(cache)) < steps - 1:
        raise ValueError("the KV cache is full: allocate more room for new tokens "
                         "(capacity >= prompt length + max_new_tokens)")


def decode_tokens(model, params, logits, cache, *, policy: AttentionPolicy, start_pos: int,
                  max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                  stop_ids: Sequence[int] = (), keep_logits: bool = False,
                  progress: bool = False) -> GenerationResult:
    """Sample up to `max_new_tokens` tokens (`decode_loop`: on the device); `logits` are the
    prompt's last-position logits. The cache is donated. progress: say on stderr how many
    tokens are being decoded (the loop does not return to the host per token)."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
    check_decode_room(model, policy, cache, start_pos, max_new_tokens)
    if progress:
        import sys
        print(f"decoding up to {max_new_tokens} tokens on {jax.default_backend()}",
              file=sys.stderr, flush=True)
    tokens, count, stopped, rows, _ = decode_loop(
        model, policy, params, logits, cache, jnp.asarray(start_pos, jnp.int32),
        jax.random.PRNGKey(sampling.seed),
        jnp.asarray(sorted(set(int(s) for s in stop_ids)), jnp.int32).reshape(-1),
        steps=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        keep_logits=keep_logits)
    count = int(count)
    kept = None if rows is None else list(np.asarray(rows)[:count])
    return GenerationResult(tokens=[int(t) for t in np.asarray(tokens)[:count]],
                            prompt_len=start_pos, stopped=bool(stopped), step_logits=kept)


def teacher_forced_logits(model, params, logits, cache, *, policy: AttentionPolicy,
                          start_pos: int, target_ids: Sequence[int]) -> np.ndarray:
    """Logits [len(target_ids), V] predicting each of `target_ids` given the ones before it
    (`logits`: the prefill's, predicting target_ids[0]); one device loop. The cache is donated."""
    steps = len(target_ids)
    check_decode_room(model, policy, cache, start_pos, steps)
    _, _, _, rows, _ = decode_loop(model, policy, params, logits, cache,
                                jnp.asarray(start_pos, jnp.int32), jax.random.PRNGKey(0),
                                jnp.zeros((0,), jnp.int32), jnp.asarray(target_ids, jnp.int32),
                                steps=steps, keep_logits=True)
    return np.asarray(rows)


def continuation_nll(model, params, logits, cache, *, policy: AttentionPolicy, start_pos: int,
                     target_ids: Sequence[int]) -> np.ndarray:
    """Teacher-forced negative log-likelihood [len(target_ids)] of a continuation."""
    rows = teacher_forced_logits(model, params, logits, cache, policy=policy,
                                 start_pos=start_pos, target_ids=target_ids).astype(np.float64)
    rows = rows - rows.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(rows).sum(axis=-1))
    return log_z - rows[np.arange(len(target_ids)), np.asarray(target_ids)]


def generate(model, params, prompt_ids: Sequence[int], *, max_new_tokens: int,
             policy: AttentionPolicy = FULL, sampling: SamplingConfig = SamplingConfig(),
             stop_ids: Sequence[int] = (), keep_logits: bool = False,
             progress: bool = False) -> GenerationResult:
    """Prefill the prompt, let `policy` compress the cache once, then decode token by token."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
    logits, cache, aux = prefill_prompt(model, params, prompt_ids, max_new_tokens,
                                        return_queries=policy.needs_queries)
    cache = apply_policy(policy, cache, aux, max_new_tokens)
    return decode_tokens(model, params, logits, cache, policy=policy, start_pos=len(prompt_ids),
                         max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                         keep_logits=keep_logits, progress=progress)
