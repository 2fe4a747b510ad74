"""How long XLA takes to compile a model's prefill (every decoder layer, the blocked causal
attention included, filling the KV cache) at given prompt lengths, with abstract weights (no
checkpoint is loaded and nothing runs), and how much temporary memory the compiled program
asks for. Results: docs/models.md (Gemma at 32768 tokens), docs/results.md (compile once,
bounded memory).

    mpcache compile-time [--model=gemma3-270m] [--lengths=8192,16384,32768] [--num_layers=N]
        [--policy=mpcache] [--unbounded]

Prints one line per length: tracing + lowering seconds, XLA's compile seconds and the
program's temporary buffers (XLA's buffer assignment on this backend); with --policy, the
same for that policy's compression of the prefilled cache (the prefill then also returns
the queries). A length past the model's context stretches it (RoPE takes any position: the
rows measure programs, not answers). --unbounded compiles with the long-prompt memory bounds
lifted (`attention.LOOPED_SCORE_ELEMENTS`, `attention.TILED_MIN_TOKENS`,
`policies.base.VOTE_BLOCK_ELEMENTS`): the programs as they were before them, for comparison.
"""
from __future__ import annotations

import contextlib
import sys
import time

from absl import flags

from experiments import cli


@contextlib.contextmanager
def lifted_memory_bounds(lift: bool = True):
    """Inside: programs traced as before the long-prompt memory bounds (the plaintext tiled
    prefill, the loop of very long prompts' query blocks, the look-once vote's row blocks).
    The bounds are module values read at trace time; restored on exit for in-process
    callers. `lift=False`: no change."""
    from mpcache_jax import attention
    from mpcache_jax.policies import base
    bounds = (attention.LOOPED_SCORE_ELEMENTS, attention.TILED_MIN_TOKENS,
              base.VOTE_BLOCK_ELEMENTS)
    if lift:
        (attention.LOOPED_SCORE_ELEMENTS, attention.TILED_MIN_TOKENS,
         base.VOTE_BLOCK_ELEMENTS) = (1 << 62,) * 3
    try:
        yield
    finally:
        (attention.LOOPED_SCORE_ELEMENTS, attention.TILED_MIN_TOKENS,
         base.VOTE_BLOCK_ELEMENTS) = bounds


def compile_programs(model_name: str, length: int, num_layers: int | None = None,
                     policy_name: str | None = None) -> list[dict]:
    """[{program, trace_s, compile_s, temp_bytes}] for `model_name`'s prefill of `length`
    tokens (the program `Model.prefill` runs; with the persistent compilation cache on, a
    second process reads it from there) and, with `policy_name`, that policy's compression
    of the prefilled cache (`runtime.generate.compress_cache`)."""
    import jax
    import jax.numpy as jnp
    from models.catalog import get_config
    from models.model import Model, _prefill
    from mpcache_jax.policies import make_policy
    from mpcache_jax.policy import PrefillAux
    from runtime.generate import compress_cache
    cfg = get_config(model_name, num_layers)
    if cfg.max_position < length:
        cfg = cfg.replace(max_position=length)
    model = Model(cfg)
    policy = make_policy(policy_name, 0.1) if policy_name else None
    queries = bool(policy and policy.needs_queries)
    cache = jax.eval_shape(lambda: model.init_cache(length))
    tokens = jax.ShapeDtypeStruct((length,), jnp.int32)
    rows = []

    def measure(name, lower):
        start = time.perf_counter()
        lowered = lower()
        traced = time.perf_counter() - start
        memory = lowered.compile().memory_analysis()
        rows.append({"program": name, "trace_s": traced,
                     "compile_s": time.perf_counter() - start - traced,
                     "temp_bytes": None if memory is None else memory.temp_size_in_bytes})
        return lowered

    prefill = measure("prefill", lambda: _prefill.lower(model, model.param_shapes(), tokens,
                                                        cache, queries, False))
    if policy is not None:
        # the compression's inputs: the prefill's outputs, as shapes (out_info)
        _, dense, prompt_queries = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), prefill.out_info,
            is_leaf=lambda x: isinstance(x, jax.stages.OutInfo))
        aux = PrefillAux(queries=prompt_queries, prompt_len=length,
                         normalized_keys=cfg.qk_norm)
        measure(f"{policy.name} compress", lambda: compress_cache.lower(policy, dense, aux, 32))
    return rows


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("model", "gemma3-270m", "a registered model", flag_values=fv)
    flags.DEFINE_string("lengths", "8192,16384,32768", "comma-separated prompt lengths in tokens",
                        flag_values=fv)
    flags.DEFINE_integer("num_layers", None, "keep the model's first N decoder layers",
                         flag_values=fv)
    flags.DEFINE_string("policy", None, "also compile this registered policy's compression "
                        "(budget 0.1)", flag_values=fv)
    flags.DEFINE_bool("unbounded", False, "lift the long-prompt memory bounds (the programs "
                      "before them)", flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    args = _flags()
    cli.parse(args, argv, __doc__)
    from models.catalog import MODEL_NAMES, get_config
    from mpcache_jax.policies import POLICY_NAMES
    if args.model not in MODEL_NAMES:
        cli.usage_error(f"--model={args.model!r}: one of {', '.join(MODEL_NAMES)}")
    if args.policy is not None and args.policy not in POLICY_NAMES:
        cli.usage_error(f"--policy={args.policy!r}: one of {', '.join(POLICY_NAMES)}")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        cli.usage_error(f"--lengths={args.lengths!r}: comma-separated integers")
    if [n for n in lengths if n < 1]:
        cli.usage_error(f"--lengths={args.lengths!r}: lengths must be >= 1")
    layers = get_config(args.model).num_layers
    if args.num_layers is not None and not 1 <= args.num_layers <= layers:
        cli.usage_error(f"--num_layers={args.num_layers}: 1..{layers} for {args.model}")
    with lifted_memory_bounds(args.unbounded):
        for length in lengths:
            for row in compile_programs(args.model, length, args.num_layers, args.policy):
                temp = ("" if row["temp_bytes"] is None
                        else f", temporary buffers {row['temp_bytes'] / 1e9:.2f} GB")
                print(f"{args.model}, {length} tokens, {row['program']}: trace + lower "
                      f"{row['trace_s']:.1f} s, compile {row['compile_s']:.1f} s{temp}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
