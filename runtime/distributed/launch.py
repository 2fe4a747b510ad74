"""Loopback launcher: every party of a node config as a local process, run, collect, tear down.

    records = run_loopback("experiments/nodes/3pc_aby3.json", output_dir="results/nodes",
                           policy="full")

Each party is `python -m runtime.distributed.party_main --node_config=... --party=ID` with
its own log file; the job succeeds only if every party exits 0 and the prompt owner wrote its
record. On any failure the remaining parties get max(`link.peer_timeout_s`,
`link.connect_timeout_s`) (+ a grace period) to exit on their own, then are killed; the raised
`JobFailed` names the failing party (from the parties' own diagnoses) and quotes each party's
last message.

No child outlives the launcher: every party's process group is killed when the call returns or
raises, when the launcher gets SIGTERM, SIGINT or SIGHUP (`Interrupted`, no result), and —
should the launcher itself be killed outright — each party's supervisor and worker die with
their parent (Linux PR_SET_PDEATHSIG, set by `process.bind_to_parent` in the child) before it
could report anything.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from runtime.distributed.config import (NodeConfig, NodeConfigError, is_loopback,
                                        load_node_config, parse_node_config)
from runtime.distributed.party_front import check_own_port
from runtime.distributed.process import child_env, node_tag

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# After the first party fails, the others get peer_timeout_s + this long to notice and exit
# (probes run once a second, each waits up to 2 s).
GRACE_S = 10.0

# The runtime's own entry point of a party (a module of this package, run with -m).
PARTY_MAIN = "runtime.distributed.party_main"
INTERRUPT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class JobFailed(RuntimeError):
    """A multi-party job failed; `party` is the party the others blame (None if unknown).
    str(): the head, one line per party and the logs; `line`: all of it that a command line
    prints, on one line (the failed party, the cause, every exit status, the logs)."""

    def __init__(self, message: str, party: str | None, exit_codes: dict[str, int | None],
                 line: str | None = None):
        super().__init__(message)
        self.party, self.exit_codes = party, exit_codes
        self.line = line if line is not None else message.splitlines()[0]


class Interrupted(JobFailed):
    """The launcher got a terminating signal; every party was killed, nothing is reported."""

    def __init__(self, signum: int):
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}: every party was stopped; no result", None, {})
        self.signum = signum


@contextlib.contextmanager
def interruptible():
    """While active (main thread only), SIGTERM / SIGINT / SIGHUP raise Interrupted, so the
    caller's cleanup (killing the parties) runs instead of the process ending on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    fired: list[int] = []

    def handler(signum, frame):
        if not fired:             # later signals must not interrupt the cleanup itself
            fired.append(signum)
            raise Interrupted(signum)
    previous = {sig: signal.signal(sig, handler) for sig in INTERRUPT_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports free on 127.0.0.1 right now."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def prepare_config(node_config: str | os.PathLike, output_dir: pathlib.Path,
                   use_free_ports: bool = False, **job_overrides) -> tuple[NodeConfig, pathlib.Path]:
    """Validate `node_config` (+ job overrides) for loopback and write the effective config to
    `output_dir/node_config.json` (TLS paths made absolute) — the file every party reads."""
    source = pathlib.Path(node_config)
    # The file must be valid on its own; its job is checked with the overrides applied.
    for warning in load_node_config(source, check_job=False).warnings:
        print(f"[party all] warning: {warning}", file=sys.stderr, flush=True)
    raw = json.loads(source.read_text())
    raw.setdefault("job", {}).update(job_overrides)
    for pid, address in raw["nodes"].items():
        host = address.rpartition(":")[0]
        if not is_loopback(host):
            raise NodeConfigError(f"nodes[{pid!r}]={address!r} is not a loopback address: the "
                                  "loopback launcher starts every party on this machine; on "
                                  "several hosts start each party on its own host")
    if use_free_ports:
        for pid, port in zip(list(raw["nodes"]), free_ports(len(raw["nodes"]))):
            raw["nodes"][pid] = f"127.0.0.1:{port}"
    spu_dev = next(d for d in raw["devices"].values() if d.get("kind") == "SPU")
    tls = spu_dev["config"].get("link", {}).get("tls")
    if tls:
        def absolute(p):
            return p if os.path.isabs(p) else str((source.parent / p).resolve())
        tls["ca"] = absolute(tls["ca"])
        for entry in tls["certs"].values():
            entry["cert"], entry["key"] = absolute(entry["cert"]), absolute(entry["key"])
    config = parse_node_config(raw, base_dir=source.parent)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "node_config.json"
    path.write_text(json.dumps(raw, indent=2))
    return config, path


