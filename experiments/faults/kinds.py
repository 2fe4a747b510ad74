"""The kinds of fault case and how each runs: every case has `name`, `did` (what was done),
`expected` and `run(ctx)` -> `Observed` (exit codes, the error line that explains it, time to
detect, pass/fail)."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

from experiments.faults.forge import front_answers_hello, start_test_front
from experiments.faults.harness import REPO, error_line, kill_all, log_text, node_config, processes_mentioning, start_party, wait_for_log

# ----- cases -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Observed:
    exit_codes: str
    error: str
    detect_s: float | None
    passed: bool
    note: str = ""
    detect_from: str = ""


@dataclasses.dataclass
class Context:
    """Where a case keeps its files, and the free ports it may use; `fast_front`: a build of
    runtime/distributed/fast_front.c (made under root on first use if not given)."""
    root: pathlib.Path
    fast_front: pathlib.Path | None = None

    def fast_front_binary(self) -> pathlib.Path:
        if self.fast_front is None:
            from experiments.faults.forge import build_fast_front
            from runtime.distributed.fast_front import FAST_FRONT_NAME
            binary = self.root / "fast_front" / FAST_FRONT_NAME
            why = build_fast_front(binary)
            if why:
                raise RuntimeError(f"cannot build runtime/distributed/fast_front.c: {why}")
            self.fast_front = binary
        return self.fast_front

    def case_dir(self, name: str) -> pathlib.Path:
        path = self.root / "cases" / re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    @staticmethod
    def ports(n: int) -> list[int]:
        from runtime.distributed.launch import free_ports
        return free_ports(n)


def short(text: str, n: int = 260) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 3] + "..."


@dataclasses.dataclass
class WireCase:
    """A forged message from 'node:0' decoded in this process against what a party expects."""
    name: str
    did: str
    make: Callable[[pathlib.Path], tuple[Callable[[], object], pathlib.Path | None]]
    expected: str = "WireError naming node:0; nothing executed"

    def run(self, ctx: Context) -> Observed:
        from runtime.distributed.wire import WireError
        folder = ctx.case_dir(self.name)
        decode, marker = self.make(folder)
        start = time.perf_counter()
        try:
            decode()
        except WireError as err:
            took = time.perf_counter() - start
            clean = marker is None or not marker.exists()
            ok = err.party == "node:0" and clean
            return Observed("-", f"WireError: {err}", took, ok,
                            "" if clean else f"{marker} was created", "to decode")
        except Exception as err:  # noqa: BLE001 - reported as a failed case
            return Observed("-", f"{type(err).__name__}: {err}", None, False)
        return Observed("-", "accepted", None, False)


@dataclasses.dataclass
class ConfigCase:
    """`python -m experiments.party` on a bad node config: exit 2 before anything starts."""
    name: str
    did: str
    mutate: Callable[[dict, pathlib.Path], None]
    must_say: tuple[str, ...]
    party: str = "all"
    extra_args: tuple[str, ...] = ()
    expected: str = "exit 2 before any party starts, saying what to change"
    rewrite: Callable[[str], str] | None = None   # edits the JSON text (e.g. a repeated key)

    def run(self, ctx: Context) -> Observed:
        folder = ctx.case_dir(self.name)
        raw = node_config(3, "ABY3", ctx.ports(3))
        self.mutate(raw, folder)
        path = folder / "nodes.json"
        text = json.dumps(raw)
        path.write_text(self.rewrite(text) if self.rewrite else text)
        out = folder / "out"
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "experiments.party",
                                 f"--node_config={path}", f"--party={self.party}",
                                 f"--output_dir={out}", *self.extra_args],
                                cwd=REPO, capture_output=True, text=True, timeout=300)
        took = time.perf_counter() - start
        errors = [l for l in result.stderr.splitlines() if "] error: " in l]
        line = errors[-1] if errors else result.stderr.strip().splitlines()[-1:] or [""]
        line = line if isinstance(line, str) else line[0]
        started = list(out.glob("party_*.log")) if out.exists() else []
        ok = (result.returncode == 2 and all(s in line for s in self.must_say) and not started
              and "Traceback" not in result.stderr)
        return Observed(str(result.returncode), line, took, ok,
                        f"{len(started)} party logs" if started else "", "whole command")


@dataclasses.dataclass
class PartiesCase:
    """Real parties on loopback; `setup(ctx, folder, ports)` -> {party: (config path, prelude
    or None)} (parties it leaves out are never started); `fault(procs)` is injected once every
    started party logged `fault_after` ('' = at once); the case passes when every party in
    `judges` exits `judge_exit`, the error line of every judge (`say_in="all"`) or of at least
    one (`"any"`: e.g. when the first party to notice ends the run before the others could
    look) contains each of `must_say`, and `check(folder)` returns ''. Time to detect, to the
    last judge's exit: from the fault (clock "fault"), from the first judge's 'linking' line
    ("linking": waiting for peers) or from the parties' start ("start")."""
    name: str
    did: str
    expected: str
    setup: Callable
    judges: tuple[str, ...]
    must_say: tuple[str, ...]
    fault: Callable[[dict], None] | None = None
    fault_after: str = ""
    judge_exit: int = 3
    check: Callable[[pathlib.Path], str] | None = None
    say_in: str = "all"
    clock: str = ""
    timeout_s: float = 150.0
    # What the table shows when no judge printed an error (a run meant to complete).
    summary: Callable[[pathlib.Path], str] | None = None

    def run(self, ctx: Context) -> Observed:
        folder = ctx.case_dir(self.name)
        out = folder / "out"
        plan = self.setup(ctx, folder)
        t_start = time.monotonic()
        procs = {pid: start_party(path, pid, out, prelude) for pid, (path, prelude) in plan.items()}
        clock = self.clock or ("fault" if self.fault is not None else "linking")
        t0 = None
        try:
            if self.fault is not None:
                if self.fault_after:
                    wait_for_log(out, list(procs), self.fault_after, self.timeout_s, procs)
                self.fault(procs)
                t0 = time.monotonic()
            deadline = time.monotonic() + self.timeout_s
            linking = None
            while time.monotonic() < deadline and any(procs[j].poll() is None for j in self.judges):
                if linking is None and any("] linking to " in log_text(out, j)
                                           for j in self.judges):
                    linking = time.monotonic()
                time.sleep(0.05)
            t_end = time.monotonic()
            start = {"fault": t0, "linking": linking, "start": t_start}[clock]
        finally:
            codes = {pid: p.poll() for pid, p in procs.items()}
            kill_all(procs)
        lines = {j: error_line(out, j) for j in self.judges}
        saying = [j for j in self.judges if all(s in lines[j] for s in self.must_say)]
        ok = (all(codes[j] == self.judge_exit for j in self.judges) and
              (saying == list(self.judges) if self.say_in == "all" else bool(saying)))
        note = self.check(folder) if self.check else ""
        ok = ok and not note
        shown = " / ".join(f"{p}: {'running' if c is None else c}" for p, c in codes.items())
        first = lines[saying[0] if saying else self.judges[0]]
        if not first and self.summary is not None:
            first = self.summary(folder)
        took = None if start is None else t_end - start
        return Observed(shown, first, took, ok, note, {"fault": "after the fault", "linking":
                                                       "after linking began",
                                                       "start": "after start"}[clock])


