"""The fidelity suite's tasks: facts, passages and continuations in natural prose.

Every prompt is built deterministically from a seed out of the original prose the repo holds
(`experiments/data/prose/*.txt`, one topic per file, several topics per long prompt; prompts
longer than those files hold go on into `experiments/data/prose_extra/*.txt`), never from the
synthetic passkey filler. Each retrieval sample records the token span(s) of its
answer in the prompt (`Sample.answer_spans`), so the harness can say which eviction stage
keeps or loses it.

  multi_needle  several facts of one template with multi-token values (digit strings, names,
                towns, serial numbers), one of them asked; the others are distractors
  multi_hop     "P lives in X" + "the postal code of X is N": the question names P, the
                answer is N (two facts combined), with distractor pairs
  qa            a short passage about an invented subject inside the prose; free-form answer
                scored by token F1 (`qa_f1`)
  continuation  perplexity of the next tokens of a prose document after a compressed prefix

Prompts of synthetic length are built to exactly the requested number of tokens (the prose
is cut), so one length compiles once.
"""
from __future__ import annotations

import json
import pathlib
import random
import re
import sys

from absl import flags

from experiments import cli
from experiments.tasks import DATA_DIR, PromptBuilder, Sample

PROSE_DIR = DATA_DIR / "prose"
EXTRA_PROSE_DIR = DATA_DIR / "prose_extra"
INTRO = "Read the document below and answer the question at the end."
QA_INTRO = "Read the document below, then answer the question at the end in a few words."


def prose_documents(folder: pathlib.Path = PROSE_DIR) -> list[list[str]]:
    """Every prose file of `folder` as a list of paragraphs (each a string)."""
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no prose files in {folder}")
    docs = []
    for path in files:
        paragraphs = [p.strip().replace("\n", " ") for p in path.read_text().split("\n\n")]
        docs.append([p for p in paragraphs if p])
    return docs


def _sentences(paragraph: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", paragraph) if s]


def prose_pieces(rng: random.Random) -> list[str]:
    """Sentences of every document, documents in a random order, each prefixed by the
    whitespace that joins it to the previous one (a paragraph break or a space).

    The documents of `prose/` come first (shuffled by `rng`), then those of `prose_extra/`
    for the prompts longer than `prose/` holds (~14k tokens). The second folder is shuffled
    by its own generator, seeded by the first folder's order, so that `rng` is drawn from
    exactly as without it: a prompt that fits in `prose/` is the same with or without the
    second folder, and so are the samples after it."""
    docs = prose_documents()
    rng.shuffle(docs)
    extra = prose_documents(EXTRA_PROSE_DIR)
    random.Random("|".join(doc[0][:40] for doc in docs)).shuffle(extra)
    pieces = []
    for doc in docs + extra:
        for paragraph in doc:
            for i, sentence in enumerate(_sentences(paragraph)):
                pieces.append(("\n\n" if i == 0 and pieces else " ") + sentence)
    return pieces


def load_names() -> dict[str, list[str]]:
    return json.loads((DATA_DIR / "names.json").read_text())


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10 ** n - 1))


# (fact template, question template, value generator) for multi_needle; {key} is an object.
NEEDLE_TEMPLATES = (
    ("The access code of the {key} is {value}.", "What is the access code of the {key}?",
     lambda rng, names: _digits(rng, 5)),
    ("The {key} belongs to {value}.", "Who does the {key} belong to?",
     lambda rng, names: rng.choice(names["people"])),
    ("The {key} was shipped to {value}.", "To which town was the {key} shipped?",
     lambda rng, names: rng.choice(names["towns"])),
    ("The serial number of the {key} is {value}.", "What is the serial number of the {key}?",
     lambda rng, names: "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(2))
     + "-" + _digits(rng, 4)),
)