def _last_line(path: pathlib.Path, marker: str) -> str:
    try:
        lines = [l for l in path.read_text(errors="replace").splitlines() if marker in l]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _kill(proc: subprocess.Popen) -> None:
    """Kill a party's whole process group (supervisor and worker), even if one already ended."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def start_parties(config: NodeConfig, config_path: pathlib.Path, output_dir: pathlib.Path,
                  env: dict | None = None, prompt_file: str | None = None,
                  procs: dict[str, subprocess.Popen] | None = None,
                  front_program: str | None = None) -> dict[str, subprocess.Popen]:
    """Start one PARTY_MAIN process per party (own session, so it can be killed with its
    children; bound to this process, see process.bind_to_parent); stdout+stderr go to
    output_dir/party_<id>.log. `prompt_file` goes to the prompt owner only; `front_program`
    (benchmarks only: party_front.start_front's `program`) to every party. Each process is
    added to `procs` (when given) as soon as it exists, so a caller's cleanup sees it even if
    a signal interrupts this call; if starting one fails, the ones already started are killed
    before the error propagates."""
    procs = {} if procs is None else procs
    try:
        for pid in config.party_ids:
            own = ([f"--prompt_file={prompt_file}"] if prompt_file and pid == config.prompt_owner
                   else []) + ([f"--front_program={front_program}"] if front_program else [])
            with open(output_dir / f"party_{node_tag(pid)}.log", "w") as logf:
                procs[pid] = subprocess.Popen(
                    [sys.executable, "-m", PARTY_MAIN, f"--node_config={config_path}",
                     f"--party={pid}", f"--output_dir={output_dir}", *own],
                    cwd=REPO_ROOT, stdout=logf, stderr=subprocess.STDOUT,
                    start_new_session=True, env=child_env(env))
    except BaseException:
        for p in procs.values():
            _kill(p)
        raise
    return procs


def wait_parties(config: NodeConfig, procs: dict[str, subprocess.Popen],
                 output_dir: pathlib.Path, timeout_s: float) -> None:
    """Wait for every party; raise JobFailed (after tearing the rest down) unless all exit 0."""
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    try:
        while any(p.poll() is None for p in procs.values()):
            now = time.monotonic()
            if first_failure is None and any(p.poll() not in (None, 0) for p in procs.values()):
                first_failure = now
            late = first_failure is not None and (
                now - first_failure > max(config.link.peer_timeout_s,
                                          config.link.connect_timeout_s) + GRACE_S)
            if now > deadline or late:
                break
            time.sleep(0.05)
    finally:
        timed_out = [pid for pid, p in procs.items() if p.poll() is None]
        for p in procs.values():
            _kill(p)
    codes = {pid: p.returncode for pid, p in procs.items()}
    if all(c == 0 for c in codes.values()):
        return
    messages = {pid: _last_line(output_dir / f"party_{node_tag(pid)}.log", "] error: ")
                for pid in procs}
    # The party the others blame ("party X ... died ..."), else the first that failed; none
    # when a party stopped because a forger claimed a peer's rank (the others then see it go).
    forged = [pid for pid, m in messages.items() if "dropped a forged message" in m]
    blamed = [] if forged else [
        pid for pid in config.party_ids
        if any(f"party {pid} " in m for other, m in messages.items() if other != pid)]
    # Otherwise the first party that failed by itself (not killed by us, not blaming a peer).
    culprit = blamed[0] if blamed else next((pid for pid in config.party_ids
                                             if pid not in timed_out and codes[pid] not in (0, 3)),
                                            None)
    lines = [f"  {pid}: exit {codes[pid] if pid not in timed_out else 'killed (still running)'}"
             f"{' - ' + messages[pid] if messages[pid] else ''}" for pid in config.party_ids]
    if forged:
        culprit = None
    head = (f"secure job failed: party {culprit} failed" if culprit
            else f"secure job failed: {forged[0]} got a forged message" if forged
            else "secure job failed")
    if timed_out and not first_failure:
        head += f" (no result within job.timeout_s={timeout_s:g} s)"
    raise JobFailed(head + "\n" + "\n".join(lines) + f"\n  logs: {output_dir}", culprit, codes,
                    line=one_line(config, head, culprit, messages, codes, timed_out, output_dir))


def one_line(config: NodeConfig, head: str, culprit: str | None, messages: dict[str, str],
             codes: dict[str, int | None], timed_out: list[str], output_dir) -> str:
    """A failed job on one line: the head (naming the failed party), the cause (that party's
    own last error, else the first other party's: it names the failed one), each party's exit
    status, the logs."""
    def bare(message: str) -> str:
        return message.split("] error: ", 1)[-1].strip()
    own = messages.get(culprit, "") if culprit else ""
    others = [(pid, messages[pid]) for pid in config.party_ids if messages[pid] and pid != culprit]
    if own:
        cause = bare(own)
    elif others:
        cause = f"{others[0][0]} says: {bare(others[0][1])}"
    else:
        cause = "no party said why"
    exits = ", ".join(f"{pid} {'killed' if pid in timed_out else codes[pid]}"
                      for pid in config.party_ids)
    return f"{head}: {cause} (exit: {exits}; logs: {output_dir})"


def run_loopback(node_config: str | os.PathLike, output_dir: str | os.PathLike | None = None,
                 use_free_ports: bool = False, prompt_file: str | None = None,
                 front_program: str | None = None, **job_overrides) -> list[dict]:
    """Run a node config's job with every party as a local process -> the prompt owner's new
    records (one per generation step, then the summary).

    `job_overrides` replace keys of the config's "job" (policy=..., seq_len=..., budget=...).
    Raises NodeConfigError before starting anything if the config is malformed, JobFailed if
    any party fails (no partial result is returned), Interrupted (a JobFailed) on SIGTERM,
    SIGINT or SIGHUP. Every party is killed before this returns or raises. `front_program`:
    benchmarks only (start_parties).
    """
    out = pathlib.Path(output_dir or tempfile.mkdtemp(prefix="mpcache_nodes_"))
    config, path = prepare_config(node_config, out, use_free_ports, **job_overrides)
    for pid in config.party_ids:
        check_own_port(config, pid)       # AddressInUse before any party starts
    results = out / "results.jsonl"
    before = results.read_text().splitlines() if results.exists() else []
    procs: dict[str, subprocess.Popen] = {}
    with interruptible():
        try:
            start_parties(config, path, out, prompt_file=prompt_file, procs=procs,
                          front_program=front_program)
            wait_parties(config, procs, out, config.job.timeout_s)
        finally:
            for p in procs.values():
                _kill(p)
    after = results.read_text().splitlines() if results.exists() else []
    new = [json.loads(line) for line in after[len(before):]]
    if not new or not new[-1].get("summary"):
        raise JobFailed(f"all parties exited 0 but the prompt owner wrote no summary record to "
                        f"{results}", config.prompt_owner, {})
    return new
