"""The main job's progress (experiments/progress.py) on fake step timings: the prefill is
reported apart, and the decode bar's rate and ETA come from decode steps only. No real run and
no wall-clock assertions: every time below is a made-up timestamp."""
import io

import pytest

from experiments.progress import DecodeETA, GenerationProgress, format_duration
from runtime.mpc.secure import StepCost


def test_eta_ignores_everything_before_decode():
    # 60 s compile + 140 s prefill happened before start(); only decode intervals count.
    eta = DecodeETA(total_steps=15)
    eta.start(200.0)
    assert eta.seconds_per_step() is None and eta.eta_s() is None
    eta.step(209.0)
    eta.step(218.0)
    assert eta.done == 2 and eta.remaining == 13
    assert eta.seconds_per_step() == pytest.approx(9.0)
    assert eta.eta_s() == pytest.approx(13 * 9.0)


def test_eta_mean_and_window():
    eta = DecodeETA(total_steps=6)
    eta.start(0.0)
    for t in (10.0, 18.0, 30.0):       # steps of 10, 8, 12 s
        eta.step(t)
    assert eta.seconds_per_step() == pytest.approx(10.0)
    assert eta.eta_s() == pytest.approx(30.0)
    recent = DecodeETA(total_steps=6, window=2)
    recent.start(0.0)
    for t in (10.0, 18.0, 30.0):
        recent.step(t)
    assert recent.seconds_per_step() == pytest.approx(10.0)   # (8 + 12) / 2
    recent.step(34.0)                                          # 4 s
    assert recent.seconds_per_step() == pytest.approx(8.0)     # (12 + 4) / 2
    assert recent.eta_s() == pytest.approx(2 * 8.0)


def test_eta_after_the_last_step_is_zero():
    eta = DecodeETA(total_steps=2)
    eta.start(5.0)
    eta.step(6.0)
    eta.step(8.0)
    assert eta.remaining == 0 and eta.eta_s() == 0.0


def test_eta_errors():
    with pytest.raises(RuntimeError, match="before start"):
        DecodeETA(3).step(1.0)
    eta = DecodeETA(3)
    eta.start(10.0)
    with pytest.raises(ValueError, match="before the previous"):
        eta.step(9.0)
    with pytest.raises(ValueError, match="total_steps"):
        DecodeETA(-1)
    with pytest.raises(ValueError, match="window"):
        DecodeETA(3, window=0)


def test_format_duration():
    assert format_duration(None) == "?"
    assert format_duration(0) == "0:00"
    assert format_duration(117.4) == "1:57"
    assert format_duration(3725) == "1:02:05"


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_steps(progress, clock, times, tokens, prompt_tokens=10):
    """Compile and prefill (ending at times[0]), then one decode step at each later time."""
    progress.phase("compile")
    progress.phase("prefill")
    for i, (t, token) in enumerate(zip(times, tokens)):
        clock.now = t
        phase = "prefill" if i == 0 else "decode"
        progress.step(StepCost(phase, prompt_tokens + i, 1.0, None), token)


def test_generation_progress_reports_prefill_apart_and_eta_from_decode():
    clock, out = FakeClock(), io.StringIO()
    progress = GenerationProgress(
        173, 16, clock=clock, file=out,
        describe_cost=lambda step: "19.00 GB, 14,700 messages",
        decode_text=lambda tokens: " ".join(f"t{t}" for t in tokens))
    progress.phase("compile")
    clock.now = 60.0
    progress.phase("prefill")
    clock.now = 200.0                                  # a 140 s prefill
    progress.step(StepCost("prefill", 173, 140.0, None), 7)
    text = out.getvalue()
    assert "compiled in 60 s" in text
    assert "secure prefill: done in 140.0 s, 19.00 GB, 14,700 messages" in text
    assert progress.eta.total_steps == 15              # the prefill made token 1 of 16
    assert "eta ?" in progress.status()                # no decode step timed yet
    for i, t in enumerate((209.0, 218.0)):             # two 9 s decode steps: token 3 of 16
        clock.now = t
        progress.step(StepCost("decode", 173 + i, 8.5, None), 8 + i)
    assert progress.bar.n == 3
    # 13 steps left at 9 s: 1:57, not 13 x (200 s / 1 token) as a bar counting prefill says.
    assert progress.status().startswith("eta 1:57 (9.0 s/token)")
    assert "t7 t8 t9" in progress.status()
    progress.close()


def test_generation_progress_without_tokens_off_the_client():
    # A party that is not the client sees token None: the bar still counts steps.
    clock = FakeClock()
    progress = GenerationProgress(10, 3, clock=clock, file=io.StringIO())
    run_steps(progress, clock, (5.0, 7.0), (None, None))
    assert progress.bar.n == 2
    assert progress.eta.eta_s() == pytest.approx(2.0)
    progress.close()


def test_expected_answer_length_sets_the_bar_and_eta():
    # The plaintext run answered in 5 tokens: after token 3, 2 decode steps are left, not 13.
    clock, out = FakeClock(), io.StringIO()
    progress = GenerationProgress(173, 16, expected_tokens=5, clock=clock, file=out)
    run_steps(progress, clock, (200.0, 210.0, 218.0), (1, 2, 3))
    assert "decoding up to 5 tokens" in out.getvalue()
    assert progress.bar.total == 5 and progress.bar.n == 3
    assert progress.eta.eta_s() == pytest.approx(2 * 9.0)
    progress.close()


def test_a_run_past_the_expected_length_falls_back_to_max_new_tokens():
    clock = FakeClock()
    progress = GenerationProgress(10, 8, expected_tokens=2, clock=clock, file=io.StringIO())
    run_steps(progress, clock, (10.0, 12.0), (1, 2))           # token 2 of the expected 2
    assert progress.eta.eta_s() == 0.0
    clock.now = 14.0
    progress.step(StepCost("decode", 12, 2.0, None), 3)       # the secure run goes on
    assert progress.bar.total == 8 and progress.eta.total_steps == 7
    assert progress.eta.eta_s() == pytest.approx(5 * 2.0)
    progress.close()


def test_expected_tokens_out_of_range():
    with pytest.raises(ValueError, match="expected_tokens=0"):
        GenerationProgress(10, 8, expected_tokens=0, file=io.StringIO())
    with pytest.raises(ValueError, match="expected_tokens=9"):
        GenerationProgress(10, 8, expected_tokens=9, file=io.StringIO())
