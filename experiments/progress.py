"""What the main job shows while it runs: the secure prefill as its own lines, then a token bar
whose rate and ETA come from the decode steps alone.

A private generation has three phases of very different lengths: compiling the prefill and
decode programs (about a minute), the secure prefill (minutes: the whole prompt under MPC) and
the decode steps (seconds each, all alike). A bar that counts the prefill's token as the first
of `max_new_tokens` divides everything before it by one token and so predicts the remaining
tokens at the prefill's pace (an ETA of ~50 minutes for a job that ends in ~6). Here the
prefill is reported apart (what runs, then its seconds, bytes and messages once measured: SPU
reports a program's cost only after running it), and `DecodeETA` predicts the rest from the
intervals between decode steps. How many steps: the expected answer length when the caller
knows it (the main job runs the plaintext reference first, and the secure run stops at the same
end-of-turn token), else `max_new_tokens`; a run that goes past the expected length falls back
to `max_new_tokens`.

`DecodeETA` is pure bookkeeping on timestamps (tests feed it fake ones); `GenerationProgress`
prints with it.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm


def format_duration(seconds: float | None) -> str:
    """Seconds as H:MM:SS or M:SS ("?" when unknown)."""
    if seconds is None:
        return "?"
    whole = max(0, int(round(seconds)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class DecodeETA:
    """Rate and time left of the decode steps, from the decode steps only.

    `start(t)` when the prefill's token is out (decode begins); `step(t)` after each decode
    step. A step's duration is the interval since the previous one (the first: since start),
    so everything between two tokens counts (the MPC program, sharing the token, revealing the
    next); compilation and the prefill never do. `seconds_per_step` is the mean of the last
    `window` intervals (all of them by default); `eta_s` = that x the steps left of
    `total_steps` (which the caller may raise while running), None until a decode step has
    been timed."""

    def __init__(self, total_steps: int, window: int | None = None):
        if total_steps < 0:
            raise ValueError(f"total_steps={total_steps} must be >= 0")
        if window is not None and window < 1:
            raise ValueError(f"window={window} must be >= 1 (or None: every step)")
        self.total_steps, self.window = total_steps, window
        self.durations: list[float] = []
        self._last: float | None = None

    def start(self, t: float) -> None:
        """Decode begins at time t (seconds, any monotonic clock)."""
        self._last = t

    def step(self, t: float) -> float:
        """A decode step ended at time t -> its duration."""
        if self._last is None:
            raise RuntimeError("DecodeETA.step before start: call start(t) when decode begins")
        if t < self._last:
            raise ValueError(f"step time {t} is before the previous one ({self._last})")
        duration = t - self._last
        self.durations.append(duration)
        self._last = t
        return duration

    @property
    def done(self) -> int:
        return len(self.durations)

    @property
    def remaining(self) -> int:
        return max(0, self.total_steps - self.done)

    def seconds_per_step(self) -> float | None:
        if not self.durations:
            return None
        recent = self.durations[-self.window:] if self.window else self.durations
        return sum(recent) / len(recent)

    def eta_s(self) -> float | None:
        per = self.seconds_per_step()
        return None if per is None else per * self.remaining


# tqdm's own rate and remaining time are left out: they would count from the bar's creation
# with smoothing of their own; {postfix} (", " + `status()`) carries DecodeETA's instead.
BAR_FORMAT = "{desc}: {n_fmt}/{total_fmt} tokens |{bar}| [{elapsed} decoding{postfix}]"


class GenerationProgress:
    """The main job's progress: lines for compilation and the secure prefill, then a decode bar.

    Wire it to `SecureSession.generate(..., on_phase=progress.phase, on_step=progress.step)`
    and call `close()` after. `describe_cost(step) -> str` formats a step's measured cost (the
    caller knows the party count); `decode_text(tokens) -> str` shows the answer so far.
    `expected_tokens`: the answer length the caller expects (the plaintext run's), else
    max_new_tokens. `clock` is injectable for tests."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, *,
                 expected_tokens: int | None = None,
                 describe_cost: Callable[[object], str] = lambda step: "",
                 decode_text: Callable[[list], str] = lambda tokens: "",
                 clock: Callable[[], float] = time.perf_counter, file: TextIO | None = None):
        self.prompt_tokens, self.max_new_tokens = prompt_tokens, max_new_tokens
        self.describe_cost, self.decode_text, self.clock = describe_cost, decode_text, clock
        self.file = file if file is not None else sys.stderr
        if expected_tokens is not None and not 1 <= expected_tokens <= max_new_tokens:
            raise ValueError(f"expected_tokens={expected_tokens} must be in 1..{max_new_tokens}")
        self.expected_tokens = expected_tokens or max_new_tokens
        self.eta = DecodeETA(self.expected_tokens - 1)   # the first token comes from prefill
        self.tokens: list = []
        self.bar: tqdm | None = None
        self._phase_start = clock()

    def _say(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def phase(self, name: str) -> None:
        """A phase begins: "compile" (prefill and decode programs) or "prefill"."""
        now = self.clock()
        if name == "compile":
            self._say(f"secure prefill: compiling the prefill and decode programs for a "
                      f"{self.prompt_tokens}-token prompt ...")
        elif name == "prefill":
            self._say(f"secure prefill: programs compiled in {now - self._phase_start:.0f} s; "
                      f"running the prefill of {self.prompt_tokens} tokens under MPC "
                      "(its cost is measured when it ends) ...")
        self._phase_start = now

    def step(self, step, token) -> None:
        """After each secure step (`StepCost`, the revealed token or None)."""
        now = self.clock()
        if token is not None:
            self.tokens.append(token)
        if step.phase.startswith("prefill"):
            cost = self.describe_cost(step)
            self._say(f"secure prefill: done in {now - self._phase_start:.1f} s"
                      + (f", {cost}" if cost else "")
                      + f"; first token {self.decode_text(self.tokens)!r}"
                      + (f"; decoding up to {self.expected_tokens} tokens (the plaintext run's "
                         "answer length)" if self.expected_tokens < self.max_new_tokens else ""))
            self.eta.start(now)
            self.bar = tqdm(total=self.expected_tokens, initial=1, desc="decode",
                            unit="tok", file=self.file, dynamic_ncols=True,
                            postfix=self.status(), bar_format=BAR_FORMAT)
            return
        self.eta.step(now)
        if self.eta.done > self.eta.total_steps:     # past the expected answer: up to the cap
            self.eta.total_steps = self.max_new_tokens - 1
            if self.bar is not None:
                self.bar.total = self.max_new_tokens
        if self.bar is not None:
            self.bar.set_postfix_str(self.status(), refresh=False)   # shown by the update
            self.bar.update()

    def status(self) -> str:
        """The bar's postfix: time left and pace from decode steps, the answer so far."""
        per = self.eta.seconds_per_step()
        pace = "timing the first decode step" if per is None else f"{per:.1f} s/token"
        text = self.decode_text(self.tokens)[-32:]
        return f"eta {format_duration(self.eta.eta_s())} ({pace}) {text!r}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
