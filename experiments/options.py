"""Flag values turned into typed ones, shared by every experiment: budgets, number lists, the
policies to run (--policies and --variants). Plain values in, values or one-line errors out:
nothing here reads FLAGS."""
from __future__ import annotations

import json

from mpcache_jax import primitives as P
from mpcache_jax.policies import make_policy
from mpcache_jax.primitives import Budget

# (label, registered name, options): one policy to run, under the label its records carry
Variant = tuple[str, str, dict]


def parse_budget(text: str) -> float | int | Budget:
    """'0.1' -> ratio 0.1 of the prompt; '128' -> 128 tokens; '0.1min384' -> 10% of the
    prompt, at least 384 tokens (`primitives.Budget`)."""
    try:
        return P.parse_budget(text)
    except ValueError as err:
        raise ValueError(f"--budgets entry: {err}") from None


def parse_numbers(flag: str, values: list[str], kind) -> list:
    """A list flag's entries as `kind` (int or float); a ValueError naming --flag otherwise."""
    try:
        return [kind(v) for v in values]
    except ValueError:
        what = "whole number" if kind is int else "number"
        raise ValueError(f"--{flag}={','.join(values)}: every entry must be a {what}") from None


def parse_variants(policies: list[str], variants: str | None) -> list[Variant]:
    """Every policy to evaluate: the registered names of --policies, then the labelled entries
    of --variants (a JSON object {"label": {"policy": NAME, option: value, ...}})."""
    out = [(name, name, {}) for name in policies]
    if not variants:
        return out
    try:
        extra = json.loads(variants)
    except json.JSONDecodeError as err:
        raise SystemExit(f"--variants is not valid JSON ({err}); expected "
                         '{"label": {"policy": "mpcache", "alpha": 0.5}, ...}')
    if not isinstance(extra, dict):
        raise SystemExit('--variants must be a JSON object: {"label": {"policy": NAME, ...}}')
    for label, spec in extra.items():
        if not isinstance(spec, dict):
            raise SystemExit(f"--variants entry {label!r} must be an object such as "
                             '{"policy": "mpcache", "refresh_every": 4}')
        spec = dict(spec)
        if "policy" not in spec:
            raise SystemExit(f"--variants entry {label!r} needs a 'policy' field")
        if "budget" in spec:
            raise SystemExit(f"--variants entry {label!r} sets 'budget'; budgets come from "
                             "--budgets (each variant runs at every one): drop it from the "
                             "entry")
        name = spec.pop("policy")
        if "levels" in spec:  # JSON lists -> hashable tuples
            spec["levels"] = tuple((s, k) for s, k in spec["levels"])
        out.append((label, name, spec))
    return out


def build_policies(variants: list[Variant], budgets: list[float | int | Budget]):
    """[(label, budget, policy)] for every variant at every budget (`full` once, at 1.0),
    constructed, so a bad option fails before any model work starts."""
    out = []
    for label, name, options in variants:
        if name == "full":
            out.append((label, 1.0, make_policy("full")))
            continue
        for budget in budgets:
            out.append((label, budget, make_policy(name, budget, **options)))
    return out
