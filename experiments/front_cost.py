"""What the parties' front doors cost: a 3-party loopback decode job run with this checkout
(every party behind its front) and with a checkout from before the fronts, alternating, in one
invocation; prints the ratio of wall per decode step (results: docs/results.md "The front
door").

    mpcache front-cost OUTPUT_DIR [--against=REV] [--pairs=N] [--shape=SHAPE]
                                     [--job=JSON] [--floor] [--front_py]
    mpcache front-cost OUTPUT_DIR --relay [--floor]   # per round trip, no parties

--against: a git revision without the fronts (default: the commit before them), or an earlier
one with them (its front in C, if it has one, is built from its own source for its runs); it
is checked out as a worktree under OUTPUT_DIR and run with this venv's interpreter. Without
--against (`--against=none`), one run of this checkout only. --shape: link.shape (e.g. lan).
--job: overrides of the job, e.g. '{"model": "llama2-d1024", "seq_len": 1024,
"max_new_tokens": 4, "prefill": "clear", "timeout_s": 1800}'. --floor: a third run in each
pair, every front replaced by experiments/bare_relay.c (a relay in C that forwards bytes and
checks nothing; run_loopback's `front_program`): what the relay hop costs by itself, the floor
of any front in its own process.
--front_py: one more run per pair with front.py serving every party (by default plain-TCP
runs get the front in C, runtime/distributed/fast_front.c, where scripts/setup.sh built it).
--relay: no parties; one front's CPU and wall per relayed request + reply at three frame sizes,
front.py's and the front in C's (with --floor, the bare relay's beside them).

The job: llama-tiny, 2 layers, a 32-token random prompt, `full`, 8 greedy tokens (7 decode
steps), ABY3, fresh loopback ports per run. Runs alternate (baseline, [bare,] front,
baseline, ...) so that the shared machine's load drifts over all alike. Per run: median wall per decode step,
bytes and messages per step (every party's SPU profile), tokens, the parties' CPU per step;
with the fronts, each front's CPU seconds per decode step (from the parties' logs). Writes
OUTPUT_DIR/front_cost.jsonl (one line per run) and prints the per-pair ratios and their
medians.
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from absl import flags

from experiments import cli

REPO = pathlib.Path(__file__).resolve().parents[1]
# The last commit before the fronts (the next one, 3b9b205, adds runtime/distributed/front.py).
BEFORE_FRONTS = "30b4e43"

# Run by the interpreter in a checkout's folder: the loopback launcher of that checkout (the
# package moved from mpcache_jax.distributed to runtime.distributed after the fronts came).
RUNNER = """
import json, sys
try:
    from runtime.distributed.launch import run_loopback
except ImportError:
    from mpcache_jax.distributed.launch import run_loopback
# A third argument (this checkout only): the program every party starts in its front's place.
extra = {"front_program": sys.argv[3]} if len(sys.argv) > 3 else {}
records = run_loopback(sys.argv[1], sys.argv[2], **extra)
steps = [r for r in records if r.get("phase") == "decode"]
print(json.dumps({"tokens": records[-1]["tokens"], "wall_s": [r["wall_s"] for r in steps],
                  "comm_bytes": [r["comm_bytes"] for r in steps],
                  "messages": [r["messages"] for r in steps],
                  "party_cpu_s": [sum(r["party_cpu_s"]) / len(r["party_cpu_s"])
                                  for r in steps if r.get("party_cpu_s")]}))
