"""Entry point: `python -m experiments.run --flagfile=experiments/flags/NAME.flags [--flag=value ...]`."""
from __future__ import annotations

import sys

from absl import app

from experiments import flags_def  # noqa: F401  (defines the flags)
from experiments.flags_def import FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.experiment == "generate":
        from experiments import generate
        return generate.run(FLAGS)
    if FLAGS.experiment == "accuracy":
        from experiments import accuracy
        return accuracy.run(FLAGS)
    raise app.UsageError(f"unknown experiment {FLAGS.experiment!r}")


def entry():
    try:
        app.run(main)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    entry()
