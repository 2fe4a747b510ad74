"""Helpers shared by experiments: result files and provenance (git commit, flag values)."""
from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
from typing import Any, Iterable

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def git_commit() -> str:
    """The repo's HEAD commit (with '+dirty' when the work tree has changes), or 'unknown'.
    Read once per process (experiments.run reads it at start), so a long run's records name
    the code it started with, not whatever was committed while it ran."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def flag_values(FLAGS) -> dict[str, Any]:
    """Every flag defined by experiments.run, as a plain dict (recorded with each result)."""
    return {flag.name: flag.value
            for flag in FLAGS.get_flags_for_module("experiments.flags_def")}


def with_model_numerics(loaded, FLAGS):
    """Apply the model-numerics flags (`--activation_impl`) to a registry.LoadedModel: same
    weights, the model's configuration changed (the accuracy harness measures their effect)."""
    from models.model import Model
    impl = getattr(FLAGS, "activation_impl", "exact")
    if impl != loaded.model.cfg.activation_impl:
        loaded.model = Model(loaded.model.cfg.replace(activation_impl=impl))
    return loaded


def ensure_dir(path: str | os.PathLike) -> pathlib.Path:
    """`path` as a directory this process can write into (created when missing); a ValueError
    saying what is wrong otherwise, so a run fails before it starts rather than at its end."""
    out = pathlib.Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir={str(path)!r} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"--output_dir={str(path)!r} cannot be written ({err.strerror})") from None
    return out


def replace_file(path: str | os.PathLike, write) -> None:
    """Write a file atomically: `write(tmp_path)` then rename over `path`, so a reader (or a run
    that fails half-way) never sees a half-written or mixed file."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def config_hash(values: dict[str, Any]) -> str:
    """A short stable hash of settings (JSON, sorted keys)."""
    import hashlib
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_jsonl(path: str | os.PathLike, records: Iterable[dict], append: bool = False) -> None:
    """Append `records` to `path`, or replace it atomically (`replace_file`)."""
    def write(target, mode):
        with open(target, mode) as f:
            for record in records:
                f.write(json.dumps(record, default=_json_default) + "\n")
    if append:
        write(path, "a")
    else:
        replace_file(path, lambda tmp: write(tmp, "w"))


def _json_default(value):
    import numpy as np
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def resident_mb() -> float:
    """This process's resident memory now (MB), NaN where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError):
        return float("nan")


def available_mb() -> float:
    """Memory the system can give this process now without swapping (MemAvailable, MB); 8 GB
    where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1e3
    except (OSError, ValueError):
        pass
    return 8000.0


def reset_peak_rss() -> None:
    """Start a new peak-memory window: Linux resets the process's high-water mark (VmHWM) to
    its current resident memory when 5 is written to /proc/self/clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """The most resident memory (MB) since the last `reset_peak_rss` (or the process start),
    NaN where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1e3
    except (OSError, ValueError):
        pass
    return float("nan")

