"""The bounds a job must stay within, checked before any party starts and again by every
party at the announced prompt length: the model's context, the policy (it must build and
serve the prompt; an error names the smallest budget that would) and one party's memory
(estimate_party_memory, against the machine's or the job's limit).
"""
from __future__ import annotations

import math
import os
from typing import Any

import jax

from mpcache_jax.policies import make_policy
from mpcache_jax.primitives import budget_label
from models import registry
from models.config import ConfigError
from models.model import Model
from runtime.distributed.options import JobSpec, NodeConfigError
from runtime.mpc.config import MPCConfig

# Bytes of one field element, and field elements one party holds per secret value.
FIELD_BYTES = {"FM32": 4, "FM64": 8, "FM128": 16}
SHARES_PER_PARTY = {"ABY3": 2, "SEMI2K": 1, "CHEETAH": 1}
# Python + JAX + SPU + compiled programs of one party process, before any data.
RUNTIME_BASE_BYTES = 1 << 30
# Temporaries of the largest prefill operation, in multiples of its output.
TEMPORARY_FACTOR = 4


def estimate_party_memory(job: JobSpec, mpc: MPCConfig, prompt_len: int | None = None
                          ) -> tuple[int, str]:
    """Peak memory one party needs for `job`, estimated -> (bytes, the formula with numbers).

        bytes = 1 GiB + b * (P + 2*T*V + 2*L*Hkv*d*(T+N) + 4*max(H*T*(T+N), T*F))
        job.prefill="clear": 1 GiB + b * (P + 2*L*Hkv*d*(T+N) + 4*max(H*(T+N), F))
                             + 4 B * (P + T*V + 4*max(H*T*(T+N), T*F))

    b: bytes of one party's share of one element (field bytes x shares per party: ABY3 2,
    SEMI2K/CHEETAH 1); P: weights (secret-shared once, resident all session); T*V: the
    prompt's secret one-hot rows [T, V] (x2: the prompt owner also holds the shares it sends);
    2*L*Hkv*d*(T+N): the KV cache of L layers (resident between steps); H*T*(T+N): one layer's
    prefill attention scores, T*F its MLP activations, x4 for an operation's temporaries;
    1 GiB: the Python/JAX/SPU process. T = seq_len (or the announced prompt length), N =
    max_new_tokens. With a clear prefill the secure part is the decode step (one query row)
    and the prefill runs in float32 plaintext (the last term). An order-of-magnitude bound
    meant to refuse impossible jobs before they start, not a measurement."""
    cfg = registry.get_config(job.model, num_layers=job.num_layers)
    params = sum(int(math.prod(leaf.shape))
                 for leaf in jax.tree_util.tree_leaves(Model(cfg).param_shapes()))
    T = job.seq_len if prompt_len is None else prompt_len
    N = job.max_new_tokens
    b = FIELD_BYTES.get(mpc.field, 8) * SHARES_PER_PARTY.get(mpc.protocol, 2)
    cache = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (T + N)
    prefill_largest = max(cfg.num_heads * T * (T + N), T * cfg.intermediate_size)
    if job.prefill == "clear":
        largest = max(cfg.num_heads * (T + N), cfg.intermediate_size)
        clear = params + T * cfg.vocab_size + TEMPORARY_FACTOR * prefill_largest
        total = RUNTIME_BASE_BYTES + b * (params + cache + TEMPORARY_FACTOR * largest) + 4 * clear
        return total, (f"1 GiB + {b} B x (P {params:,} + KV cache {cache:,} + 4 x {largest:,}) "
                       f"+ 4 B x (clear prefill {clear:,}) with T={T}, N={N}")
    elements = params + 2 * T * cfg.vocab_size + cache + TEMPORARY_FACTOR * prefill_largest
    total = RUNTIME_BASE_BYTES + b * elements
    formula = (f"1 GiB + {b} B x (P {params:,} + 2*T*V {2 * T * cfg.vocab_size:,} + KV cache "
               f"{cache:,} + 4 x {prefill_largest:,}) with T={T}, N={N}")
    return total, formula


def memory_limit_bytes(config) -> tuple[int, str]:
    """(the most one party of a NodeConfig may need, where the limit comes from)."""
    if config.job.memory_limit_gb is not None:
        return int(config.job.memory_limit_gb * 2**30), "job.memory_limit_gb"
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 16 << 30
    n = config.parties_on_this_host
    return int(0.8 * physical / n), (f"80% of this machine's {physical / 2**30:.1f} GiB shared "
                                     f"by {n} part{'y' if n == 1 else 'ies'}")


