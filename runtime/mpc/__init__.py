"""Secure inference through SPU: runtime configs, backends, secure programs, cost accounting.

    from runtime import mpc
    cfg = mpc.MPCConfig(protocol="ABY3")                      # or mpc.from_json(path_or_text)
    backend = mpc.make_backend("spu_sim", cfg)                # or "xla" (plaintext)
    session = mpc.SecureSession(backend, model, params, policy)
    out = session.generate(prompt_ids, max_new_tokens=8)      # tokens + per-step RunCost
    record = mpc.cost_fields(out.steps[-1].cost, out.steps[-1].wall_s, cfg.parties)

Lower level: backend.compile(fn, args, visibility) / share / run / reveal, with the programs
of `runtime.programs` (StepPrograms, decode_fn, prefill_fn, ...); `secret_reveals(program.ir)`
lists any secret->public conversion inside a compiled program; `parse_profile_log` reads SPU's
profiling log; `LAN` / `WAN` network profiles.
"""
from runtime.mpc.backends import (BACKENDS, CLIENT, SERVER, Program, Shared, SpuSimBackend,
                                  XLABackend, make_backend)
from runtime.mpc.config import MPCConfig, MPCConfigError, from_json
from runtime.mpc.costs import LAN, WAN, NetworkProfile, cost_fields, phase_breakdown
from runtime.mpc.profile_log import RunCost, parse_profile_log
from runtime.mpc.secure import SecureGeneration, SecureSession, StepCost, secret_reveals
from runtime.programs import (PUBLIC, SECRET, StepPrograms, cache_visibility, decode_fn,
                              decode_layers_fn, dependency_visibility, forward_layers_fn,
                              head_fn, onehot, prefill_fn)

__all__ = [
    "BACKENDS", "CLIENT", "PUBLIC", "SECRET", "SERVER", "Program", "Shared", "SpuSimBackend",
    "XLABackend", "dependency_visibility", "make_backend", "MPCConfig", "MPCConfigError",
    "from_json", "LAN", "WAN", "NetworkProfile", "RunCost", "cost_fields", "parse_profile_log",
    "phase_breakdown", "SecureGeneration", "SecureSession", "StepCost", "StepPrograms",
    "cache_visibility", "decode_fn", "decode_layers_fn", "forward_layers_fn", "head_fn",
    "onehot", "prefill_fn", "secret_reveals",
]
