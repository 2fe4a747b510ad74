"""The accuracy tasks by name: `--task=NAME` -> a builder of the task's samples.

A builder takes the tokenizer and a `SampleSpec` (what every task may read: lengths, depths,
counts, a data file) and returns the samples; a new task is one entry of `TASKS`, which also
says whether perplexity scores it and whether its samples come from --data_path.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from experiments import natural_tasks, tasks


@dataclasses.dataclass(frozen=True)
class SampleSpec:
    """lengths: prompt lengths in tokens (within the model's context); depths: where a needle
    sits (0-1); target_len: tokens scored by the perplexity tasks; data_path / metric: the
    LongBench-format file and its metric (None: the file's own)."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...] = (0.5,)
    num_samples: int = 10
    seed: int = 0
    data_path: str | None = None
    target_len: int = 64
    metric: str | None = None


def _synthetic(make, with_depths: bool = True):
    def build(tokenizer, spec: SampleSpec):
        depths = {"depths": list(spec.depths)} if with_depths else {}
        return make(tokenizer, lengths=list(spec.lengths), num_samples=spec.num_samples,
                    seed=spec.seed, **depths)
    return build


def _ppl(tokenizer, spec: SampleSpec):
    return tasks.perplexity_chunks(tokenizer, data_path=spec.data_path, lengths=list(spec.lengths),
                                   target_len=spec.target_len, num_samples=spec.num_samples,
                                   seed=spec.seed)


def _continuation(tokenizer, spec: SampleSpec):
    return natural_tasks.continuation(tokenizer, lengths=list(spec.lengths),
                                      target_len=spec.target_len, num_samples=spec.num_samples,
                                      seed=spec.seed)


def _longbench(tokenizer, spec: SampleSpec):
    # cut as LongBench cuts: the head and tail of a prompt longer than the longest length
    return tasks.longbench_jsonl(tokenizer, data_path=spec.data_path, num_samples=spec.num_samples,
                                 max_length=max(spec.lengths), metric=spec.metric)


TaskBuilder = Callable[[object, SampleSpec], object]


@dataclasses.dataclass(frozen=True)
class Task:
    """A registered task. build(tokenizer, spec) -> its samples; perplexity: scored by the
    perplexity of spec.target_len tokens, which it decodes instead of max_new_tokens;
    data_path: its samples come from --data_path (the others from --seed and the repo's
    prose)."""
    build: TaskBuilder
    perplexity: bool = False
    data_path: bool = False


TASKS: dict[str, Task] = {
    "passkey": Task(_synthetic(tasks.passkey)),
    "needle": Task(_synthetic(tasks.needle)),
    "kv_retrieval": Task(_synthetic(tasks.kv_retrieval, with_depths=False)),
    "ppl": Task(_ppl, perplexity=True, data_path=True),
    "longbench_jsonl": Task(_longbench, data_path=True),
    # the fidelity suite (natural prose, experiments/natural_tasks.py)
    **{name: Task(_synthetic(make)) for name, make in natural_tasks.NATURAL_TASKS.items()},
    "continuation": Task(_continuation, perplexity=True),
}
PERPLEXITY_TASKS = frozenset(name for name, task in TASKS.items() if task.perplexity)
DATA_PATH_TASKS = frozenset(name for name, task in TASKS.items() if task.data_path)


def parse_tasks(values: list[str]) -> list[str]:
    """--task entries, checked: registered names, none twice."""
    chosen = [v.strip() for v in values if v.strip()]
    unknown = [t for t in chosen if t not in TASKS]
    if not chosen or unknown:
        raise ValueError(f"--task: unknown task(s) {unknown or values}; choose from "
                         f"{', '.join(TASKS)} (comma-separated for several)")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"--task lists a task twice: {values}")
    return chosen


def make_samples(task: str, tokenizer, spec: SampleSpec) -> list:
    """The task's samples (`spec.lengths` already within the model's context)."""
    return list(TASKS[task].build(tokenizer, spec))