"""
def front_cpu_per_step(run_dir: pathlib.Path) -> list[float]:
    """Per party log, the median CPU seconds its front spent per decode step ([] without
    fronts)."""
    from runtime.distributed.party_front import front_steps
    out = []
    for log in sorted(run_dir.glob("party_*.log")):
        cpu = [step["cpu_s"] for step in front_steps(log.read_text())
               if step["phase"] == "decode"]
        if cpu:
            out.append(statistics.median(cpu))
    return out


def run_once(checkout: pathlib.Path, out: pathlib.Path, job: dict, shape,
             env: dict | None = None, front_program: pathlib.Path | None = None) -> dict:
    """One loopback run of `job` with the launcher of `checkout` (and `env` added to its
    environment; `front_program` in every front's place: run_loopback's hook, this checkout
    only) -> its record."""
    from experiments.faults import harness
    from runtime.distributed.launch import free_ports
    out.mkdir(parents=True, exist_ok=True)
    raw = harness.node_config(3, "ABY3", free_ports(3), job=job,
                              **({"shape": shape} if shape is not None else {}))
    nodes = out / "nodes.json"
    nodes.write_text(json.dumps(raw))
    program = [str(front_program)] if front_program else []
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(nodes), str(out / "run"), *program],
                          cwd=checkout, capture_output=True, text=True,
                          env={**_env(), **(env or {}), "PYTHONPATH": str(checkout)})
    if proc.returncode != 0:
        raise SystemExit(f"the run in {checkout} failed (exit {proc.returncode}); its parties' "
                         f"logs are in {out / 'run'}:\n{proc.stderr[-2000:]}")
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    record["median_step_s"] = statistics.median(record["wall_s"])
    record["front_cpu_s"] = front_cpu_per_step(out / "run")
    return record


def _env() -> dict:
    import os
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def baseline_checkout(rev: str, out: pathlib.Path) -> pathlib.Path:
    path = out / f"baseline_{rev}"
    if not path.exists():
        made = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path),
                               rev], capture_output=True, text=True)
        if made.returncode != 0:
            raise SystemExit(f"--against={rev}: cannot check it out as a worktree of {REPO} "
                             f"({made.stderr.strip()[-300:]}); give a revision of this "
                             "repository, or --against=none")
    return path


def baseline_fast_front(checkout: pathlib.Path, out: pathlib.Path) -> dict:
    """The environment that gives a baseline checkout its own front in C: built from its
    fast_front.c into OUTPUT_DIR (with the .sha256 its front.py checks), so that it does not
    fall back to its front.py because the installed build is this checkout's; {} when it has
    none (before the front in C) or cannot be built."""
    import hashlib
    source = checkout / "runtime" / "distributed" / "fast_front.c"
    if not source.exists():
        return {}
    binary = out / f"fast_front_{checkout.name}"
    made = subprocess.run(["cc", "-O2", "-pthread", "-o", str(binary), str(source),
                           "-lcrypto"], capture_output=True, text=True)
    if made.returncode != 0:
        print(f"the baseline's front in C was not built ({made.stderr[-300:]}); it runs its "
              "front.py", file=sys.stderr)
        return {}
    pathlib.Path(f"{binary}.sha256").write_text(
        hashlib.sha256(source.read_bytes()).hexdigest() + "\n")
    return {"MPCACHE_FAST_FRONT": str(binary)}


def build_bare_relay(out: pathlib.Path) -> pathlib.Path:
    """Compile experiments/bare_relay.c into OUTPUT_DIR (cc and OpenSSL's libcrypto)."""
    source = REPO / "experiments" / "bare_relay.c"
    out.mkdir(parents=True, exist_ok=True)
    binary = out / "bare_relay"
    made = subprocess.run(["cc", "-O2", "-o", str(binary), str(source), "-lcrypto"],
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"--floor: cannot build {source} with cc -lcrypto (needs a C compiler "
                         f"and OpenSSL's headers, Debian's libssl-dev): {made.stderr[-500:]}")
    return binary


def relay_cost(out: pathlib.Path, value_bytes: int, rounds: int, relay: str = "front.py",
               binary: pathlib.Path | None = None) -> dict:
    """One front in plain TCP (`relay`: "front.py", "fast_front" or "bare", the last two
    built at `binary`) between a client that sends a Push of `value_bytes` and waits for a
    40-byte reply, and a stand-in brpc that replies to each whole frame: the front's CPU and
    the wall per relayed request + reply; for front.py also its checks alone (parse_frame +
    check_push, timed in this process)."""
    import socket
    import threading
    import timeit
    from experiments.faults.forge import forge_frame, start_test_front
    from runtime.distributed.frames import parse_frame
    from runtime.distributed.launch import free_ports
    from runtime.distributed.rules import ConnLedger, UnfinishedBook, check_push
    out.mkdir(parents=True, exist_ok=True)
    proc, spec, backend, _ = start_test_front(
        out, free_ports(1)[0], max_message_bytes=max(value_bytes, 1 << 20),
        fast_front=binary if relay == "fast_front" else None)
    if relay == "bare":
        proc.kill()
        proc.wait()
        proc = subprocess.Popen([str(binary), spec.to_json()], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        json.loads(proc.stdout.readline())
    backend.shutdown(socket.SHUT_RDWR)    # wakes its accepting thread
    backend.close()     # replaced by one that answers each frame
    os.unlink(spec.backend_path)
    answering = socket.socket(socket.AF_UNIX)
    answering.bind(spec.backend_path)
    answering.listen()
    frames = [forge_frame(0, b"test.3pc.run:P2P-%d:0->1" % i, b"x" * value_bytes, seq=i)
              for i in range(1, rounds + 2)]

    def answer():
        conn, _ = answering.accept()
        got, whole = 0, len(frames[0])
        while data := conn.recv(1 << 20):
            got += len(data)
            while got >= whole:
                got -= whole
                conn.sendall(b"r" * 40)
    threading.Thread(target=answer, daemon=True).start()
    client = socket.create_connection(("127.0.0.1", spec.listen_port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stats():
        proc.stdin.write(b"stats\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    def round_trip(frame):
        client.sendall(frame)
        got = 0
        while got < 40:
            got += len(client.recv(100))
    round_trip(frames[0])
    before, start = stats(), time.perf_counter()
    for frame in frames[1:]:
        round_trip(frame)
    wall, after = time.perf_counter() - start, stats()
    proc.kill()
    proc.wait()
    answering.close()
    result = {"relay": relay, "value_bytes": value_bytes,
              "rounds": rounds,
              "cpu_us_per_round_trip": round((after["cpu_s"] - before["cpu_s"]) / rounds * 1e6, 1),
              "wall_us_per_round_trip": round(wall / rounds * 1e6, 1)}
    if relay == "front.py":
        book, conn = UnfinishedBook(spec.max_buffered_bytes, 2), ConnLedger()

        def check():
            push = parse_frame(frames[1], spec.max_frame_bytes)
            check_push(push, bound_rank=0, my_rank=1, link_id=b"test.3pc.run",
                             max_message_bytes=spec.max_message_bytes, book=book, conn=conn)
        result["checks_us_per_frame"] = round(
            min(timeit.repeat(check, number=2000, repeat=5)) / 2000 * 1e6, 1)
    return result


# --relay: (value bytes, round trips) of the microbenchmark; 1 MiB is the link's largest chunk.
RELAY_SIZES = ((200, 5000), (60_000, 2000), (1 << 20, 500))


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("against", BEFORE_FRONTS, "git revision without the fronts, or 'none' "
                        "for one run", flag_values=fv)
    flags.DEFINE_integer("pairs", 5, "runs per arm", flag_values=fv)
    flags.DEFINE_string("shape", None, "link.shape: lan, wan or a JSON object", flag_values=fv)
    flags.DEFINE_string("job", "{}", "JSON overrides of the job", flag_values=fv)
    flags.DEFINE_bool("floor", False, "a third run per pair: every front replaced by a relay "
                      "with no checks (experiments/bare_relay.c, built here with cc), the cost "
                      "of the relay hop alone", flag_values=fv)
    flags.DEFINE_bool("front_py", False, "one more run per pair: every front front.py "
                      "(MPCACHE_FAST_FRONT=off), where the default is the front in C when it "
                      "is built", flag_values=fv)
    flags.DEFINE_bool("relay", False, "instead (no parties): one front's CPU and wall per "
                      "relayed request + reply at three frame sizes, front.py's and the front "
                      "in C's; with --floor the bare relay's too", flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    args = _flags()
    (output_dir,) = cli.parse(args, argv, __doc__, positional=("OUTPUT_DIR",))
    if args.pairs < 1:
        cli.usage_error("--pairs must be >= 1")
    shape = json.loads(args.shape) if args.shape and args.shape[:1] == "{" else args.shape
    try:
        overrides = json.loads(args.job)
    except json.JSONDecodeError as err:
        cli.usage_error(f"--job is not valid JSON ({err})")
    from experiments.faults import harness
    job = dict(harness.TINY_JOB, policy="full", policy_options={}, budget=None, max_new_tokens=8,
               seq_len=32)
    job.update(overrides)
    out = pathlib.Path(output_dir).resolve()     # the runs start in each checkout's folder
    out.mkdir(parents=True, exist_ok=True)
    if args.relay:
        from experiments.faults.forge import build_fast_front
        from runtime.distributed.fast_front import FAST_FRONT_NAME
        relays = [("front.py", None)]
        fast = out / FAST_FRONT_NAME
        why = build_fast_front(fast)
        if why:
            print(f"the front in C is not measured: {why}", file=sys.stderr)
        else:
            relays.append(("fast_front", fast))
        if args.floor:
            relays.append(("bare", build_bare_relay(out)))
        for value_bytes, rounds in RELAY_SIZES:
            for relay, binary in relays:
                print(json.dumps(relay_cost(out / "relay", value_bytes, rounds, relay, binary)),
                      flush=True)
        return 0
    if args.against == "none":
        print(json.dumps(run_once(REPO, out / "front_0", job, shape)))
        return 0
    base = baseline_checkout(args.against, out)
    # (label, checkout, environment, program in every front's place)
    arms = [("before", base, baseline_fast_front(base, out), None), ("front", REPO, {}, None)]
    if args.front_py:
        from runtime.distributed.fast_front import FAST_FRONT_ENV
        arms.append(("front.py", REPO, {FAST_FRONT_ENV: "off"}, None))
    if args.floor:
        arms.insert(1, ("bare", REPO, {}, build_bare_relay(out)))
    ratios: dict[str, list[float]] = {label: [] for label, *_ in arms[1:]}
    with open(out / "front_cost.jsonl", "w") as results:
        for i in range(args.pairs):
            pair = {}
            for label, checkout, env, program in arms:
                record = run_once(checkout, out / f"{label}_{i}", job, shape, env, program)
                pair[label] = record
                results.write(json.dumps({"pair": i, "run": label, **record}) + "\n")
                results.flush()
            before = pair["before"]
            parts = [f"pair {i}: before {before['median_step_s']:.3f} s/step"]
            for label in ratios:
                run = pair[label]
                same = (before["tokens"] == run["tokens"]
                        and before["comm_bytes"] == run["comm_bytes"]
                        and before["messages"] == run["messages"])
                ratio = run["median_step_s"] / before["median_step_s"]
                ratios[label].append(ratio)
                cpu = statistics.mean(run["front_cpu_s"]) if run["front_cpu_s"] else float("nan")
                party = {k: statistics.median(r["party_cpu_s"]) if r["party_cpu_s"]
                         else float("nan") for k, r in (("before", before), (label, run))}
                parts.append(f"{label} {run['median_step_s']:.3f} s/step ({ratio:.3f}x; CPU per "
                             f"step and party: {label} {cpu:.3f} s, party {party['before']:.3f} "
                             f"-> {party[label]:.3f} s; tokens, bytes, messages "
                             f"{'identical' if same else 'DIFFER'})")
                if not same:
                    print(f"  before: {before}\n  {label}: {run}", file=sys.stderr)
            print("; ".join(parts), flush=True)
    step = pair["front"]
    for label, values in ratios.items():
        print(f"median ratio ({label} / before) over {len(values)} pairs: "
              f"{statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f})")
    print(f"{step['comm_bytes'][-1]:,} bytes / {step['messages'][-1]:,} messages per step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