def _grid(i: int, lengths: list[int], depths: list[float]) -> tuple[int, float]:
    """Sample i's (length, depth): lengths cycle fastest, so any n covers every length."""
    return lengths[i % len(lengths)], depths[(i // len(lengths)) % len(depths)]


def _other_depths(rng: random.Random, asked: float, count: int) -> list[float]:
    """Depths for distractors, at least 0.08 away from the asked fact and each other."""
    chosen = [asked]
    while len(chosen) < count + 1:
        d = rng.uniform(0.05, 0.95)
        if all(abs(d - c) >= 0.08 for c in chosen):
            chosen.append(d)
    return chosen[1:]


def multi_needle(tokenizer, *, num_samples: int, lengths: list[int], depths: list[float],
                 seed: int, num_facts: int = 3, chat: bool = True):
    builder = PromptBuilder(tokenizer, chat)
    names = load_names()
    for i in range(num_samples):
        rng = random.Random(f"multi_needle/{seed}/{i}")
        length, depth = _grid(i, lengths, depths)
        fact, question, make_value = NEEDLE_TEMPLATES[i % len(NEEDLE_TEMPLATES)]
        keys = rng.sample(names["objects"], num_facts)
        values = []
        while len(values) < num_facts:
            value = make_value(rng, names)
            if value not in values:
                values.append(value)
        fact_depths = [depth] + _other_depths(rng, depth, num_facts - 1)
        inserts = [(d, " " + fact.format(key=k, value=v), [v])
                   for d, k, v in zip(fact_depths, keys, values)]
        ids, spans = builder.build(INTRO, prose_pieces(rng), inserts,
                                   question.format(key=keys[0]), length)
        yield Sample("multi_needle", f"multi_needle-{i}", ids, [values[0]], "contains",
                     answer_spans=spans[0],
                     meta={"length": length, "depth": depth, "template": i % len(NEEDLE_TEMPLATES),
                           "num_facts": num_facts})


def multi_hop(tokenizer, *, num_samples: int, lengths: list[int], depths: list[float],
              seed: int, num_pairs: int = 3, chat: bool = True):
    """Each of `num_pairs` people lives in a different town and each town has a postal code;
    the two facts of the asked person are at separate depths (the code fact at `depth`)."""
    builder = PromptBuilder(tokenizer, chat)
    names = load_names()
    for i in range(num_samples):
        rng = random.Random(f"multi_hop/{seed}/{i}")
        length, depth = _grid(i, lengths, depths)
        people = rng.sample(names["people"], num_pairs)
        towns = rng.sample(names["towns"], num_pairs)
        codes = []
        while len(codes) < num_pairs:
            code = _digits(rng, 5)
            if code not in codes:
                codes.append(code)
        fact_depths = [depth] + _other_depths(rng, depth, 2 * num_pairs - 1)
        inserts = [(fact_depths[0], f" The postal code of {towns[0]} is {codes[0]}.", [codes[0]]),
                   (fact_depths[1], f" {people[0]} lives in {towns[0]}.", [towns[0]])]
        for j in range(1, num_pairs):
            inserts.append((fact_depths[2 * j], f" The postal code of {towns[j]} is {codes[j]}.",
                            [codes[j]]))
            inserts.append((fact_depths[2 * j + 1], f" {people[j]} lives in {towns[j]}.",
                            [towns[j]]))
        ids, spans = builder.build(
            INTRO, prose_pieces(rng), inserts,
            f"What is the postal code of the town where {people[0]} lives?", length)
        yield Sample("multi_hop", f"multi_hop-{i}", ids, [codes[0]], "contains",
                     answer_spans=spans[0],
                     meta={"length": length, "depth": depth, "hop_depth": fact_depths[1],
                           "hop_spans": spans[1], "num_pairs": num_pairs})


def load_qa() -> list[dict]:
    path = DATA_DIR / "qa_passages.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def qa(tokenizer, *, num_samples: int, lengths: list[int], depths: list[float], seed: int,
       chat: bool = True):
    """One question about a passage (invented subject) placed at `depth` in the prose."""
    builder = PromptBuilder(tokenizer, chat)
    items = [(passage, q) for passage in load_qa() for q in passage["questions"]]
    order = list(range(len(items)))
    random.Random(f"qa/{seed}").shuffle(order)
    for i in range(num_samples):
        rng = random.Random(f"qa/{seed}/{i}")
        length, depth = _grid(i, lengths, depths)
        passage, question = items[order[i % len(items)]]
        text = "\n\n" + passage["passage"]
        answers = [question["answer"], *question.get("aliases", [])]
        lower = text.lower()
        at = lower.find(question["answer"].lower())
        mark = text[at:at + len(question["answer"])]
        ids, spans = builder.build(QA_INTRO, prose_pieces(rng), [(depth, text, [mark])],
                                   question["question"], length)
        yield Sample("qa", f"qa-{i}", ids, answers, "qa_f1", answer_spans=spans[0],
                     meta={"length": length, "depth": depth, "passage": passage["id"]})


def continuation(tokenizer, *, num_samples: int, lengths: list[int], target_len: int, seed: int):
    """A prefix of `length` tokens of prose (documents in a seeded order), then `target_len`
    tokens scored teacher-forced (perplexity)."""
    for i in range(num_samples):
        rng = random.Random(f"continuation/{seed}/{i}")
        length = lengths[i % len(lengths)]
        ids: list[int] = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) else []
        for piece in prose_pieces(rng):
            ids.extend(tokenizer.encode(piece))
            if len(ids) >= length + target_len:
                break
        if len(ids) < length + target_len:
            raise ValueError(f"the prose holds {len(ids)} tokens, fewer than {length} + {target_len}")
        yield Sample("continuation", f"continuation-{i}", ids[:length], metric="ppl",
                     target_ids=ids[length:length + target_len], meta={"length": length})


