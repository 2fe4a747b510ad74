"""One party of a multi-host secure run: `mpcache party --node_config=FILE --party=ID`.

The same command as `python -m runtime.distributed.party_main` (the runtime's entry point of a
party, which the launcher and supervisor start), under the name the docs use.
Run the same command with each party's id on its host (see experiments/nodes/*.json for the
config format). `--party=all` starts every party of a loopback config as local processes,
waits for them and tears them down (what `experiments.run --backend=spu_nodes` does);
with `--compare_sim --policies=full,mpcache` it also runs each policy in spu_sim and prints
simulated vs multi-process cost.
Exit status: 0 success, 2 malformed config, 3 another party failed (named in the message),
128 + N stopped by signal N (SIGTERM 143, SIGINT 130; every party it started is killed, no
result), 1 anything else. The party's work runs in a supervised worker process (`--worker`, internal):
see runtime/distributed/supervise.py for why.
"""
from absl import app

from runtime.distributed.party_main import main

if __name__ == "__main__":
    app.run(main)
