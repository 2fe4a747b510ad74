"""The accuracy run's records on disk: which sample x policy records exist, the settings they
were made with (--resume continues only a run of the same settings), and reading them back."""
from __future__ import annotations

import json

from experiments import common
from mpcache_jax.primitives import budget_record


def record_key(task: str, sample_id: str, policy: str, budget) -> tuple:
    """Identity of one sample x policy record (what --resume skips)."""
    return (task, sample_id, policy, budget_record(budget))


# Flags that only choose which records a run makes (or where and how it runs); every other
# flag can change a record, so --resume only reuses records made with the same values of those.
# Sample i of a task is the same whatever --num_samples is (each task builds its samples in
# order from the seed), so a resume with a larger --num_samples extends a run.
SCOPE_FLAGS = ("task", "policies", "variants", "budgets", "num_samples", "resume", "output_dir",
               "verbose", "policy_chunk", "mechanism", "experiment")


def record_settings(flag_values: dict) -> dict:
    """The flag values a sample record depends on (all but SCOPE_FLAGS)."""
    return {k: v for k, v in flag_values.items() if k not in SCOPE_FLAGS}


def load_finished(out, settings: dict):
    """Per-sample records of an earlier run in `out` (--resume): samples.jsonl.partial when an
    interrupted run left one, else samples.jsonl. Refuses records made with other settings."""
    path = out / "samples.jsonl.partial"
    if not path.exists():
        path = out / "samples.jsonl"
    if not path.exists():
        raise ValueError(f"--resume: no {out / 'samples.jsonl'} to resume from")
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
    wanted = common.config_hash(settings)
    foreign = [r for r in records if r.get("config_hash") != wanted]
    if foreign:
        old = json.loads((out / "run_config.json").read_text()) \
            if (out / "run_config.json").exists() else {}
        differ = sorted(k for k in settings if k in old and old[k] != settings[k])
        changes = ", ".join(f"--{k} ({old[k]!r} then, {settings[k]!r} now)" for k in differ)
        why = (f"flags that differ: {changes}" if differ
               else "they carry no or another settings hash")
        raise ValueError(f"--resume: {len(foreign)} of {len(records)} records in {path} were made "
                         f"with other settings ({why}); rerun with those settings, or into a new "
                         "--output_dir")
    print(f"resuming: {len(records)} finished sample x policy records in {path}")
    return records
