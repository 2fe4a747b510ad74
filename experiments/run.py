"""Entry point: `python -m experiments.run --flagfile=experiments/flags/NAME.flags [--flag=value ...]`."""
from __future__ import annotations

import sys

from absl import app

from experiments import flags_def  # noqa: F401  (defines the flags)
from experiments.flags_def import FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        return dispatch()
    except (ValueError, FileNotFoundError) as err:
        # Bad flags, configs or files: say what is wrong without a traceback.
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def dispatch():
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
