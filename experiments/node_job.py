"""`--backend=spu_nodes`, for every experiment: the node config's job, the flags that override
it, the check before any party starts, and the run (every party a local process).

One rule for every job field: the node config decides; a flag given on the command line or in
a flagfile overrides its field; a flag's default never does. The run prints the job and the
fields flags overrode.

    job field        flag
    model            --model
    num_layers       --num_layers
    policy           --policies        accuracy / mpc_cost: one job per entry; generate: one
    budget           --budgets         accuracy / mpc_cost: one job per entry; generate: one
    seq_len          --seq_lens        accuracy / mpc_cost: one job per entry; generate: the
                                       length of --prompt / --prompt_file when given
    max_new_tokens   --max_new_tokens
    seed             --seed            (random weights)
    chat             --chat            (generate: how a prompt text is wrapped)
    the prompt       --prompt / --prompt_file (generate): a text that goes to the prompt
                     owner's party only; without them the job's prompt_ids or seq_len random ids

Every job of the run is checked before the first party starts, with the checks every party
runs (`runtime.distributed.config.check_job_bounds`: the model's context, the policy's
check_prompt at the prompt's length, memory): an impossible job is one `error:` line naming
the flag (or the job field) and what would work, exit 2. A job that fails while the parties
run is one `error:` line naming the party and the cause, exit 3 (128 + N when signal N
stopped the run); never a traceback.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import pathlib
import re
import sys
import tempfile

# Job field -> the flag that overrides it.
FIELD_FLAGS = {"model": "model", "num_layers": "num_layers", "policy": "policies",
               "budget": "budgets", "seq_len": "seq_lens", "max_new_tokens": "max_new_tokens",
               "seed": "seed", "chat": "chat"}
# Fields the job line shows (with the config's prompt, seed and chat as they are).
SHOWN = ("model", "num_layers", "policy", "budget", "seq_len", "max_new_tokens")


@dataclasses.dataclass
class Plan:
    """The jobs of one run, every one checked: `jobs` the overrides of each (in run order),
    `names` how a message names each field a flag set (field -> '--flag' or a function of the
    value), `prompt_text` / `prompt_flag` a prompt text for the prompt owner, `tokenizer`
    the one that counted it."""
    config: object
    jobs: list[dict]
    names: dict
    prompt_text: str | None = None
    prompt_flag: str | None = None
    tokenizer: object = None


def name_flags(message: str, names: dict) -> str:
    """`message` with each job field a flag set named as that flag: 'job.budget=0.01' ->
    '--budgets=0.01' (names[field] is '--flag', or a function of the value or None)."""
    if not names:
        return message
    pattern = re.compile(r"\bjob\.(" + "|".join(map(re.escape, names)) + r")\b(=[^\s,;:)]+)?")

    def sub(match):
        name, value = names[match.group(1)], match.group(2)
        value = value[1:].strip("'\"") if value else None
        if callable(name):
            return name(value)
        return f"{name}={value}" if value is not None else name
    return pattern.sub(sub, message)


def _budget(text: str):
    from experiments.options import parse_budget
    return parse_budget(text)



def plan_jobs(FLAGS) -> Plan:
    """The run's jobs from the node config and the flags given, each checked as the parties
    will check it; raises ValueError (exit 2) naming the flag or job field."""
    from mpcache_jax.primitives import budget_record
    from runtime.distributed.config import NodeConfigError, load_node_config
    if not FLAGS.node_config:
        raise ValueError("--backend=spu_nodes needs --node_config=FILE (see experiments/nodes/*.json)")
    generate = FLAGS.experiment == "generate"
    given = lambda flag: FLAGS[flag].present  # noqa: E731
    config = load_node_config(FLAGS.node_config, check_job=False)
    if generate and given("protocol") and FLAGS.protocol.upper() != config.protocol:
        raise ValueError(f"--protocol={FLAGS.protocol} conflicts with --node_config="
                         f"{FLAGS.node_config}, which runs {config.protocol}: the node config "
                         "decides the protocol (and the number of parties); drop --protocol "
                         "or pick a config that runs it")
    names = {field: f"--{flag}" for field, flag in FIELD_FLAGS.items() if given(flag)}
    fixed = {field: getattr(FLAGS, FIELD_FLAGS[field]) for field in
             ("model", "num_layers", "max_new_tokens", "seed", "chat") if field in names}
    for field in ("policy", "budget", "seq_len"):
        if field in names and not getattr(FLAGS, FIELD_FLAGS[field]):
            raise ValueError(f"{names[field]}= names no entry; give at least one or drop it "
                             f"(the node config's job.{field} applies)")
    policies = list(FLAGS.policies) if "policy" in names else [None]
    budgets = [_budget(b) for b in FLAGS.budgets] if "budget" in names else [None]
    seq_lens = [None]
    if "seq_len" in names:
        from experiments.options import parse_numbers
        seq_lens = parse_numbers("seq_lens", FLAGS.seq_lens, int)
    if generate:
        if len(policies) != 1:
            raise ValueError("--experiment=generate runs one policy: give --policies=NAME (e.g. "
                             "mpcache, or full for no eviction), or drop it for the node "
                             "config's job.policy")
        if len(budgets) != 1:
            raise ValueError(f"--experiment=generate runs one budget; --budgets="
                             f"{','.join(FLAGS.budgets)}")

    plan = Plan(config=config, jobs=[], names=names)
    if generate and (given("prompt") or given("prompt_file")):
        if given("prompt") and given("prompt_file"):
            raise ValueError("give --prompt or --prompt_file, not both (the prompt owner's "
                             "private prompt)")
        from experiments.generate import read_prompt
        plan.prompt_flag = "--prompt_file" if given("prompt_file") else "--prompt"
        plan.prompt_text = read_prompt(FLAGS)
        flag = plan.prompt_flag
        names["seq_len"] = (lambda value: f"the {flag}'s {value} tokens" if value
                            else f"the {flag}'s length")

    for policy, budget, seq_len in itertools.product(policies, budgets, seq_lens):
        overrides = dict(fixed)
        if policy is not None:
            overrides["policy"] = policy
        name = policy or config.job.policy
        if budget is not None:
            if name == "full" and (generate or policy is None):
                where = "--policies=full" if policy else "the node config's job.policy=\"full\""
                raise ValueError(f"{where} keeps the whole cache: drop --budgets (it would be "
                                 "ignored)" + ("" if policy else ", or name a policy that "
                                               "evicts with --policies"))
            if name != "full":
                overrides["budget"] = budget_record(budget)   # a number or its text
        if seq_len is not None:
            overrides["seq_len"] = seq_len
        try:
            if plan.prompt_text is not None:
                overrides.update(prompt_overrides(plan, config, overrides, FLAGS.cache_dir))
            config.with_job(**overrides)     # every check a party runs on the job
        except NodeConfigError as err:
            raise ValueError(name_flags(str(err), names)) from None
        if overrides not in plan.jobs:
            plan.jobs.append(overrides)
    return plan


def prompt_overrides(plan: Plan, config, overrides: dict, cache_dir) -> dict:
    """The job fields a prompt text sets: seq_len = its token count (public; every party
    checks the job at it), no prompt_ids. Counted with the job model's tokenizer, as the
    prompt owner will."""
    from models import registry
    from runtime.distributed.config import JobSpec  # noqa: F401  (validates through replace)
    from runtime.distributed.job import prompt_text_ids
    job = dataclasses.replace(config.job, **overrides)
    flag = plan.prompt_flag
    if job.prefill == "clear":
        raise ValueError(f"{flag}: the node config's job.prefill=\"clear\" makes the prompt "
                         "public (a decode benchmark); a prompt text is private input: drop "
                         f"{flag} or use a config whose job.prefill is \"secure\"")
    where = "--model" if "model" in overrides else "the node config's job.model"
    if plan.tokenizer is None:
        plan.tokenizer = registry.load(job.model, num_layers=job.num_layers,
                                       cache_dir=cache_dir).tokenizer
    if plan.tokenizer is None:
        raise ValueError(f"{flag}: {where}={job.model} has no tokenizer (random weights); "
                         f"drop {flag} to run the job's own prompt (job.prompt_ids or "
                         "job.seq_len random ids), or give --model=smollm2-135m")
    ids = prompt_text_ids(job, plan.prompt_text, plan.tokenizer)
    return {"seq_len": len(ids), "prompt_ids": None}


def describe(plan: Plan, path: str) -> str:
    """One line: the config's job and the fields flags overrode (with their values)."""
    job = plan.config.job
    shown = " ".join(f"{f}={getattr(job, f)}" for f in SHOWN if getattr(job, f) is not None)
    changed = []
    for field in FIELD_FLAGS:
        values = []
        for overrides in plan.jobs:
            if field in overrides and overrides[field] not in values:
                values.append(overrides[field])
        if not values:
            continue
        text = ",".join(str(v) for v in values)
        if field == "seq_len" and plan.prompt_flag:
            source = f"the {plan.prompt_flag}'s tokens"
        else:
            source = f"--{FIELD_FLAGS[field]}"
        same = ", the config's too" if values == [getattr(job, field)] else ""
        changed.append(f"{field}={text} ({source}{same})")
    if plan.prompt_flag:
        changed.append(f"prompt ({plan.prompt_flag}, to the prompt owner "
                       f"{plan.config.prompt_owner} only)")
    return (f"node config {path}: job {shown}; "
            + (f"overridden by flags: {', '.join(changed)}" if changed
               else "no flag overrides it"))