@dataclasses.dataclass
class LauncherSignalCase:
    """`python -m experiments.party --party=all` gets `signum` once every party is linked."""
    name: str
    signum: int
    did: str
    expected: str

    def run(self, ctx: Context) -> Observed:
        folder = ctx.case_dir(self.name)
        out = folder / "out"
        raw = node_config(3, "ABY3", ctx.ports(3), job={"max_new_tokens": 16})
        path = folder / "nodes.json"
        path.write_text(json.dumps(raw))
        launcher = subprocess.Popen([sys.executable, "-m", "experiments.party",
                                     f"--node_config={path}", "--party=all",
                                     f"--output_dir={out}"],
                                    cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        try:
            wait_for_log(out, raw["nodes"], "] link up", 180)
            launcher.send_signal(self.signum)
            t0 = time.monotonic()
            _, stderr = launcher.communicate(timeout=60)
            gone = None
            while time.monotonic() - t0 < 30:
                if not processes_mentioning(str(out)):
                    gone = time.monotonic() - t0
                    break
                time.sleep(0.1)
            time.sleep(3)    # anything still alive would now write its results
            left = processes_mentioning(str(out))
            files = [p.name for p in (out / "results.jsonl", out / "outputs.npz") if p.exists()]
        finally:
            if launcher.poll() is None:
                launcher.kill()
            for pid in processes_mentioning(str(out)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        code = launcher.returncode
        want = -self.signum if self.signum == signal.SIGKILL else 128 + self.signum
        errors = [l for l in (stderr or "").splitlines() if "] error: " in l]
        ok = code == want and not left and not files
        note = (f"{len(left)} party processes left" if left else "") + \
               (f" result files {files}" if files else "")
        return Observed(f"launcher {code}", errors[-1] if errors else "(killed, no output)",
                        gone, ok, note.strip() or "no party process, no result file",
                        "signal to no party process")


@dataclasses.dataclass
class FrontCase:
    """One party's front (front.py) alone, in its own process, with a stand-in brpc backend
    that records what reaches it; `attack(address, spec, folder)` connects and sends forged
    bytes (returns the socket). Passes when the front closes that connection, logs one line
    naming `must_say`, forwards nothing of it, and still answers the hello afterwards."""
    name: str
    did: str
    attack: Callable
    must_say: tuple[str, ...]
    tls: bool = False
    legit_bytes: int = 0        # bytes sent before the offending frame (forwarded)
    fast: bool = False          # against the front in C (fast_front.c), plain TCP only
    expected: str = ("the front drops the frame, closes the connection naming the peer; "
                     "nothing of it reaches brpc; the front lives")

    def run(self, ctx: Context) -> Observed:
        folder = ctx.case_dir(self.name)
        proc, spec, backend, received = start_test_front(
            folder, ctx.ports(1)[0], tls=self.tls,
            fast_front=ctx.fast_front_binary() if self.fast else None)
        try:
            start = time.perf_counter()
            sock = self.attack(("127.0.0.1", spec.listen_port), spec, folder)
            sock.settimeout(10)
            closed = False
            try:
                while True:
                    if not sock.recv(65536):
                        closed = True
                        break
            except (ConnectionError, OSError):
                closed = True
            took = time.perf_counter() - start
            sock.close()
            time.sleep(0.2)
            alive = front_answers_hello(spec, folder if self.tls else None)
            line = ""
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not line:
                events = [json.loads(l) for l in pathlib.Path(spec.events_path).read_text()
                          .splitlines() if l.strip()]
                line = (f"[party {spec.party}] front: {events[-1]['kind']} from "
                        f"{events[-1]['node'] or ''} ({events[-1]['address']}): "
                        f"{events[-1]['why']}") if events else ""
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.wait()
            backend.close()
        forwarded = sum(len(b) for b in received)
        ok = (closed and alive and forwarded <= self.legit_bytes
              and all(m in line for m in self.must_say))
        note = "; ".join(x for x in (
            "" if closed else "connection not closed", "" if alive else "front dead",
            f"{forwarded} bytes reached brpc" if forwarded > self.legit_bytes else "") if x)
        return Observed("-", line, took, ok, note or "nothing forwarded, front alive",
                        "send to close")


@dataclasses.dataclass
class CliCase:
    """`python -m experiments.run` with a bad flag or input: exit 2, one `error:` line saying
    `must_say`, no traceback, and the folder's previous results untouched."""
    name: str
    did: str
    args: tuple[str, ...]
    must_say: tuple[str, ...]
    prepare: Callable[[pathlib.Path], None] | None = None
    expected: str = "exit 2 before any work, one line naming the flag, file or field"

    def run(self, ctx: Context) -> Observed:
        folder = ctx.case_dir(self.name)
        out = folder / "out"
        out.mkdir()
        previous = out / "results.jsonl"
        previous.write_text('{"previous": true}\n')
        if self.prepare is not None:
            self.prepare(folder)
        args = [a.replace("{dir}", str(folder)) for a in self.args]
        if not any(a.startswith("--output_dir") for a in args):
            args.append(f"--output_dir={out}")
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=REPO,
                                capture_output=True, text=True, timeout=600)
        took = time.perf_counter() - start
        errors = [l for l in result.stderr.splitlines() if l.startswith("error: ")]
        line = errors[-1] if errors else (result.stderr.strip().splitlines() or [""])[-1]
        intact = previous.read_text() == '{"previous": true}\n'
        ok = (result.returncode == 2 and all(m in line for m in self.must_say) and intact
              and "Traceback" not in result.stderr)
        return Observed(str(result.returncode), line, took, ok,
                        "" if intact else "previous results.jsonl changed", "whole command")


@dataclasses.dataclass
class FrontScenarioCase:
    """One party's front alone (front.py, or with `fast` the front in C) with a stand-in brpc
    that records what reaches it; `scenario(front)` (front: .spec, .received (the bytes brpc
    got), .folder, .events() (the front's events so far)) acts out what a peer or a local
    process does and returns (passed, the line that shows it, a note). Passes when the
    scenario does and the front still answers the hello afterwards."""
    name: str
    did: str
    expected: str
    scenario: Callable
    fast: bool = False
    tls: bool = False
    spec_overrides: dict | None = None

    def run(self, ctx: Context) -> Observed:
        import types
        folder = ctx.case_dir(self.name)
        proc, spec, backend, received = start_test_front(
            folder, ctx.ports(1)[0], tls=self.tls, spec_overrides=self.spec_overrides,
            fast_front=ctx.fast_front_binary() if self.fast else None)

        def events():
            return [json.loads(line) for line in pathlib.Path(spec.events_path).read_text()
                    .splitlines() if line.strip()]
        front = types.SimpleNamespace(spec=spec, received=received, folder=folder,
                                      events=events, proc=proc)
        try:
            start = time.perf_counter()
            passed, line, note = self.scenario(front)
            took = time.perf_counter() - start
            alive = front_answers_hello(spec, folder if self.tls else None)
        finally:
            proc.kill()
            proc.wait()
            backend.close()
        note = "; ".join(x for x in (note, "" if alive else "front dead") if x)
        return Observed("-", line, took, passed and alive, note, "scenario")
