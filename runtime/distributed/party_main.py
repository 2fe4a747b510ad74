"""A party's entry point: `python -m runtime.distributed.party_main --node_config=FILE
--party=ID` on each party's host (`--party=all`: every party of a loopback config as local
processes, as `--backend=spu_nodes` runs do; `--compare_sim`: also each policy in spu_sim).
Exit status: 0 success, 2 malformed config, 3 another party failed (named in the message),
128 + N stopped by signal N (SIGTERM 143, SIGINT 130; every party it started is killed, no
result), 1 anything else. The party's work runs in a supervised worker process (`--worker`,
internal): see supervise.py for why.
"""
from __future__ import annotations

import json
import sys
import traceback

from absl import app, flags

flags.DEFINE_string("node_config", None, "Node config JSON (experiments/nodes/*.json).")
flags.DEFINE_string("party", None, "This party's node id (a key of 'nodes'), or 'all' for loopback.")
flags.DEFINE_string("output_dir", "results/nodes", "SPU logs, results.jsonl, outputs.npz.")
flags.DEFINE_string("job", None, 'JSON overrides of the config\'s "job" (with --party=all), '
                    'e.g. \'{"policy": "full"}\'.')
flags.DEFINE_list("policies", None, "With --party=all: run the job once per policy (default: "
                  "the config's policy).")
flags.DEFINE_bool("compare_sim", False, "With --party=all: also run each policy in spu_sim and "
                  "print simulated vs multi-process cost (compare.py).")
flags.DEFINE_string("prompt_file", None, "The prompt owner's private prompt (text; wrapped in "
                    "the model's chat template when job.chat). Default: the job's prompt_ids or "
                    "job.seq_len random ids.")
flags.DEFINE_bool("worker", False, "Internal: run the party itself (the default supervises it).")
flags.DEFINE_string("front_program", None, "Benchmarks only: a program started in each front's "
                    "place (party_front.start_front); refused under TLS and with remote peers.")
flags.mark_flags_as_required(["node_config", "party"])
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    who = FLAGS.party
    try:
        from runtime.distributed.process import (EXIT_CONFIG, EXIT_PEER, PartyFailure,
                                                 bind_to_parent, exit_now)
        bind_to_parent()   # started by a launcher or supervisor: never outlive it
        from runtime.distributed.config import (DuplicateKeyError, NodeConfigError,
                                                load_node_config, loads_strict)
        from runtime.distributed.launch import (PARTY_MAIN, Interrupted, JobFailed,
                                                run_loopback)
        from runtime.distributed.party import run_party
        from runtime.distributed.party_front import AddressInUse, check_own_port
        from runtime.distributed.supervise import supervise
    except Exception as err:  # noqa: BLE001 - a broken install must still say why
        traceback.print_exc()
        print(f"[party {who}] error: cannot import the launcher: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    try:
        if who == "all":
            try:
                overrides = loads_strict(FLAGS.job) if FLAGS.job else {}
            except (json.JSONDecodeError, DuplicateKeyError) as err:
                raise NodeConfigError(f"--job is not valid JSON: {err}") from None
            if not isinstance(overrides, dict):
                raise NodeConfigError(f"--job must be a JSON object, e.g. '{{\"policy\": "
                                      f"\"full\"}}', got {FLAGS.job!r}")
            if FLAGS.compare_sim:
                from runtime.distributed.compare import compare_backends
                policies = FLAGS.policies or [load_node_config(FLAGS.node_config).job.policy]
                compare_backends(FLAGS.node_config, policies, FLAGS.output_dir, **overrides)
                return 0
            for policy in FLAGS.policies or [None]:
                job = {**overrides, **({"policy": policy} if policy else {})}
                records = run_loopback(FLAGS.node_config, FLAGS.output_dir,
                                       prompt_file=FLAGS.prompt_file,
                                       front_program=FLAGS.front_program, **job)
                print(json.dumps(records[-1]))
            return 0
        config = load_node_config(FLAGS.node_config, party=who)
        if not FLAGS.worker:
            for warning in config.warnings:
                print(f"[party {who}] warning: {warning}", file=sys.stderr, flush=True)
        if FLAGS.job:
            raise NodeConfigError("--job overrides are for --party=all only: every party must "
                                  "read the same job, so edit the node config instead")
        if not FLAGS.worker:
            check_own_port(config, who)
            own = ([f"--prompt_file={FLAGS.prompt_file}"] if FLAGS.prompt_file else []) + (
                [f"--front_program={FLAGS.front_program}"] if FLAGS.front_program else [])
            sys.exit(supervise(config, who, FLAGS.output_dir,
                               [sys.executable, "-m", PARTY_MAIN, "--worker",
                                f"--node_config={FLAGS.node_config}", f"--party={who}",
                                f"--output_dir={FLAGS.output_dir}", *own]))
        record = run_party(config, who, FLAGS.output_dir, prompt_file=FLAGS.prompt_file,
                           front_program=FLAGS.front_program)
        if record is not None:
            print(json.dumps(record))
        # Leave now: the link's send threads may still retry a last acknowledgement to a peer
        # that has already exited, and yacl ends the process (status 255) when that fails.
        sys.stdout.flush()
        sys.stderr.flush()
        exit_now(0)
    except NodeConfigError as err:
        print(f"[party {who}] error: bad node config: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    except AddressInUse as err:
        print(f"[party {who}] error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    except Interrupted as err:
        print(f"[party {who}] error: {err}", file=sys.stderr, flush=True)
        sys.exit(128 + err.signum)
    except (PartyFailure, JobFailed) as err:
        print(f"[party {who}] error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_PEER)
    except Exception as err:  # noqa: BLE001 - a party must always exit non-zero with a reason
        traceback.print_exc()
        print(f"[party {who}] error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
