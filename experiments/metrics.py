"""Answer metrics (LongBench-style): contains, exact, token F1, ROUGE-L F."""
from __future__ import annotations

import collections
import re
import string

METRICS = ("contains", "exact", "qa_f1", "rouge_l")


def normalize(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (SQuAD normalization)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def contains(prediction: str, answer: str) -> float:
    return float(normalize(answer) in normalize(prediction))


def exact(prediction: str, answer: str) -> float:
    return float(normalize(prediction) == normalize(answer))


def qa_f1(prediction: str, answer: str) -> float:
    pred, gold = normalize(prediction).split(), normalize(answer).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(gold)
    return 2 * precision * recall / (precision + recall)


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, answer: str) -> float:
    pred, gold = normalize(prediction).split(), normalize(answer).split()
    lcs = _lcs(pred, gold)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(gold)
    return 2 * precision * recall / (precision + recall)


def score(metric: str, prediction: str, answers: list[str]) -> float:
    """Best score over the reference answers."""
    fn = {"contains": contains, "exact": exact, "qa_f1": qa_f1, "rouge_l": rouge_l}.get(metric)
    if fn is None:
        raise ValueError(f"unknown metric {metric!r}; use one of {METRICS}")
    return max((fn(prediction, a) for a in answers), default=0.0)


# --- agreement with the full cache --------------------------------------------------------

def log_softmax(logits) -> "np.ndarray":
    """Row-wise log-probabilities (float64) of logits [..., V]."""
    import numpy as np
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(reference_logits, logits) -> "np.ndarray":
    """KL(p_ref || p) per row, in nats, of two [..., V] logit arrays (p = softmax)."""
    import numpy as np
    ref, own = log_softmax(reference_logits), log_softmax(logits)
    return np.sum(np.exp(ref) * (ref - own), axis=-1)


def greedy_agreement(reference: list[int], tokens: list[int], n: int) -> tuple[float, float]:
    """(exact, prefix) agreement of a greedy output with the reference over the first
    min(n, len(reference)) tokens: exact = 1.0 if they are all equal, prefix = share of those
    tokens before the first difference."""
    m = min(n, len(reference))
    if m == 0:
        return 1.0, 1.0
    common = 0
    while common < m and common < len(tokens) and tokens[common] == reference[common]:
        common += 1
    return float(common == m), common / m