NATURAL_TASKS = {"multi_needle": multi_needle, "multi_hop": multi_hop, "qa": qa}


def longbench_records(num_samples: int, seed: int, min_words: int = 300,
                      max_words: int = 1400) -> list[dict]:
    """LongBench-format records ({"_id", "dataset", "context", "input", "answers"}) of mixed
    lengths: prose with three facts of one template, one asked (as multi_needle), or a QA
    passage (as qa). For runs of `--task=longbench_jsonl` on prompts of many lengths."""
    names = load_names()
    items = [(passage, q) for passage in load_qa() for q in passage["questions"]]
    records = []
    for i in range(num_samples):
        rng = random.Random(f"longbench/{seed}/{i}")
        words = rng.randint(min_words, max_words)
        pieces, count = [], 0
        for piece in prose_pieces(rng):
            if count >= words:
                break
            pieces.append(piece)
            count += len(piece.split())
        if i % 2 == 0:
            fact, question, make_value = NEEDLE_TEMPLATES[(i // 2) % len(NEEDLE_TEMPLATES)]
            keys = rng.sample(names["objects"], 3)
            values = []
            while len(values) < 3:
                value = make_value(rng, names)
                if value not in values:
                    values.append(value)
            inserts = [(rng.uniform(0.05, 0.95), " " + fact.format(key=k, value=v))
                       for k, v in zip(keys, values)]
            dataset, ask, answers = "multi_needle", question.format(key=keys[0]), [values[0]]
        else:
            passage, q = items[rng.randrange(len(items))]
            inserts = [(rng.uniform(0.05, 0.95), "\n\n" + passage["passage"])]
            dataset, ask, answers = "qa", q["question"], [q["answer"], *q.get("aliases", [])]
        for depth, text in sorted(inserts, key=lambda x: -x[0]):
            pieces.insert(round(depth * len(pieces)), text)
        records.append({"_id": f"{dataset}-{i}", "dataset": dataset,
                        "context": "".join(pieces).strip(), "input": ask, "answers": answers})
    return records


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("out", None, "the JSONL file to write", flag_values=fv)
    flags.DEFINE_integer("num_samples", 30, "samples written", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "the samples' seed", flag_values=fv)
    flags.DEFINE_integer("min_words", 300, "shortest prose of a sample, in words", flag_values=fv)
    flags.DEFINE_integer("max_words", 1400, "longest prose of a sample, in words", flag_values=fv)
    flags.mark_flag_as_required("out", flag_values=fv)
    return fv


def main(argv: list[str]) -> None:
    """Write a LongBench-format JSONL of mixed-length natural-prose samples."""
    args = _flags()
    cli.parse(args, argv, main.__doc__)
    if args.num_samples < 1 or not 0 < args.min_words <= args.max_words:
        cli.usage_error("--num_samples >= 1 and 0 < --min_words <= --max_words are needed")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records = longbench_records(args.num_samples, args.seed, args.min_words, args.max_words)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} records to {out}")


if __name__ == "__main__":
    main(sys.argv)
