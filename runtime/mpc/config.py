"""MPC runtime configuration: protocol, parties, field, fixed point, non-linearity modes.

One validated, hashable `MPCConfig` feeds both the in-process simulator and real multi-party
runs. It is built from flags (`MPCConfig(protocol="ABY3", ...)`) or from JSON in SPU's
`RuntimeConfig` form, optionally wrapped with the party list:

    {"protocol": "ABY3", "field": "FM64", "fxp_fraction_bits": 18, "fxp_exp_mode": "EXP_PADE"}
    {"runtime_config": {...as above...}, "parties": ["127.0.0.1:61920", ...]}

Every mistake that SPU would report late (or not at all) is caught here with a message that
says what to change: unknown protocol, party count the protocol cannot run with, a field too
narrow for the fixed-point fraction bits, unknown keys.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# Parties each protocol runs with (SPU 0.9.5): ABY3 is 3PC replicated sharing (PUMA),
# CHEETAH is 2PC (BumbleBee's protocols), SEMI2K is additive sharing for 2 or more parties.
PROTOCOL_PARTIES = {"ABY3": (3,), "SEMI2K": tuple(range(2, 9)), "CHEETAH": (2,)}
DEFAULT_PARTIES = {"ABY3": 3, "SEMI2K": 2, "CHEETAH": 2}
FIELD_BITS = {"FM32": 32, "FM64": 64, "FM128": 128}
# SPU's own default fraction bits per field.
DEFAULT_FRACTION_BITS = {"FM32": 8, "FM64": 18, "FM128": 26}
# A fixed-point product holds 2 * f fraction bits before truncation, plus the integer part and
# the sign: we ask for at least this many integer bits on top of 2 * f.
MIN_INTEGER_BITS = 8
EXP_MODES = ("EXP_DEFAULT", "EXP_PADE", "EXP_TAYLOR", "EXP_PRIME")
SIGMOID_MODES = ("SIGMOID_DEFAULT", "SIGMOID_MM1", "SIGMOID_SEG3", "SIGMOID_REAL")
# Keys of SPU's RuntimeConfig JSON we interpret ourselves; any other RuntimeConfig key is
# passed through to SPU's own parser (which rejects unknown ones).
_OWN_KEYS = ("protocol", "field", "fxp_fraction_bits", "fxp_exp_mode", "sigmoid_mode")
_WRAPPER_KEYS = ("runtime_config", "parties", "world_size")


class MPCConfigError(ValueError):
    """An MPC runtime configuration is invalid; the message says what to change."""


def _enum_name(value: Any, allowed: tuple[str, ...], prefix: str, what: str) -> str:
    name = str(value).upper()
    if not name.startswith(prefix):
        name = prefix + name
    if name not in allowed:
        raise MPCConfigError(f"{what}={value!r} is unknown; use one of {allowed}")
    return name


@dataclasses.dataclass(frozen=True)
class MPCConfig:
    """protocol: ABY3 | SEMI2K | CHEETAH; parties: world size (None = the protocol's default);
    field: FM32 | FM64 | FM128; fraction_bits: fixed-point fraction bits (None = SPU's default
    for the field); exp_mode / sigmoid_mode: SPU's approximations; extra: other RuntimeConfig
    JSON keys as a sorted tuple of (key, value) pairs (kept hashable); addresses: one
    "host:port" per party for real multi-process runs (empty = in-process simulation)."""

    protocol: str = "ABY3"
    parties: int | None = None
    field: str = "FM64"
    fraction_bits: int | None = None
    exp_mode: str = "EXP_DEFAULT"
    sigmoid_mode: str = "SIGMOID_DEFAULT"
    extra: tuple = ()
    addresses: tuple = ()

    def __post_init__(self):
        protocol = str(self.protocol).upper()
        if protocol not in PROTOCOL_PARTIES:
            raise MPCConfigError(f"protocol={self.protocol!r} is unknown; use one of "
                                 f"{tuple(PROTOCOL_PARTIES)}")
        object.__setattr__(self, "protocol", protocol)
        if self.addresses and self.parties is None:
            object.__setattr__(self, "parties", len(self.addresses))
        if self.parties is None:
            object.__setattr__(self, "parties", DEFAULT_PARTIES[protocol])
        if self.parties not in PROTOCOL_PARTIES[protocol]:
            allowed = PROTOCOL_PARTIES[protocol]
            want = str(allowed[0]) if len(allowed) == 1 else f"{allowed[0]} to {allowed[-1]}"
            raise MPCConfigError(f"{protocol} runs with {want} parties, got {self.parties}; "
                                 "change the party count (or the protocol)")
        if self.addresses and len(self.addresses) != self.parties:
            raise MPCConfigError(f"{len(self.addresses)} party addresses given for "
                                 f"{self.parties} parties; list exactly one address per party")
        field = str(self.field).upper()
        if field not in FIELD_BITS:
            raise MPCConfigError(f"field={self.field!r} is unknown; use one of {tuple(FIELD_BITS)}")
        object.__setattr__(self, "field", field)
        if self.fraction_bits is None:
            object.__setattr__(self, "fraction_bits", DEFAULT_FRACTION_BITS[field])
        f = self.fraction_bits
        if not isinstance(f, int) or isinstance(f, bool) or f <= 0:
            raise MPCConfigError(f"fraction_bits={f!r} must be a positive integer")
        need = 2 * f + MIN_INTEGER_BITS
        if need > FIELD_BITS[field]:
            wider = [n for n, b in FIELD_BITS.items() if b >= need]
            raise MPCConfigError(
                f"field {field} ({FIELD_BITS[field]} bits) is too small for {f} fraction bits: a "
                f"fixed-point product needs 2 x {f} + {MIN_INTEGER_BITS} = {need} bits; lower "
                f"fraction_bits to <= {(FIELD_BITS[field] - MIN_INTEGER_BITS) // 2} or use "
                f"{' / '.join(wider) or 'a wider field'}")
        object.__setattr__(self, "exp_mode", _enum_name(self.exp_mode, EXP_MODES, "EXP_", "exp_mode"))
        object.__setattr__(self, "sigmoid_mode",
                           _enum_name(self.sigmoid_mode, SIGMOID_MODES, "SIGMOID_", "sigmoid_mode"))
        extra = dict(self.extra)
        clash = sorted(set(extra) & set(_OWN_KEYS))
        if clash:
            raise MPCConfigError(f"extra runtime keys {clash} duplicate fields of MPCConfig")
        object.__setattr__(self, "extra", tuple(sorted(extra.items())))
        object.__setattr__(self, "addresses", tuple(self.addresses))
        self.runtime_config()  # SPU's parser sees the passed-through keys now, not at run time

    # ----- conversions -----------------------------------------------------------------------
    def runtime_json(self, profile: bool = False) -> dict:
        """The SPU RuntimeConfig as a JSON-able dict (profiling switched on with `profile`)."""
        out = {"protocol": self.protocol, "field": self.field,
               "fxp_fraction_bits": self.fraction_bits}
        if self.exp_mode != "EXP_DEFAULT":
            out["fxp_exp_mode"] = self.exp_mode
        if self.sigmoid_mode != "SIGMOID_DEFAULT":
            out["sigmoid_mode"] = self.sigmoid_mode
        out.update(dict(self.extra))
        if profile:
            out["enable_pphlo_profile"] = True
            out["enable_hal_profile"] = True
        return out

    def runtime_config(self, profile: bool = False):
        """A `spu.RuntimeConfig` (SPU is imported only here and in the backends)."""
        import spu.libspu as libspu
        cfg = libspu.RuntimeConfig()
        text = json.dumps(self.runtime_json(profile))
        if not cfg.ParseFromJsonString(text):
            raise MPCConfigError(f"SPU rejected the runtime config {text}: a key or enum value "
                                 "is not part of SPU 0.9.5's RuntimeConfig (check the spelling)")
        return cfg

    def replace(self, **changes) -> "MPCConfig":
        return dataclasses.replace(self, **changes)

    @property
    def label(self) -> str:
        return f"{self.protocol}-{self.parties}pc-{self.field}-f{self.fraction_bits}"


def from_json(source: str | os.PathLike | dict, **overrides) -> MPCConfig:
    """MPCConfig from a JSON file path, JSON text or dict: SPU RuntimeConfig keys, optionally
    wrapped as {"runtime_config": {...}, "parties": [addresses] | "world_size": n}.
    `overrides` (non-None flag values) replace fields after parsing."""
    if isinstance(source, dict):
        data = dict(source)
    else:
        text = str(source)
        if not text.lstrip().startswith("{"):
            if not os.path.exists(text):
                raise FileNotFoundError(f"runtime config file {text!r} does not exist")
            with open(text) as f:
                text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise MPCConfigError(f"runtime config is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise MPCConfigError("runtime config JSON must be an object")
    addresses, world = (), None
    if "runtime_config" in data:
        unknown = sorted(set(data) - set(_WRAPPER_KEYS))
        if unknown:
            raise MPCConfigError(f"unknown top-level keys {unknown}; a wrapped config has "
                                 f"{_WRAPPER_KEYS}")
        parties = data.get("parties", ())
        if isinstance(parties, int):
            world = parties
        else:
            addresses = tuple(parties)
        world = data.get("world_size", world)
        data = dict(data["runtime_config"])
    fields = {"protocol": data.pop("protocol", "ABY3"), "field": data.pop("field", "FM64"),
              "fraction_bits": data.pop("fxp_fraction_bits", None),
              "exp_mode": data.pop("fxp_exp_mode", "EXP_DEFAULT"),
              "sigmoid_mode": data.pop("sigmoid_mode", "SIGMOID_DEFAULT"),
              "parties": world, "addresses": addresses, "extra": tuple(sorted(data.items()))}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return MPCConfig(**fields)
