"""One 3-party loopback run of a small decode job, for comparing the link's cost with and
without the parties' fronts (run it in two checkouts; results: docs/results.md "The front door"):

    python -m experiments.front_cost OUTPUT_DIR [SHAPE|-] [JOB_JSON]
    # SHAPE: link.shape (e.g. lan); JOB_JSON: job overrides, e.g. '{"model": "llama2-d1024",
    # "seq_len": 1024, "max_new_tokens": 4, "prefill": "clear", "timeout_s": 1800}'

The job: llama-tiny, 2 layers, a 32-token random prompt, `full`, 8 greedy tokens (7 decode
steps), ABY3, free loopback ports. Prints one JSON line: the tokens and, per decode step, the
wall seconds, the bytes and the messages every party's SPU profile counted.
"""
from __future__ import annotations

import json
import pathlib
import sys


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3, 4):
        print("usage: python -m experiments.front_cost OUTPUT_DIR [SHAPE|-] [JOB_JSON]",
              file=sys.stderr)
        return 2
    shape = argv[2] if len(argv) >= 3 and argv[2] != "-" else None
    if shape is not None and shape[:1] == "{":
        shape = json.loads(shape)
    overrides = json.loads(argv[3]) if len(argv) == 4 else {}
    from experiments.faults import harness
    from runtime.distributed.launch import free_ports, run_loopback
    out = pathlib.Path(argv[1])
    job = dict(harness.TINY_JOB, policy="full", policy_options={}, budget=None, max_new_tokens=8,
               seq_len=32)
    job.update(overrides)
    raw = harness.node_config(3, "ABY3", free_ports(3), job=job,
                         **({"shape": shape} if shape is not None else {}))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "nodes.json"
    path.write_text(json.dumps(raw))
    records = run_loopback(path, out / "run")
    steps = [r for r in records if r.get("phase") == "decode"]
    print(json.dumps({"tokens": records[-1]["tokens"],
                      "wall_s": [r["wall_s"] for r in steps],
                      "comm_bytes": [r["comm_bytes"] for r in steps],
                      "messages": [r["messages"] for r in steps]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
