"""How long XLA takes to compile a model's prefill (every decoder layer, the blocked causal
attention included, filling the KV cache) at given prompt lengths, with abstract weights (no
checkpoint is loaded and nothing runs). Results: docs/models.md (Gemma at 32768 tokens),
docs/results.md (compile once).

    mpcache compile-time [--model=gemma3-270m] [--lengths=8192,16384,32768]

Prints one line per length: tracing + lowering seconds, then XLA's compile seconds.
"""
from __future__ import annotations

import sys
import time

from absl import flags

from experiments import cli


def compile_seconds(model_name: str, length: int) -> tuple[float, float]:
    """(trace + lower, compile) seconds of `model_name`'s prefill of `length` tokens (the
    program `Model.prefill` runs; with the persistent compilation cache on, a second process
    reads it from there)."""
    import jax
    import jax.numpy as jnp
    from models.catalog import get_config
    from models.model import Model, _prefill
    model = Model(get_config(model_name))
    shapes = lambda tree: jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    cache = jax.eval_shape(lambda: model.init_cache(length))
    start = time.perf_counter()
    lowered = _prefill.lower(model, model.param_shapes(),
                             jax.ShapeDtypeStruct((length,), jnp.int32), shapes(cache), False,
                             False)
    traced = time.perf_counter() - start
    lowered.compile()
    return traced, time.perf_counter() - start - traced


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("model", "gemma3-270m", "a registered model", flag_values=fv)
    flags.DEFINE_string("lengths", "8192,16384,32768", "comma-separated prompt lengths in tokens",
                        flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    args = _flags()
    cli.parse(args, argv, __doc__)
    from models.catalog import MODEL_NAMES, get_config
    if args.model not in MODEL_NAMES:
        cli.usage_error(f"--model={args.model!r}: one of {', '.join(MODEL_NAMES)}")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        cli.usage_error(f"--lengths={args.lengths!r}: comma-separated integers")
    context = get_config(args.model).max_position
    for length in lengths:
        if not 0 < length <= context:
            cli.usage_error(f"--lengths: {length} is outside 1..{context}, {args.model}'s context")
    for length in lengths:
        traced, compiled = compile_seconds(args.model, length)
        print(f"{args.model}, {length} tokens: trace + lower {traced:.1f} s, compile "
              f"{compiled:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
