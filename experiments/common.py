"""Helpers shared by experiments: result files and provenance (git commit, flag values)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
from typing import Any, Iterable

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The repo's HEAD commit (with '+dirty' when the work tree has changes), or 'unknown'."""
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
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_jsonl(path: str | os.PathLike, records: Iterable[dict], append: bool = False) -> None:
    with open(path, "a" if append else "w") as f:
        for record in records:
            f.write(json.dumps(record, default=_json_default) + "\n")


def _json_default(value):
    import numpy as np
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
