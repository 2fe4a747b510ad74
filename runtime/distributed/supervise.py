"""Party supervisor: runs the party's worker process and explains how it ended.

yacl's link layer ends the whole process (exit status 255, no Python exception) when an
asynchronous send to a vanished peer exhausts its retries, so a party cannot always report a
dead peer itself. A party's process (party_main) therefore runs the party as a worker child
and supervises it: a worker that dies without its own diagnosis is explained from the link errors
in its SPU log (which name the peer's address), a worker that outlives `job.timeout_s` is
killed, and a worker killed by SIGKILL is reported as the likely out-of-memory kill it is.
Either way the party exits non-zero with one `error:` line naming the failed party.
SIGTERM / SIGINT / SIGHUP to the supervisor kill the worker first (exit 128 + signal), and the
worker dies with the supervisor should it be killed outright (process.bind_to_parent).
"""
from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import time

from runtime.distributed.blame import blame, failing_peer
from runtime.distributed.bounds import estimate_party_memory
from runtime.distributed.config import NodeConfig
from runtime.distributed.launch import Interrupted, interruptible
from runtime.distributed.party import spu_log_path
from runtime.distributed.party_front import front_events_path
from runtime.distributed.process import (EXIT_CONFIG, EXIT_OK, EXIT_PEER, PRIVATE_DIR_ENV,
                                         child_env, make_private_dir, remove_private_dir)

_LINK_ERROR = re.compile(r"\[(error|warning)\]|failed|timeout|Not connected", re.IGNORECASE)


def blame_from_log(config: NodeConfig, party_id: str, log_path: pathlib.Path) -> str | None:
    """The peer named by the last link error in this party's SPU log (address, rank=N or a->b)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    others = [(pid, addr) for pid, addr in config.parties if pid != party_id]
    for line in reversed(lines[-400:]):
        if not _LINK_ERROR.search(line):
            continue
        for pid, addr in others:
            if re.search(re.escape(addr) + r"(?!\d)", line):
                return pid

        class _Err(Exception):
            pass
        peer = failing_peer(config, config.rank(party_id), _Err(line))
        if peer is not None and peer != party_id:
            return peer
    return None


def supervise(config: NodeConfig, party_id: str, output_dir: str, worker_cmd: list[str]) -> int:
    """Run `worker_cmd` (sharing this process's stdout/stderr); return the party's exit status."""
    deadline = time.monotonic() + config.job.timeout_s
    worker = None
    interrupted = None
    # The worker's private directory (its brpc's and front's Unix sockets, mode 0700).
    private_dir = make_private_dir(party_id)
    with interruptible():
        try:
            worker = subprocess.Popen(worker_cmd, env=child_env({PRIVATE_DIR_ENV: private_dir}))
            while worker.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        except Interrupted as err:
            interrupted = err
        finally:
            timed_out = worker is not None and worker.poll() is None
            if timed_out:
                worker.kill()
            if worker is not None:
                worker.wait()
            remove_private_dir(private_dir)
    if interrupted is not None:
        report(party_id, f"stopped by {signal.Signals(interrupted.signum).name}; the worker "
                         "was killed, no result")
        return 128 + interrupted.signum
    code = worker.returncode
    if timed_out:
        report(party_id, f"no result within job.timeout_s={config.job.timeout_s:g} s; "
                         "the worker was stopped")
        return EXIT_PEER
    if code in (EXIT_OK, EXIT_CONFIG, EXIT_PEER, 1):
        return code  # the worker reported for itself
    if code == -signal.SIGKILL:
        # yacl ends a process with status 255, never with SIGKILL; on Linux an unexplained
        # SIGKILL is almost always the kernel's out-of-memory killer.
        need, _ = estimate_party_memory(config.job, config.mpc)
        report(party_id, f"this party's worker was killed by SIGKILL, most likely by the "
                         f"kernel's out-of-memory killer (see `dmesg`); the job's estimate was "
                         f"{need / 2**30:.1f} GiB per party and {config.parties_on_this_host} "
                         f"part{'y runs' if config.parties_on_this_host == 1 else 'ies run'} on "
                         "this host: shorten job.seq_len, run the parties on separate hosts, "
                         "or, for a decode benchmark, set job.prefill=\"clear\"")
        return 1
    log_path = spu_log_path(output_dir, party_id)
    culprit, why = blame(config, party_id, blame_from_log(config, party_id, log_path),
                         front_events_path(output_dir, party_id))
    report(party_id, f"{why}; the link layer ended this party's worker (status {code}, "
                     f"see {log_path})")
    return EXIT_PEER


def report(party_id: str, message: str) -> None:
    print(f"[party {party_id}] error: {message}", file=sys.stderr, flush=True)
