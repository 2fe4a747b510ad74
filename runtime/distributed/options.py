"""The typed sections of a node config: link options (timeouts, TLS files, shaping) and the
job (the public program every party agrees to run), each checked when built; every error is
a NodeConfigError naming the field and what to write instead (config.py reads the file).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from mpcache_jax.policies import POLICY_NAMES
from mpcache_jax.primitives import parse_budget
from models.registry import MODEL_NAMES


class NodeConfigError(ValueError):
    """A node config is malformed; the message names the offending entry and what to change."""


@dataclasses.dataclass(frozen=True)
class PartyCerts:
    cert: str
    key: str


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS: every party presents its own certificate and checks its peers' against `ca`."""

    ca: str
    certs: dict[str, PartyCerts]
    verify_depth: int = 1


# The longest timeout any link or job field may name: 7 days. The link takes milliseconds
# and retry counts as 32-bit integers (uint32 / brpc's int32 ms), which 7 days in ms fits.
MAX_TIMEOUT_S = 7 * 24 * 3600


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_budget_text(value) -> bool:
    """A budget written RATIOminTOKENS ('0.1min384'; `primitives.parse_budget`)."""
    if not isinstance(value, str) or "min" not in value or len(value) > 32:
        return False
    try:
        parse_budget(value)
    except ValueError:
        return False
    return True


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_types(obj, types: dict[str, tuple[str, Any]], where: str) -> None:
    """Each field of `obj` named in `types` must pass its check: {name: (what, predicate)}."""
    for name, (what, ok) in types.items():
        value = getattr(obj, name)
        if not ok(value):
            hint = " (write it without quotes)" if isinstance(value, str) else ""
            raise NodeConfigError(f"{where}.{name}={value!r} must be {what}{hint}")


@dataclasses.dataclass(frozen=True)
class ShapeSpec:
    """Traffic shaping by the parties' fronts: every frame a party receives is held for
    `delay_ms` (one-way delay) after it has passed a per-connection rate of `rate_mb_s`
    (10^6 bytes per second; None = no rate limit)."""

    delay_ms: float = 0.0
    rate_mb_s: float | None = None


# link.shape profiles: the paper's LAN (3016 mbit = 377 MB/s, 0.3 ms) and WAN (40 MB/s, 80 ms).
SHAPE_PROFILES = {"lan": ShapeSpec(0.3, 377.0), "wan": ShapeSpec(80.0, 40.0)}
MAX_SHAPE_DELAY_MS = 60_000.0


def parse_shape(shape: Any) -> ShapeSpec | None:
    """link.shape: null, "lan", "wan" or {"delay_ms": MS, "rate_mb_s": MB_PER_S | null}."""
    if shape is None or isinstance(shape, ShapeSpec):
        return shape
    if isinstance(shape, str):
        if shape not in SHAPE_PROFILES:
            raise NodeConfigError(f"link.shape={shape!r} is unknown; use \"lan\" (377 MB/s, "
                                  "0.3 ms), \"wan\" (40 MB/s, 80 ms) or {\"delay_ms\": MS, "
                                  "\"rate_mb_s\": MB_PER_S}")
        return SHAPE_PROFILES[shape]
    if not isinstance(shape, dict):
        raise NodeConfigError(f"link.shape={shape!r} must be \"lan\", \"wan\" or "
                              "{\"delay_ms\": MS, \"rate_mb_s\": MB_PER_S}")
    unknown = sorted(set(shape) - {"delay_ms", "rate_mb_s"})
    if unknown:
        raise NodeConfigError(f"link.shape has unknown key(s) {unknown}; keys: delay_ms, "
                              "rate_mb_s")
    delay, rate = shape.get("delay_ms", 0.0), shape.get("rate_mb_s")
    if not is_number(delay) or not 0 <= delay <= MAX_SHAPE_DELAY_MS:
        raise NodeConfigError(f"link.shape.delay_ms={delay!r} must be a number of milliseconds "
                              f"from 0 to {MAX_SHAPE_DELAY_MS:g} (one-way delay)")
    if rate is not None and (not is_number(rate) or not 0 < rate <= 1e6):
        raise NodeConfigError(f"link.shape.rate_mb_s={rate!r} must be a rate in MB/s above 0 "
                              "(at most 1e6), or null for no rate limit")
    return ShapeSpec(float(delay), None if rate is None else float(rate))


