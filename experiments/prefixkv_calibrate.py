"""Calibrate PrefixKV's per-layer Lorenz curves on sample prompts and save them as JSON for
make_policy('prefixkv', calibration=PATH):

    mpcache prefixkv-calibrate --model=smollm2-135m --out=results/prefixkv/smollm2-135m.json
"""
from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
from absl import flags

from experiments import cli
from mpcache_jax import primitives as P
from mpcache_jax.policies.prefixkv import PrefixKV, calibrate
from models import registry


def _sample_prompts(loaded, count: int, length: int, seed: int) -> list[list[int]]:
    if loaded.tokenizer is None:
        rng = np.random.RandomState(seed)
        return [rng.randint(0, loaded.model.cfg.vocab_size, size=length).tolist()
                for _ in range(count)]
    text = (pathlib.Path(__file__).resolve().parent / "data/haystack.txt").read_text()
    ids = loaded.tokenizer.encode(text)
    if len(ids) < length:
        raise SystemExit(f"the haystack text has {len(ids)} tokens, fewer than --length={length}")
    starts = np.linspace(0, len(ids) - length, count).astype(int)
    return [ids[s:s + length] for s in starts]


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("model", "smollm2-135m", "a registered model", flag_values=fv)
    flags.DEFINE_string("out", None, "JSON file to write", flag_values=fv)
    flags.DEFINE_integer("num_prompts", 4, "sample prompts", flag_values=fv)
    flags.DEFINE_integer("length", 1024, "tokens per sample prompt", flag_values=fv)
    flags.DEFINE_integer("grid", 100, "curve points per layer - 1", flag_values=fv)
    flags.DEFINE_float("budget", 0.1, "only for the printed per-layer counts (ratio of "
                       "--length)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random weights' and prompts' seed", flag_values=fv)
    flags.mark_flag_as_required("out", flag_values=fv)
    return fv


def main(argv: list[str]) -> None:
    """Calibrate PrefixKV's per-layer Lorenz curves on sample prompts (windows of
    experiments/data/haystack.txt; random ids for models without a tokenizer) and save them as
    JSON for make_policy('prefixkv', calibration=PATH)."""
    args = _flags()
    cli.parse(args, argv, main.__doc__)
    if args.num_prompts < 1 or args.length < 2 or args.grid < 2:
        cli.usage_error("--num_prompts >= 1, --length >= 2 and --grid >= 2 are needed")
    loaded = registry.load(args.model, seed=args.seed)
    prompts = _sample_prompts(loaded, args.num_prompts, args.length, args.seed)
    result = calibrate(loaded.model, loaded.params, prompts, args.grid)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result))
    policy = PrefixKV(budget=args.budget, calibration=str(out))
    counts = policy.kept_counts(result["num_layers"], args.length)
    print(f"wrote {out}; per-layer tokens kept at budget {args.budget} of {args.length}: "
          f"{list(counts)} (sum {sum(counts)}, target {result['num_layers'] * P.budget_tokens(args.budget, args.length)})")


if __name__ == "__main__":
    main(sys.argv)
