"""Calibrate PrefixKV's per-layer Lorenz curves on sample prompts and save them as JSON for
make_policy('prefixkv', calibration=PATH):

    python -m experiments.prefixkv_calibrate --model=smollm2-135m --out=results/prefixkv/smollm2-135m.json
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.prefixkv_calibrate",
        description="Calibrate PrefixKV's per-layer Lorenz curves on sample prompts (windows of "
                    "experiments/data/haystack.txt; random ids for models without a tokenizer) "
                    "and save them as JSON for make_policy('prefixkv', calibration=PATH).")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--num_prompts", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024, help="tokens per sample prompt")
    parser.add_argument("--grid", type=int, default=100, help="curve points per layer - 1")
    parser.add_argument("--budget", type=float, default=0.1,
                        help="only for the printed per-layer counts (ratio of --length)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.length < 2 or args.grid < 2:
        raise SystemExit("--num_prompts >= 1, --length >= 2 and --grid >= 2 are needed")
    loaded = registry.load(args.model, seed=args.seed)
    prompts = _sample_prompts(loaded, args.num_prompts, args.length, args.seed)
    result = calibrate(loaded.model, loaded.params, prompts, args.grid)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result))
    policy = PrefixKV(budget=args.budget, calibration=str(out))
    counts = policy.layer_counts(result["num_layers"], args.length)
    print(f"wrote {out}; per-layer tokens kept at budget {args.budget} of {args.length}: "
          f"{list(counts)} (sum {sum(counts)}, target {result['num_layers'] * P.budget_tokens(args.budget, args.length)})")


if __name__ == "__main__":
    main()
