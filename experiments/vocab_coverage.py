"""How much of a model's greedy output a public vocabulary subset would keep: the share of
the teacher-forced greedy tokens on our prose (experiments/data/prose, BOS + the first
`--tokens` tokens of each file) that lie among the first N ids, and among the N best
SentencePiece scores of the GGUF's tokenizer. An LM head restricted to a public subset costs
its argmax's comparisons in proportion to N under MPC; it keeps the greedy token only when
that token is in the subset.

    mpcache vocab-coverage --model=gemma3-270m --sizes=8192,16384,32768,65536

Results: docs/models.md (Under MPC).
"""
from __future__ import annotations

import importlib
import sys

import numpy as np
from absl import flags
from tqdm import tqdm

from experiments import cli
from experiments.gemma_parity import PROSE
from models import registry

GGUF_MODULES = {"gemma3-270m": "models.gemma3", "smollm2-135m": "models.smollm2"}


def score_ranks(model: str) -> np.ndarray | None:
    """Each id's rank by its GGUF tokenizer score (0 = best), or None without scores."""
    if model not in GGUF_MODULES:
        return None
    from gguf import GGUFReader
    reader = GGUFReader(str(importlib.import_module(GGUF_MODULES[model]).fetch_gguf()))
    field = reader.fields.get("tokenizer.ggml.scores")
    if field is None:
        return None
    scores = np.array([field.parts[i][0] for i in field.data], dtype=np.float64)
    ranks = np.empty(len(scores), np.int64)
    ranks[np.argsort(-scores, kind="stable")] = np.arange(len(scores))
    return ranks


def greedy_ids(loaded, tokens: int) -> np.ndarray:
    """Teacher-forced greedy token at every position of every prose file's first tokens."""
    out = []
    for path in tqdm(sorted(PROSE.glob("*.txt")), desc="prose files", unit="file"):
        ids = loaded.tokenizer.encode_prompt(path.read_text())[:tokens]
        out.append(np.argmax(np.asarray(loaded.model.forward(loaded.params, ids)), axis=-1))
    return np.concatenate(out)


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("model", "gemma3-270m", "a registered model", flag_values=fv)
    flags.DEFINE_string("sizes", "8192,16384,32768,65536", "subset sizes N, comma-separated",
                        flag_values=fv)
    flags.DEFINE_integer("tokens", 512, "tokens per prose file", flag_values=fv)
    return fv


def main(argv: list[str]) -> None:
    args = _flags()
    cli.parse(args, argv, __doc__)
    try:
        sizes = [int(n) for n in args.sizes.split(",")]
    except ValueError:
        cli.usage_error(f"--sizes={args.sizes} must be integers, e.g. --sizes=16384,32768")
    if args.tokens < 2 or any(n < 1 for n in sizes):
        cli.usage_error("--tokens >= 2 and every --sizes entry >= 1 are needed")
    loaded = registry.load(args.model)
    if loaded.tokenizer is None:
        cli.usage_error(f"--model={args.model} has no tokenizer (random weights)")
    greedy = greedy_ids(loaded, args.tokens)
    ranks = score_ranks(args.model)
    print(f"{args.model}: {len(greedy)} teacher-forced positions, vocabulary "
          f"{loaded.model.cfg.vocab_size}")
    print("N        greedy id < N   greedy among the N best scores")
    for n in sizes:
        by_score = "-" if ranks is None else f"{np.mean(ranks[greedy] < n):.3f}"
        print(f"{n:<8d} {np.mean(greedy < n):<15.3f} {by_score}")


if __name__ == "__main__":
    main(sys.argv)