@dataclasses.dataclass(frozen=True)
class LinkOptions:
    """brpc link settings and failure detection.

    `connect_timeout_s` (<= 60 s by default): from the moment a party starts its link, every
    peer must come up (its endpoint answers, with the right certificate under TLS) within this
    long, else the party fails naming the peer that never came up. `peer_timeout_s`: every
    party probes its peers' link endpoints once a second; a peer seen up that then refuses or
    does not answer for this long (dead, hung, unreachable) makes the party fail naming it.
    `recv_timeout_s`: the link's own limit on waiting for one message from a peer that is
    alive; it must exceed the longest local step of any party (compilation, ~20 s for a
    30-layer model). `connect_retry_times` x `connect_retry_interval_ms`: brpc's own connect
    retries (raised, when shorter, to outlast connect_timeout_s, which decides).
    `insecure`: allow plain TCP to non-loopback hosts (prints a warning). `shape`: traffic
    shaping by the fronts (`parse_shape`: "lan", "wan" or {"delay_ms", "rate_mb_s"})."""

    peer_timeout_s: float = 30.0
    recv_timeout_s: float = 600.0
    connect_timeout_s: float = 60.0
    connect_retry_times: int = 10
    connect_retry_interval_ms: int = 1000
    http_timeout_ms: int = 20000
    insecure: bool = False
    shape: Any = None
    tls: TLSConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", parse_shape(self.shape))
        seconds = ("a number of seconds", is_number)
        integer = ("an integer", is_int)
        check_types(self, {"peer_timeout_s": seconds, "recv_timeout_s": seconds,
                            "connect_timeout_s": seconds, "connect_retry_times": integer,
                            "connect_retry_interval_ms": integer, "http_timeout_ms": integer,
                            "insecure": ("true or false", lambda v: isinstance(v, bool))},
                     "link")
        for name in ("peer_timeout_s", "recv_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if value <= 0:
                raise NodeConfigError(f"link.{name}={value} must be > 0 seconds")
            if value > MAX_TIMEOUT_S:
                raise NodeConfigError(f"link.{name}={value:g} is beyond the longest timeout the "
                                      f"link accepts, {MAX_TIMEOUT_S} s (7 days: its "
                                      "milliseconds and retry counts are 32-bit); use at most "
                                      f"{MAX_TIMEOUT_S}")
        if self.connect_retry_times < 0 or self.connect_retry_interval_ms <= 0:
            raise NodeConfigError("link.connect_retry_times must be >= 0 and "
                                  "link.connect_retry_interval_ms > 0")
        for name in ("connect_retry_times", "connect_retry_interval_ms", "http_timeout_ms"):
            value = getattr(self, name)
            if value > MAX_TIMEOUT_S * 1000:
                raise NodeConfigError(f"link.{name}={value} is beyond the bound the link "
                                      f"accepts ({MAX_TIMEOUT_S * 1000}, 32-bit and 7 days in "
                                      f"ms); use at most {MAX_TIMEOUT_S * 1000}")
        if self.http_timeout_ms <= 0:
            raise NodeConfigError(f"link.http_timeout_ms={self.http_timeout_ms} must be > 0")
        if self.insecure and self.tls is not None:
            raise NodeConfigError('link.insecure=true and link.tls contradict each other: remove '
                                  '"insecure" to use TLS, or "tls" to run over plain TCP')


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """The public program every party agrees to run: secure generation of `max_new_tokens`
    greedy tokens after a `seq_len`-token prompt with `policy` on `model`.

    The prompt is the prompt owner's private input: a file given to its party only
    (`--prompt_file`, wrapped in the chat template when `chat`), else `prompt_ids`, else
    `seq_len` random ids drawn with `prompt_seed`; its length is public. `seed` draws random
    weights for random-weight models. `reveal_logits` also opens the logits of each generated
    token to the prompt owner (tests; leaks more than tokens). `memory_limit_gb`: the most one
    party may need by `estimate_party_memory` (default: 80% of this machine's memory divided
    among the parties that run on it). `prefill`: "secure" (the private run), or "clear" for
    decode-step benchmarks that neither keep the prompt private nor need a secure prefill's
    memory: the prompt is public (`prompt_ids` or the random one; a prompt file is refused),
    the model owner prefills it in plaintext and secret-shares the cache, and the decode steps
    run securely as always (their cost does not depend on the values).
    """

    model: str = "llama-tiny"
    policy: str = "mpcache"
    budget: float | int | str | None = None
    policy_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    seq_len: int = 64
    max_new_tokens: int = 2
    num_layers: int | None = None
    seed: int = 0
    prompt_seed: int = 1
    prompt_ids: tuple[int, ...] | None = None
    chat: bool = True
    reveal_logits: bool = False
    timeout_s: float = 600.0
    memory_limit_gb: float | None = None
    prefill: str = "secure"

    def __post_init__(self):
        integer = ("an integer", is_int)
        optional = lambda ok: (lambda v: v is None or ok(v))  # noqa: E731
        check_types(self, {
            "model": ("a string", lambda v: isinstance(v, str)),
            "policy": ("a string", lambda v: isinstance(v, str)),
            "budget": ("a number, a ratio with a floor such as \"0.1min384\", or null",
                       optional(lambda v: is_number(v) or is_budget_text(v))),
            "policy_options": ("an object", lambda v: isinstance(v, dict)),
            "seq_len": integer, "max_new_tokens": integer,
            "num_layers": ("an integer or null", optional(is_int)),
            "seed": integer, "prompt_seed": integer,
            "chat": ("true or false", lambda v: isinstance(v, bool)),
            "reveal_logits": ("true or false", lambda v: isinstance(v, bool)),
            "timeout_s": ("a number of seconds", is_number),
            "memory_limit_gb": ("a number of GB or null", optional(is_number)),
            "prefill": ("a string", lambda v: isinstance(v, str)),
        }, "job")
        from runtime.mpc.secure import PREFILL_MODES
        if self.prefill not in PREFILL_MODES:
            raise NodeConfigError(f"job.prefill={self.prefill!r} is unknown; use \"secure\" "
                                  "(private) or \"clear\" (decode benchmarks, public prompt)")
        if self.prompt_ids is not None:
            if not isinstance(self.prompt_ids, (list, tuple)):
                raise NodeConfigError(f"job.prompt_ids must be a list of integer token ids, got "
                                      f"{self.prompt_ids!r}; e.g. [1, 2, 3]")
            bad = [t for t in self.prompt_ids if not is_int(t)]
            if bad:
                raise NodeConfigError(f"job.prompt_ids must be a list of integer token ids, got "
                                      f"{bad[0]!r} in it; write ids as JSON numbers, e.g. "
                                      "[1, 2, 3]")
            object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        if self.model not in MODEL_NAMES:
            raise NodeConfigError(f"job.model={self.model!r} is unknown; use one of {MODEL_NAMES}")
        if self.policy not in POLICY_NAMES:
            raise NodeConfigError(f"job.policy={self.policy!r} is unknown; use one of {POLICY_NAMES}")
        if self.seq_len < 1 or self.max_new_tokens < 1:
            raise NodeConfigError("job.seq_len and job.max_new_tokens must be >= 1")
        if self.prompt_ids is not None and len(self.prompt_ids) != self.seq_len:
            raise NodeConfigError(f"job.prompt_ids has {len(self.prompt_ids)} ids but job.seq_len "
                                  f"is {self.seq_len}; make them agree")
        if self.timeout_s <= 0:
            raise NodeConfigError(f"job.timeout_s={self.timeout_s} must be > 0 seconds")
        if self.timeout_s > MAX_TIMEOUT_S:
            raise NodeConfigError(f"job.timeout_s={self.timeout_s:g} is beyond {MAX_TIMEOUT_S} s "
                                  "(7 days); use at most that")
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise NodeConfigError(f"job.memory_limit_gb={self.memory_limit_gb} must be > 0")