@contextlib.contextmanager
def private_prompt(text: str | None):
    """A prompt text as a file only this user can read (gone afterwards), or None."""
    if text is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="mpcache_prompt_") as tmp:
        path = pathlib.Path(tmp) / "prompt.txt"
        path.touch(mode=0o600)
        path.write_text(text)
        yield str(path)


def run(FLAGS) -> None:
    """Check every job, then run each with every party as a local process; records append
    to OUTPUT_DIR/results.jsonl (a new temporary directory without --output_dir)."""
    from runtime.distributed.launch import Interrupted, JobFailed, run_loopback
    from runtime.distributed.party_front import AddressInUse
    plan = plan_jobs(FLAGS)
    print(describe(plan, FLAGS.node_config), flush=True)
    out = pathlib.Path(FLAGS.output_dir or tempfile.mkdtemp(prefix="mpcache_nodes_"))
    try:
        with private_prompt(plan.prompt_text) as prompt_file:
            for overrides in plan.jobs:
                records = run_loopback(FLAGS.node_config, out, prompt_file=prompt_file,
                                       **overrides)
                report(FLAGS, plan, records[-1])
    except Interrupted as err:
        print(f"error: {err.line}", file=sys.stderr, flush=True)
        sys.exit(128 + err.signum)
    except JobFailed as err:
        print(f"error: {err.line}", file=sys.stderr, flush=True)
        sys.exit(3)
    except AddressInUse as err:
        raise ValueError(str(err)) from None
    print(f"records: {out / 'results.jsonl'}")


def report(FLAGS, plan: Plan, summary: dict) -> None:
    """What one finished job prints: the answer (generate), else one line of cost."""
    if FLAGS.experiment != "generate":
        print(f"{summary['policy']} budget={summary.get('budget')} prompt="
              f"{summary['prompt_tokens']} tokens={summary['tokens']} decode bytes/token="
              f"{summary.get('decode_comm_bytes_per_token')} s/token="
              f"{summary.get('decode_wall_s_per_token')}")
        return
    tokenizer = plan.tokenizer
    if tokenizer is None:
        from models import registry
        tokenizer = registry.load(summary["model"], num_layers=summary.get("num_layers"),
                                  cache_dir=FLAGS.cache_dir).tokenizer
    if tokenizer is not None:
        print(f"answer: {tokenizer.decode(summary['tokens'])}")
    else:
        print(f"answer (token ids; {summary['model']} has no tokenizer): {summary['tokens']}")
    if "decode_comm_bytes_per_token" in summary:
        print(f"per generated token: {summary['decode_comm_bytes_per_token'] / 1e6:.1f} MB, "
              f"{summary['decode_messages_per_token']:.0f} messages, "
              f"{summary['decode_wall_s_per_token']:.2f} s (measured, real parties)")
