"""Accuracy tasks: deterministic synthetic retrieval prompts, perplexity chunks, LongBench JSONL.

Synthetic prompts are assembled at the token level to an exact length, so every sample of one
length reuses one compiled prefill and one compiled decode step per policy.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import random
import re
from typing import Iterable, Iterator

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"

PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                  "There and back again.")

# (needle sentence, question, answer phrase the reply must contain)
NEEDLES = [
    ("The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
     "What is the best thing to do in San Francisco?", "Dolores Park"),
    ("The secret ingredient of the village soup is smoked paprika from the hill farm.",
     "What is the secret ingredient of the village soup?", "paprika"),
    ("The lighthouse keeper named his grey cat Captain Biscuit.",
     "What did the lighthouse keeper name his cat?", "Biscuit"),
    ("The old clock tower in the harbour town is painted bright orange every spring.",
     "What colour is the old clock tower in the harbour town painted?", "orange"),
    ("The winning apple at the county fair was a variety called Golden Lantern.",
     "What was the winning apple variety at the county fair?", "Golden Lantern"),
]

KV_SUBJECTS = ["red door", "blue tower", "green garden", "silver bridge", "old mill",
               "north gate", "glass house", "stone well", "yellow barn", "east tunnel",
               "iron fence", "white chapel"]


@dataclasses.dataclass
class Sample:
    """One evaluation item. For ppl, `prompt_ids` is the prefix and `target_ids` the text to
    score. `answer_spans`: [start, end) prompt positions of the asked value, when known."""

    task: str
    sample_id: str
    prompt_ids: list[int]
    answers: list[str] = dataclasses.field(default_factory=list)
    metric: str = "contains"
    target_ids: list[int] | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    answer_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def haystack_paragraphs() -> list[str]:
    text = (DATA_DIR / "haystack.txt").read_text()
    return [p.strip().replace("\n", " ") for p in text.split("\n\n") if p.strip()]


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


class PromptBuilder:
    """Chat prompts `<template> intro \\n\\n document(+inserts) \\n\\n question <template>` of
    exactly `length` tokens, the document cut from `pieces` (strings, each with the whitespace
    that joins it to the previous one; tokenized one by one).

    Each insert is (depth, text, marks): the text goes between two pieces at `depth` (fraction
    of the document), and the token spans of its `marks` (substrings of the text, first
    occurrence) in the final prompt are returned, so a harness knows where an answer sits.
    """

    PLACEHOLDER = "\u0000DOCUMENT\u0000"

    def __init__(self, tokenizer, chat: bool = True):
        self.tok = tokenizer
        # A base model (no chat template, e.g. gemma3-270m) gets the plain prompt, with the
        # BOS its metadata asks for (what `encode_request` does for --prompt).
        self.chat = chat and getattr(tokenizer, "has_chat_template", True)
        self.bos = ([tokenizer.bos_id] if not self.chat and getattr(tokenizer, "add_bos", False)
                    else [])
        if self.chat:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": self.PLACEHOLDER}], add_generation_prompt=True)
            self.head, self.tail = rendered.split(self.PLACEHOLDER)
        else:
            self.head, self.tail = "", "\n"

    def _encode_marked(self, text: str, marks: list[str]):
        ids, offsets = self.tok.encode_with_offsets(text)
        spans = []
        for mark in marks:
            at = text.find(mark)
            if at < 0:
                raise ValueError(f"{mark!r} does not occur in {text!r}")
            inside = [i for i, (a, b) in enumerate(offsets) if a < at + len(mark) and b > at]
            spans.append((inside[0], inside[-1] + 1))
        return ids, spans

    def build(self, intro: str, pieces: Iterable[str], inserts: list[tuple[float, str, list[str]]],
              question: str, length: int) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """-> (prompt ids of exactly `length` tokens, per insert the [start, end) prompt
        positions of its marks)."""
        head = self.bos + self.tok.encode(self.head + intro + "\n\n")
        tail = self.tok.encode("\n\n" + question + self.tail)
        encoded = [(depth, *self._encode_marked(text, marks)) for depth, text, marks in inserts]
        room = length - len(head) - len(tail) - sum(len(ids) for _, ids, _ in encoded)
        if room < 16:
            raise ValueError(f"length={length} tokens is too short for this task's prompt")
        document: list = []
        total = 0
        for piece in pieces:
            if total >= room:
                break
            ids = self.tok.encode(piece)
            document.append(ids)
            total += len(ids)
        if total < room:
            raise ValueError(f"the text holds {total} tokens, fewer than the {room} this "
                             f"{length}-token prompt needs")
        document[-1] = document[-1][:len(document[-1]) - (total - room)]
        # Deepest insert first, each at round(depth x current number of pieces).
        for index in sorted(range(len(encoded)), key=lambda i: -encoded[i][0]):
            document.insert(round(encoded[index][0] * len(document)), index)
        tokens, spans = list(head), [None] * len(encoded)
        for part in document:
            if isinstance(part, int):
                _, ids, marks = encoded[part]
                spans[part] = [(len(tokens) + a, len(tokens) + b) for a, b in marks]
                tokens.extend(ids)
            else:
                tokens.extend(part)
        tokens.extend(tail)
        assert len(tokens) == length, (len(tokens), length)
        return tokens, spans


def spaced(sentences: list[str]) -> Iterator[str]:
    """The sentences again and again, each joined by a space."""
    return (" " + s for s in itertools.cycle(sentences))


def passkey(tokenizer, *, num_samples: int, lengths: list[int], depths: list[float], seed: int,
            chat: bool = True) -> Iterator[Sample]:
    builder = PromptBuilder(tokenizer, chat)
    rng = random.Random(seed)
    filler = _sentences(PASSKEY_FILLER)
    for i in range(num_samples):
        length = lengths[i % len(lengths)]
        depth = depths[(i // len(lengths)) % len(depths)]
        key = str(rng.randint(10000, 99999))
        ids, spans = builder.build(
            "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the pass key.", spaced(filler),
            [(depth, f" The pass key is {key}. Remember it. {key} is the pass key.", [key])],
            "What is the pass key?", length)
        yield Sample("passkey", f"passkey-{i}", ids, [key], "contains",
                     meta={"length": length, "depth": depth}, answer_spans=spans[0])


def needle(tokenizer, *, num_samples: int, lengths: list[int], depths: list[float], seed: int,
           chat: bool = True) -> Iterator[Sample]:
    """Needle in natural text. Samples sweep the length x depth grid (for the heatmap)."""
    builder = PromptBuilder(tokenizer, chat)
    rng = random.Random(seed)
    paragraphs = haystack_paragraphs()
    grid = [(length, depth) for length in lengths for depth in depths]
    for i in range(num_samples):
        length, depth = grid[i % len(grid)]
        fact, question, answer = NEEDLES[rng.randrange(len(NEEDLES))]
        start = rng.randrange(len(paragraphs))
        sentences = [s for p in paragraphs[start:] + paragraphs[:start] for s in _sentences(p)]
        ids, spans = builder.build(
            "Read the following text carefully and answer the question at the end.",
            spaced(sentences), [(depth, " " + fact, [answer])], question, length)
        yield Sample("needle", f"needle-{i}", ids, [answer], "contains",
                     meta={"length": length, "depth": depth}, answer_spans=spans[0])


def kv_retrieval(tokenizer, *, num_samples: int, lengths: list[int], num_facts: int = 6,
                 seed: int, chat: bool = True) -> Iterator[Sample]:
    """Several 'access number' facts scattered in natural text; one is asked for."""
    builder = PromptBuilder(tokenizer, chat)
    rng = random.Random(seed)
    paragraphs = haystack_paragraphs()
    sentences = [s for p in paragraphs for s in _sentences(p)]
    for i in range(num_samples):
        length = lengths[i % len(lengths)]
        subjects = rng.sample(KV_SUBJECTS, num_facts)
        values = [str(rng.randint(1000, 9999)) for _ in subjects]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in subjects)
        inserts = [(d, f" The access number of the {s} is {v}.", [v])
                   for d, s, v in zip(depths, subjects, values)]
        ask = rng.randrange(num_facts)
        ids, spans = builder.build(
            "Several access numbers are mentioned in the text below. Read it and answer the "
            "question at the end.", spaced(sentences), inserts,
            f"What is the access number of the {subjects[ask]}?", length)
        yield Sample("kv_retrieval", f"kv-{i}", ids, [values[ask]], "contains",
                     meta={"length": length, "depth": depths[ask], "num_facts": num_facts},
                     answer_spans=spans[ask])


def perplexity_chunks(tokenizer, *, data_path: str | None, num_samples: int, lengths: list[int],
                      target_len: int, seed: int) -> Iterator[Sample]:
    """Consecutive chunks of a text file: the policy compresses a prefix of `length` tokens and
    the next `target_len` tokens are scored teacher-forced."""
    path = pathlib.Path(data_path) if data_path else DATA_DIR / "haystack.txt"
    if not path.is_file():
        raise FileNotFoundError(f"--data_path={path} is not a readable text file")
    ids = tokenizer.encode(path.read_text())
    for i in range(num_samples):
        length = lengths[i % len(lengths)]
        need = length + target_len
        if len(ids) < need:
            ids = ids * (need // max(1, len(ids)) + 1)  # short files are repeated
        start = (i * 997 + seed * 131) % max(1, len(ids) - need + 1)
        chunk = ids[start:start + need]
        yield Sample("ppl", f"ppl-{i}", chunk[:length], metric="ppl", target_ids=chunk[length:],
                     meta={"length": length, "offset": start, "source": str(path)})


# LongBench's metric per dataset (its own mapping, simplified to the metrics we implement).
LONGBENCH_METRICS = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1", "musique": "qa_f1", "triviaqa": "qa_f1", "gov_report": "rouge_l",
    "qmsum": "rouge_l", "multi_news": "rouge_l", "samsum": "rouge_l", "trec": "contains",
    "passage_retrieval_en": "contains", "passage_count": "exact", "lcc": "rouge_l",
    "repobench-p": "rouge_l",
    # the fidelity suite's mixed-length export (mpcache natural-tasks)
    "multi_needle": "contains", "qa": "qa_f1",
}


def longbench_jsonl(tokenizer, *, data_path: str, num_samples: int, max_length: int,
                    metric: str | None, chat: bool = True) -> Iterator[Sample]:
    """LongBench-format JSONL (context, input, answers[, dataset, length, _id]). Contexts longer
    than `max_length` tokens are cut in the middle, as LongBench does."""
    path = pathlib.Path(data_path or "")
    if not data_path or not path.is_file():
        raise FileNotFoundError(f"--data_path={data_path!r}: give a LongBench-format .jsonl file")
    count = 0
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if count >= num_samples:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not a JSON object ({err.msg} at column "
                                 f"{err.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_no}: a line must be a JSON object with context, "
                                 f"input and answers, got {type(record).__name__}")
            for field in ("context", "input", "answers"):
                if field not in record:
                    raise ValueError(f"{path}:{line_no}: no {field!r} field")
            for field in ("context", "input"):
                if not isinstance(record[field], str):
                    raise ValueError(f"{path}:{line_no}: field {field!r} must be a string, got "
                                     f"{type(record[field]).__name__}")
            count += 1
            user = f"{record['context']}\n\nQuestion: {record['input']}\nAnswer:"
            ids = tokenizer.encode_request(user, chat=chat)   # a base model: plain, with BOS
            if len(ids) > max_length:
                half = max_length // 2
                ids = ids[:half] + ids[-(max_length - half):]
            answers = record["answers"] if isinstance(record["answers"], list) else [record["answers"]]
            chosen = metric or LONGBENCH_METRICS.get(record.get("dataset", ""), "qa_f1")
            yield Sample("longbench_jsonl", str(record.get("_id", line_no - 1)), ids,
                         [str(a) for a in answers], chosen,
                         meta={"dataset": record.get("dataset", ""), "length": len(ids)})
    if count == 0:
        raise ValueError(f"{path}: no samples (the file has no JSON lines)")
