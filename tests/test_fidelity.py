"""The fidelity suite's metrics and mechanism measurements on hand-made cases where the answer
is known: KL and greedy agreement with the full cache, answer-span survival and selection."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import metrics, natural_tasks, tasks
from mpcache_jax import analysis
from mpcache_jax.policies.mpcache import MPCache
from mpcache_jax.policy import PrefillAux
from mpcache_jax.cache import LayerKV
from models import registry


# ----- agreement / KL ---------------------------------------------------------------------------

def test_kl_divergence_of_hand_made_distributions():
    p = np.array([0.5, 0.25, 0.25])
    q = np.array([0.25, 0.25, 0.5])
    # logits are log-probabilities up to a constant per row
    got = metrics.kl_divergence(np.log(p) + 3.0, np.log(q) - 1.0)
    want = 0.5 * math.log(2) + 0.25 * 0 + 0.25 * math.log(0.5)
    assert got == pytest.approx(want, abs=1e-12)
    assert metrics.kl_divergence(np.log(p), np.log(p) + 7.0) == pytest.approx(0.0, abs=1e-12)
    rows = metrics.kl_divergence(np.log([p, q]), np.log([q, q]))
    assert rows.shape == (2,) and rows[1] == pytest.approx(0.0, abs=1e-12) and rows[0] > 0


def test_kl_is_finite_for_peaked_logits():
    ref = np.array([0.0, -200.0, -300.0])
    got = metrics.kl_divergence(ref, np.array([-200.0, 0.0, -300.0]))
    assert np.isfinite(got) and got == pytest.approx(200.0, rel=1e-6)


def test_greedy_agreement_over_the_first_tokens():
    ref = [5, 6, 7, 8, 2]
    assert metrics.greedy_agreement(ref, [5, 6, 7, 8, 2], 16) == (1.0, 1.0)
    assert metrics.greedy_agreement(ref, [5, 6, 9, 8, 2], 16) == (0.0, 2 / 5)
    assert metrics.greedy_agreement(ref, [5, 6, 9], 2) == (1.0, 1.0)       # only 2 compared
    assert metrics.greedy_agreement(ref, [5], 4) == (0.0, 1 / 4)           # stopped early
    assert metrics.greedy_agreement([], [1, 2], 4) == (1.0, 1.0)


# ----- mechanism ----------------------------------------------------------------------------------

def test_span_coverage_counts_answer_tokens_per_head():
    mask = np.zeros((2, 10), bool)
    mask[0, [3, 4, 5]] = True
    mask[1, [4]] = True
    assert analysis.span_coverage(mask, [(3, 6)]) == pytest.approx((3 / 3 + 1 / 3) / 2)
    assert analysis.span_coverage(mask[0], [(3, 5), (8, 9)]) == pytest.approx(2 / 3)


def test_attended_positions_map_slots_back_to_the_prompt():
    keep = np.zeros((1, 8), bool)
    keep[0, [1, 4, 6]] = True                  # region slot j holds the j-th kept position
    slots = np.array([[0, 1, 1, 0]])          # slots 1, 2 attended (slot 3 is padding)
    got = analysis.attended_positions([slots], [keep])[0]
    assert np.flatnonzero(got[0]).tolist() == [4, 6]


def _constructed_layer(T, d, answer):
    """One layer, one KV head: keys are one-hot directions; the `answer` tokens share the
    direction e_0 with large norm, the window queries look at e_1 (token 2) only."""
    k = np.zeros((1, T, d), np.float32)
    for t in range(T):
        k[0, t, 2 + t % (d - 2)] = 1.0
    for t in answer:
        k[0, t] = 0.0
        k[0, t, 0] = 4.0
    k[0, 2] = 0.0
    k[0, 2, 1] = 8.0
    q = np.zeros((1, T, d), np.float32)
    q[0, :, 1] = 1.0
    return k, q


def test_static_survival_and_dynamic_selection_of_a_known_answer():
    """Static eviction voted by queries that look at token 2 keeps it and drops the answer
    span; dynamic selection by a decode query along e_0 selects exactly the answer span."""
    T, d, answer = 64, 16, (40, 41, 42, 43)
    k, q = _constructed_layer(T, d, answer)
    cache = (LayerKV(jnp.asarray(k), jnp.asarray(k), jnp.asarray(T, jnp.int32)),)
    aux = PrefillAux(queries=(jnp.asarray(q),), prompt_len=T)
    static = MPCache(budget=8, static=True, dynamic=False, static_keep=8, static_window=4,
                     static_sinks=1, static_recent=1)
    keep = analysis.prompt_keep_masks(static, cache, aux)[0]
    assert keep[0, 2] and analysis.span_coverage(keep, [(40, 44)]) == 0.0

    dynamic = MPCache(budget=12, static=False, levels=((4, None),), similarity="exact",
                      share_group=1)
    keep = analysis.prompt_keep_masks(dynamic, cache, aux)[0]
    assert analysis.span_coverage(keep, [(40, 44)]) == 1.0          # nothing evicted
    state = dynamic.compress(cache, aux, 2)[0]
    query = np.zeros((1, d), np.float32)
    query[0, 0] = 1.0
    slots = np.asarray(dynamic.attended_slots(0, jnp.asarray(query), state, None))
    attended = analysis.attended_positions([slots], [keep])[0]
    # budget 12 = the answer's cluster + the always-selected first and last clusters
    assert np.flatnonzero(attended[0]).tolist() == [0, 1, 2, 3, 40, 41, 42, 43, 60, 61, 62, 63]
    assert analysis.span_coverage(attended, [(40, 44)]) == 1.0


# ----- tasks --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return registry.load("smollm2-135m").tokenizer


@pytest.mark.parametrize("task", ["multi_needle", "multi_hop", "qa"])
def test_natural_tasks_are_exact_length_and_mark_the_answer(tokenizer, task):
    make = natural_tasks.NATURAL_TASKS[task]
    samples = list(make(tokenizer, num_samples=4, lengths=[512, 700], depths=[0.2, 0.8], seed=3))
    again = list(make(tokenizer, num_samples=4, lengths=[512, 700], depths=[0.2, 0.8], seed=3))
    assert [s.prompt_ids for s in samples] == [s.prompt_ids for s in again]   # deterministic
    for s in samples:
        assert len(s.prompt_ids) == s.meta["length"]
        (a, b), = s.answer_spans
        marked = tokenizer.decode(s.prompt_ids[a:b]).strip().lower()
        assert any(marked == ans.lower() for ans in s.answers), (marked, s.answers)


def test_continuation_and_longbench_export(tokenizer, tmp_path):
    samples = list(natural_tasks.continuation(tokenizer, num_samples=2, lengths=[300],
                                              target_len=16, seed=0))
    assert [len(s.prompt_ids) for s in samples] == [300, 300]
    assert all(len(s.target_ids) == 16 for s in samples)
    path = tmp_path / "mixed.jsonl"
    natural_tasks.main(["natural_tasks", "--out", str(path), "--num_samples", "6"])
    rows = list(tasks.longbench_jsonl(tokenizer, data_path=str(path), num_samples=6,
                                      max_length=4096, metric=None))
    assert len({len(r.prompt_ids) for r in rows}) > 3          # mixed lengths
    assert {r.metric for r in rows} == {"contains", "qa_f1"}


def test_long_prompts_go_on_into_the_extra_prose_and_leave_shorter_ones_unchanged(
        tokenizer, monkeypatch, tmp_path):
    make = natural_tasks.NATURAL_TASKS["multi_hop"]
    short = dict(num_samples=3, lengths=[512, 900], depths=[0.3, 0.7], seed=5)
    with_extra = [s.prompt_ids for s in make(tokenizer, **short)]
    long_sample, = make(tokenizer, num_samples=1, lengths=[16384], depths=[0.5], seed=5)
    assert len(long_sample.prompt_ids) == 16384
    text = tokenizer.decode(long_sample.prompt_ids)
    extra_openings = [path.read_text()[:60] for path in
                      sorted(natural_tasks.EXTRA_PROSE_DIR.glob("*.txt"))]
    assert any(opening in text for opening in extra_openings)
    # With a different second folder, the prompts that fit in the first are the same...
    (tmp_path / "filler.txt").write_text("A short paragraph of filler prose.\n")
    monkeypatch.setattr(natural_tasks, "EXTRA_PROSE_DIR", tmp_path)
    assert [s.prompt_ids for s in make(tokenizer, **short)] == with_extra
    # ...and a prompt longer than both folders hold is refused, naming what it needs.
    with pytest.raises(ValueError, match="fewer than the .* this 16384-token prompt needs"):
        list(make(tokenizer, num_samples=1, lengths=[16384], depths=[0.5], seed=5))
