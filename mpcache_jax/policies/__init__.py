"""Policy registry: name -> configured policy. The CLI, tests and benchmarks enumerate it.

    policy = make_policy("mpcache", budget=0.1, alpha=0.5)
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

from mpcache_jax import primitives as P
from mpcache_jax.policy import FULL, AttentionPolicy, NoCache
from mpcache_jax.policies import eviction, retrieval
from mpcache_jax.policies.base import DecodeEvictionPolicy, PromptEvictionPolicy, StreamingLLM
from mpcache_jax.policies.mpcache import MPCache
from mpcache_jax.policies.quest import PageSelectionPolicy
from mpcache_jax.policies.working_set import WorkingSetMPCache

# The authors' hyperparameters (their LongBench setting): per-layer token-level static eviction
# voted by the last 20% of prompt queries, 32(0.5) -> 16 clusters scored by the alpha bound per
# KV head, every other layer reusing the previous one's selection (from layer 2 on). A coarse
# level keeps its ratio and what the finer level needs, nothing more (oversample off).
MPCACHE_PAPER = {"static": True, "levels": ((32, 0.5), (16, None)), "similarity": "alpha",
                 "select_scope": "head", "share_group": 2, "topk_method": "lax", "oversample": 0}

# name -> (policy class, fixed settings that define the variant). Baseline modules export
# their own REGISTRY dicts (one line per configured policy) that are merged in below.
_REGISTRY: dict[str, tuple[Callable[..., AttentionPolicy], dict]] = {
    "full": (AttentionPolicy, {}),
    "no_cache": (NoCache, {}),
    "streaming_llm": (StreamingLLM, {}),
    # The cost floor of any selection: attention to exactly the budgeted prompt tokens, chosen
    # publicly and for free (StreamingLLM's positional choice, no secure computation). Costed
    # beside the others by the MPC benchmarks; its outputs are streaming_llm's.
    "oracle": (StreamingLLM, {}),
    # our default: working_set.py (docs/design.md, docs/results.md "The default")
    "mpcache": (WorkingSetMPCache, {}),
    # every-step hierarchical selection over the whole cache (mpcache.py): full's tokens far
    # more often, at full's compute under MPC
    "mpcache_exact": (MPCache, {}),
    "mpcache_paper": (MPCache, MPCACHE_PAPER),
    # Figure 11 ablation ladder on the authors' setting: full -> static -> +dynamic (token
    # level) -> +cluster (MP bound) -> +linearize/reorder (alpha bound) -> +layer sharing
    # (= mpcache_paper).
    "mpcache_static": (MPCache, {**MPCACHE_PAPER, "dynamic": False}),
    "mpcache_dynamic": (MPCache, {**MPCACHE_PAPER, "levels": ((1, None),), "share_group": 1}),
    "mpcache_cluster": (MPCache, {**MPCACHE_PAPER, "similarity": "mp", "share_group": 1}),
    "mpcache_linear": (MPCache, {**MPCACHE_PAPER, "share_group": 1}),
}
for _module in (eviction, retrieval):
    _clash = set(_REGISTRY) & set(_module.REGISTRY)
    if _clash:
        raise ImportError(f"{_module.__name__} registers names already taken: {sorted(_clash)}")
    _REGISTRY.update(_module.REGISTRY)
POLICY_NAMES = tuple(_REGISTRY)
# The budget the default is shipped, measured and costed with (README, mpc_long.flags): 10% of
# the prompt, at least 384 tokens (a ratio alone starves prompts of 2k tokens; docs/design.md
# "The budget rule"). A generation given a policy and no --budgets uses it.
DEFAULT_BUDGET = P.Budget(0.1, 384)


def make_policy(name: str, budget: float | int | P.Budget | str | None = None,
                **overrides) -> AttentionPolicy:
    """A configured policy. `budget` (a ratio of the prompt, a token count, a `Budget` or its
    text such as '0.1min384') is ignored by `full`."""
    if isinstance(budget, str):
        budget = P.parse_budget(budget)
    cls, fixed = policy_class(name), _REGISTRY[name][1]
    if cls is AttentionPolicy:
        if set(overrides) - {"softmax"}:
            raise ValueError(f"policy 'full' takes only the 'softmax' option, got {sorted(overrides)}")
        return dataclasses.replace(FULL, **overrides) if overrides else FULL
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"policy {name!r} has no option(s) {unknown}; options: {sorted(fields)}")
    settings = {"name": name, **fixed, **overrides}
    if budget is not None and "budget" in fields:
        settings["budget"] = budget
    return cls(**settings)


# The policy families, most specific first: a policy belongs to the first one in its MRO and
# writes only that family's HOOKS (docs/guide.md "Adding a policy").
FAMILIES = (WorkingSetMPCache, MPCache, PageSelectionPolicy, DecodeEvictionPolicy,
            PromptEvictionPolicy)


def policy_class(name: str) -> type:
    """The class a registered name builds."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; registered policies: {', '.join(POLICY_NAMES)}")
    return _REGISTRY[name][0]


def policy_family(cls: type) -> type | None:
    """The family base of a policy class (the first of FAMILIES in its MRO), or None for the
    general seam itself (`full`, `no_cache`)."""
    return next((base for base in cls.__mro__ if base in FAMILIES), None)


def seam_violations(cls: type) -> list[str]:
    """What a policy class does outside its family's seam: a method of the family's shared
    machinery that it (or a class between it and the family base) redefines, or a required
    hook that none of them writes. [] for a class that keeps to the seam."""
    family = policy_family(cls)
    if family is None or family is cls:
        return []
    own = cls.__mro__[:cls.__mro__.index(family)]
    allowed = (f"writes only {', '.join(family.HOOKS)}" if family.HOOKS else
               "writes no method (its variants differ in settings)")
    out = [f"{klass.__name__}.{name} redefines {family.__name__}'s shared machinery; a "
           f"{family.__name__} {allowed}"
           for klass in own for name, value in vars(klass).items()
           if inspect.isfunction(value) and not name.startswith("__") and hasattr(family, name)
           and name not in family.HOOKS]
    out += [f"{cls.__name__} does not write {family.__name__}'s required hook {name}"
            for name in family.REQUIRED_HOOKS if not any(name in vars(k) for k in own)]
    return out


__all__ = ["POLICY_NAMES", "make_policy", "AttentionPolicy", "PromptEvictionPolicy", "MPCache",
           "WorkingSetMPCache",
           "StreamingLLM", "FULL", "FAMILIES", "policy_class", "policy_family",
           "seam_violations"]
