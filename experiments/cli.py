"""`mpcache <verb> [--flag=value ...]`: every command of the project on one CLI.

Flags are absl flags everywhere: `--name=value` or `--name value`, `--flag` / `--noflag` for
booleans, `--flagfile=FILE`, `--help`. `mpcache run` is `python -m experiments.run` (the flag
files of experiments/flags); `mpcache generate|accuracy|cost` are `run` with its
`--experiment` set; every other verb is a module of experiments/ (or the runtime's party entry
point), whose `python -m` form stays as an alias.

A verb module whose flags are its own (not the shared ones of experiments/flags_def.py) builds
a fresh `flags.FlagValues` per call and parses it with `parse`: nothing is left behind for the
next call in the same process (tests call several mains in one process), and two modules may
both define `--model`.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import sys

from absl import app, flags

HELP_WORDS = ("-h", "--help", "--helpshort", "--helpfull", "-?")


@dataclasses.dataclass(frozen=True)
class Verb:
    module: str                     # the module whose `main(argv)` runs it (argv[0]: program)
    summary: str
    global_flags: bool = False      # main reads absl's process-wide FLAGS (run via app.run)
    experiment: str | None = None   # a shortcut of `run` with --experiment set


VERBS: dict[str, Verb] = {
    "run": Verb("experiments.run", "an experiment from flags or a flag file "
                "(generate, accuracy, mpc_cost; --backend=spu_nodes: a node config's job)",
                global_flags=True),
    "generate": Verb("experiments.run", "generate text (run --experiment=generate)",
                     global_flags=True, experiment="generate"),
    "accuracy": Verb("experiments.run", "the fidelity harness (run --experiment=accuracy)",
                     global_flags=True, experiment="accuracy"),
    "cost": Verb("experiments.run", "the MPC cost harness (run --experiment=mpc_cost)",
                 global_flags=True, experiment="mpc_cost"),
    "party": Verb("runtime.distributed.party_main", "one party of a multi-host secure run "
                  "(--party=all: every party of a loopback config)", global_flags=True),
    "party-table": Verb("experiments.party_table", "medians of repeated multi-process runs "
                        "under a folder"),
    "pooled": Verb("experiments.pooled", "task scores of several fidelity runs pooled, "
                   "each policy's ratio to full with a paired-bootstrap interval"),
    "pareto": Verb("experiments.pareto", "the accuracy-vs-cost front from a fidelity run and "
                   "a cost run"),
    "fault-cases": Verb("experiments.fault_cases", "run the parties' fault cases"),
    "front-cost": Verb("experiments.front_cost", "what the parties' fronts cost per run"),
    "compile-time": Verb("experiments.compile_time", "trace and compile seconds of a prefill"),
    "device-check": Verb("experiments.device_check", "tokens/s, memory and CPU logits "
                         "comparison on the accelerator JAX finds"),
    "gemma-parity": Verb("experiments.gemma_parity", "Gemma 3 logits against transformers"),
    "natural-tasks": Verb("experiments.natural_tasks", "write a LongBench-format JSONL of "
                          "natural-prose samples"),
    "prefixkv-calibrate": Verb("experiments.prefixkv_calibrate", "PrefixKV's per-layer "
                               "curves for a model"),
    "vocab-coverage": Verb("experiments.vocab_coverage", "how often a vocabulary subset "
                           "holds the greedy token"),
    "kvpress-crosscheck": Verb("experiments.kvpress_crosscheck", "our prompt-eviction "
                               "baselines against NVIDIA kvpress (its own venv)",
                               global_flags=True),
}


def usage_error(message: str) -> None:
    """A bad command line: one line on stderr, exit status 2 (as absl and argparse do)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse(flag_values: flags.FlagValues, argv: list[str], doc: str | None,
          positional: tuple[str, ...] = ()) -> list[str]:
    """Parse argv (argv[0]: the program) into flag_values. --help prints the module's doc and
    flags and exits 0; an unknown flag, a bad value, a missing required flag or a wrong number
    of positional arguments is one line on stderr and exit 2. Returns the positional
    arguments (their names in `positional`)."""
    argv = list(argv) or ["mpcache"]
    if any(word in HELP_WORDS for word in argv[1:]):
        names = "".join(f" {name}" for name in positional)
        program = argv[0]
        if program.endswith(".py"):          # `python -m experiments.NAME`: argv[0] is the file
            path = pathlib.Path(program)
            program = f"python -m {path.parent.name}.{path.stem}"
        print(f"usage: {program} [flags]{names}\n")
        if doc:
            print(doc.strip() + "\n")
        print(flag_values.get_help())
        raise SystemExit(0)
    try:
        rest = flag_values(argv)[1:]
    except flags.Error as err:
        usage_error(str(err))
    if len(rest) != len(positional):
        expected = " ".join(positional) or "no positional arguments"
        usage_error(f"{argv[0]} takes {expected}; got {' '.join(rest) or 'none'}")
    return rest


def overview() -> str:
    width = max(map(len, VERBS))
    rows = "\n".join(f"  {name:<{width}}  {verb.summary}" for name, verb in VERBS.items())
    return ("usage: mpcache <verb> [--flag=value ...]     (mpcache <verb> --help: its flags)\n\n"
            f"verbs:\n{rows}")


def _global_help(program: str, module) -> None:
    """--help of a verb on absl's process-wide FLAGS: its doc and the flags the project's
    modules define (absl's own logging flags left out), exit status 0."""
    print(f"usage: {program} [flags]\n")
    if module.__doc__:
        print(module.__doc__.strip() + "\n")
    for name in sorted(flags.FLAGS.flags_by_module_dict()):
        if not name.startswith("absl."):
            print(flags.FLAGS.module_help(name) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in (*HELP_WORDS, "help"):
        print(overview())
        return 0
    name = argv[1]
    verb = VERBS.get(name)
    if verb is None:
        print(f"error: unknown verb {name!r}\n\n{overview()}", file=sys.stderr)
        return 2
    rest = argv[2:]
    if verb.experiment is not None:
        given = [w for w in rest if w.startswith("--experiment")]
        if given:
            usage_error(f"`mpcache {name}` sets --experiment={verb.experiment}; drop "
                        f"{given[0]} (or use `mpcache run`)")
        rest = [*rest, f"--experiment={verb.experiment}"]   # last: a flag file cannot undo it
    module = importlib.import_module(verb.module)
    program = f"mpcache {name}"
    if verb.global_flags:
        if any(word in HELP_WORDS for word in rest):
            _global_help(program, module)
            return 0
        # the way `python -m` runs it: app.run parses absl's FLAGS and exits with main's status
        return app.run(module.main, argv=[program, *rest])
    return module.main([program, *rest]) or 0


def entry() -> None:
    """The `mpcache` console script."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:          # `mpcache run --help | head`: the reader left
        sys.stdout = open(os.devnull, "w")
        sys.exit(0)


if __name__ == "__main__":
    entry()