def frozen(value):
    """JSON lists -> tuples, so policy options stay hashable (policies are static jit args)."""
    return tuple(frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


_JOB_BUDGET = object()


def make_job_policy(job: JobSpec, budget: Any = _JOB_BUDGET):
    """The job's configured policy (with `budget` in place of job.budget when given)."""
    options = {k: frozen(v) for k, v in job.policy_options.items()}
    return make_policy(job.policy, job.budget if budget is _JOB_BUDGET else budget, **options)


def _serves(job: JobSpec, budget, prompt_len: int) -> bool:
    try:
        make_job_policy(job, budget).check_prompt(prompt_len)
    except (TypeError, ValueError, LookupError, AttributeError):
        return False
    return True


def ratio_for(tokens: int, prompt_len: int) -> float:
    """The shortest (then smallest) decimal ratio of the prompt that budgets exactly `tokens`
    of a `prompt_len`-token prompt (`primitives.budget_tokens`)."""
    from mpcache_jax.primitives import budget_tokens
    for digits in range(1, 16):
        step = 10.0 ** -digits
        value = round((math.floor((tokens - 1) / prompt_len / step) + 1) * step, digits)
        if 0 < value <= 1 and budget_tokens(value, prompt_len) == tokens:
            return value
    return tokens / prompt_len


def smallest_budget(job: JobSpec, prompt_len: int, ratio: bool) -> tuple[Any, int] | None:
    """The smallest budget with which the job's policy serves a `prompt_len`-token prompt (its
    own check_prompt) -> (budget, tokens it keeps), or None when even the whole prompt does
    not. `ratio`: as a ratio of the prompt (`ratio_for`), else a token count. A binary search
    over the token count: a policy that serves a budget serves every larger one (the
    registry's policies all do; tests/test_node_job.py checks it against a scan)."""
    def value(k: int):
        return ratio_for(k, prompt_len) if ratio else k

    if not _serves(job, value(prompt_len), prompt_len):
        return None
    low, high = 1, prompt_len          # invariant: value(high) serves
    while low < high:
        mid = (low + high) // 2
        if _serves(job, value(mid), prompt_len):
            high = mid
        else:
            low = mid + 1
    return value(high), high


def check_policy_serves(job: JobSpec, prompt_len: int) -> None:
    """The job's policy must build with its budget and options and serve a `prompt_len`-token
    prompt (its check_prompt, the check the parties' programs run); the error names the
    smallest budget that would."""
    try:
        policy = make_job_policy(job)
    except (TypeError, ValueError, LookupError, AttributeError) as err:
        raise NodeConfigError(f"job.policy={job.policy!r} with job.budget={job.budget!r} and "
                              f"job.policy_options={job.policy_options}: {err}") from None
    try:
        policy.check_prompt(prompt_len)
    except ValueError as err:
        ratio = job.budget is None or isinstance(job.budget, float)
        fit = smallest_budget(job, prompt_len, ratio)
        given = (f"job.budget={budget_label(job.budget)}" if job.budget is not None else
                 f"job.budget (unset: {job.policy}'s default {policy.budget})")
        options = f" and job.policy_options={job.policy_options}" if job.policy_options else ""
        if fit is None:
            raise NodeConfigError(
                f"{given}: {err}; no budget lets job.policy={job.policy!r}{options} serve "
                f"the job's prompt (job.seq_len={prompt_len}): use a longer prompt or another "
                "policy") from None
        count = (f"; or job.budget={fit[1]}, a token count" if isinstance(fit[0], float)
                 and fit[1] > 1 else "")
        raise NodeConfigError(
            f"{given}: {err}; the smallest budget that serves the job's {prompt_len}-token "
            f"prompt is job.budget={budget_label(fit[0])} ({fit[1]} tokens{count})") from None


def check_job_bounds(config, prompt_len: int | None = None) -> None:
    """A NodeConfig's job must fit the model (prompt + new tokens <= the model's context), its
    policy must build and serve the prompt's length (`check_policy_serves`: the policy's own
    check_prompt, as the parties' programs run it), and one party's estimated memory must stay
    under the limit (`memory_limit_bytes`). The prompt's length: `prompt_len` when announced,
    else job.seq_len."""
    job = config.job
    try:
        cfg = registry.get_config(job.model, num_layers=job.num_layers)
    except ConfigError as err:
        raise NodeConfigError(f"job.num_layers: {err}") from None
    T = job.seq_len if prompt_len is None else prompt_len
    if T + job.max_new_tokens > cfg.max_position:
        raise NodeConfigError(
            f"job.seq_len={T} + job.max_new_tokens={job.max_new_tokens} = "
            f"{T + job.max_new_tokens} exceeds {job.model}'s context of {cfg.max_position} "
            f"tokens; make them add up to at most {cfg.max_position}")
    check_policy_serves(job, T)
    need, formula = estimate_party_memory(job, config.mpc, prompt_len)
    limit, source = memory_limit_bytes(config)
    if need > limit:
        raise NodeConfigError(
            f"the job needs about {need / 2**30:.1f} GiB per party ({formula}), over the limit "
            f"of {limit / 2**30:.1f} GiB ({source}); shorten job.seq_len / job.max_new_tokens, "
            "use fewer job.num_layers, or raise job.memory_limit_gb if the machine has the memory")

