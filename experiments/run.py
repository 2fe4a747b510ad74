"""An experiment from flags: `mpcache run --flagfile=experiments/flags/NAME.flags [--flag=value ...]`
(the same as `python -m experiments.run ...`). --experiment picks generate, accuracy or mpc_cost
(`mpcache generate|accuracy|cost` set it); --backend=spu_nodes runs a node config's job."""
from __future__ import annotations

import sys

from absl import app

from experiments import flags_def  # noqa: F401  (defines the flags)
from experiments.flags_def import FLAGS


def quiet_libraries() -> None:
    """Library INFO logs (orbax, absl, jax) only with --verbose; warnings always."""
    import logging
    from absl import logging as absl_logging
    if not FLAGS.verbose:
        absl_logging.set_verbosity(absl_logging.WARNING)
        logging.getLogger().setLevel(logging.WARNING)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    quiet_libraries()
    if FLAGS.compile_cache:
        from runtime import compile_cache
        compile_cache.enable(FLAGS.cache_dir)
    from experiments.common import git_commit
    git_commit()   # the code this run starts with, named in every record
    from models.gguf_store import GGUFIntegrityError
    try:
        return dispatch()
    except (ValueError, FileNotFoundError, GGUFIntegrityError) as err:
        # Bad flags, configs or files (a GGUF that fails its pinned hash included): say what
        # is wrong without a traceback.
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def check_flags() -> None:
    """Every flag given is read by the experiment that runs (flags_def.EXPERIMENT_FLAGS)."""
    nodes = FLAGS.backend == "spu_nodes"
    key = (("generate_nodes" if FLAGS.experiment == "generate" else "nodes") if nodes
           else FLAGS.experiment)
    unused = flags_def.flags_not_used(key)
    if unused:
        what = ("--backend=spu_nodes (the node config's job decides the rest)" if nodes
                else f"--experiment={FLAGS.experiment}")
        given = ", ".join(f"--{name}" for name in unused)
        raise ValueError(f"{given} {'is' if len(unused) == 1 else 'are'} not used by {what}; "
                         "remove it (it would be ignored, yet recorded as if it applied)")


def dispatch():
    check_flags()
    if FLAGS.backend == "spu_nodes":
        # Every experiment's node-config runs take one path: the config's job with the flags
        # given as overrides, checked before any party starts (exit 2), a failed job one line
        # (exit 3).
        from experiments import node_job
        return node_job.run(FLAGS)
    if FLAGS.experiment == "generate":
        from experiments import generate
        return generate.run(FLAGS)
    if FLAGS.experiment == "accuracy":
        from experiments import accuracy
        return accuracy.run(FLAGS)
    if FLAGS.experiment == "mpc_cost":
        from experiments import mpc_cost
        return mpc_cost.run(FLAGS)
    raise app.UsageError(f"unknown experiment {FLAGS.experiment!r}")


def entry():
    try:
        app.run(main)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    entry()
