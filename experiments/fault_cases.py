"""Every bad-input and fault case of the multi-party side, run for real, as one markdown table.

    python -m experiments.fault_cases --output_dir=results/fault_cases
    python -m experiments.fault_cases --only=tls,launcher      # cases whose name contains these

Each case is an object with `name`, `did` (what was done), `expected` and `run(ctx)` ->
`Observed` (exit codes, the error line that explains it, time to detect, pass/fail); `CASES`
is the list. Kinds: `WireCase` (a forged message decoded in this process), `ConfigCase` (the
`experiments.party` CLI on a bad node config: exit 2 before any party starts), `PartiesCase`
(real party processes on loopback, some with patched code or certificates, a fault injected)
and `LauncherSignalCase` (a signal to `experiments.party --party=all`). CLI cases of other
commands can be added as more entries (any object with name / did / expected / run).

Writes OUTPUT_DIR/fault_cases.md (the table) and fault_cases.jsonl (one record per case);
every case's files (configs, certificates, party logs) are under OUTPUT_DIR/cases/<name>/.
A hostile party is simulated by running its worker with a Python prelude that patches its
code (skips its own checks, or sends a pickle / a forged share): exactly what a party that
controls its own machine can do. The pickles are built as bytes and never loaded here.
"""
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

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY_JOB = {"model": "llama-tiny", "num_layers": 2, "policy": "mpcache", "budget": 0.5,
            # oversample 0: both levels choose (at half of 32 tokens, 2x the budget would
            # keep every coarse cluster)
            "policy_options": {"static_sinks": 4, "static_recent": 8,
                               "levels": [[8, 0.5], [4, None]], "oversample": 0},
            "seq_len": 32, "max_new_tokens": 2, "reveal_logits": False, "timeout_s": 240}

# Preludes run in a party's worker before experiments.party's main (simulated hostile code).
SKIP_OWN_CERT_CHECK = ("import runtime.distributed.config as _config\n"
                       "_config.check_own_certificate = lambda *a, **k: None\n")
SEND_PICKLE = """
import os, pickle
from runtime.distributed import wire
class _Command:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
wire.encode_share = lambda name, share: pickle.dumps(_Command())
"""
SEND_WRONG_SHAPE = """
from runtime.distributed import wire
def _v(n):
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out
def _forged(name, share):
    meta, old = b"", bytes(share.meta)
    for f, w, v in wire._fields(old):
        if f == 4:   # the shape: one more dimension of 7
            dims = b"".join(_v(d) for d in wire.parse_meta(old)["shape"]) + _v(7)
            v = b"\\x0a" + _v(len(dims)) + dims
        meta += _v(f << 3 | w) + (_v(v) if w == 0 else _v(len(v)) + v)
    chunks = [bytes(c) for c in share.share_chunks]
    return wire.pack({"kind": "share", "name": name, "meta": len(meta),
                      "chunks": [len(c) for c in chunks]}, meta + b"".join(chunks))
wire.encode_share = _forged
"""


# ----- helpers shared with tests/test_distributed.py ------------------------------------------

def tag(party: str) -> str:
    return party.replace(":", "_")


def node_config(parties: int, protocol: str, ports: list[int] | None = None,
                job: dict | None = None, **link) -> dict:
    """A loopback node config for the tiny job (`ports`: one per party, default 61400+i)."""
    ids = [f"node:{i}" for i in range(parties)]
    ports = ports or [61400 + i for i in range(parties)]
    return {
        "id": f"test.{parties}pc",
        "nodes": {pid: f"127.0.0.1:{port}" for pid, port in zip(ids, ports)},
        "devices": {
            "SPU": {"kind": "SPU", "config": {
                "node_ids": ids,
                "runtime_config": {"protocol": protocol, "field": "FM64"},
                "link": {"peer_timeout_s": 10, "recv_timeout_s": 180, "connect_timeout_s": 60,
                         "connect_retry_times": 60, "connect_retry_interval_ms": 500,
                         "http_timeout_ms": 5000, **link}}},
            "MODEL_OWNER": {"kind": "PYU", "config": {"node_id": "node:0"}},
            "PROMPT_OWNER": {"kind": "PYU", "config": {"node_id": "node:1"}},
        },
        "job": {**TINY_JOB, **(job or {})},
    }


def _openssl(*args, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: pathlib.Path, name: str = "ca") -> None:
    """A throwaway self-signed CA: directory/name.crt, name.key."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.crt", "-days", "30", "-subj", f"/CN={name}", cwd=directory)


def issue_cert(directory: pathlib.Path, file_tag: str, cn: str, ca: str = "ca",
               san: str = "IP:127.0.0.1,DNS:localhost", days: int = 30) -> None:
    """directory/file_tag.crt + .key: CN=cn, subjectAltName=san, signed by directory/ca, valid
    for `days` from now (-1: expired yesterday)."""
    (directory / f"{file_tag}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{file_tag}.key", "-out",
             f"{file_tag}.csr", "-subj", f"/CN={cn}", cwd=directory)
    _openssl("x509", "-req", "-in", f"{file_tag}.csr", "-CA", f"{ca}.crt", "-CAkey",
             f"{ca}.key", "-CAcreateserial", "-out", f"{file_tag}.crt", "-days", str(days),
             "-extfile", f"{file_tag}.ext", cwd=directory)


def make_certs(directory: pathlib.Path, parties: list[str], ca_name: str = "ca") -> None:
    """A CA and one certificate per party by the identity rule (CN = node id, SAN 127.0.0.1)."""
    make_ca(directory, ca_name)
    for pid in parties:
        issue_cert(directory, tag(pid), pid, ca_name)


def tls_section(certs: dict[str, str], ca: str = "certs/ca.crt") -> dict:
    """link.tls with certs {party: file tag under certs/}."""
    return {"ca": ca, "certs": {p: {"cert": f"certs/{t}.crt", "key": f"certs/{t}.key"}
                                for p, t in certs.items()}}


def start_party(config_path: pathlib.Path, party: str, out: pathlib.Path,
                prelude: str | None = None) -> subprocess.Popen:
    """One party as `python -m experiments.party` (supervisor + worker), or with `prelude` its
    worker alone running the prelude first (patched code). Own session; output to
    out/party_<tag>.log; dies with this process (launch.child_env)."""
    from runtime.distributed.launch import child_env
    args = [f"--node_config={config_path}", f"--party={party}", f"--output_dir={out}"]
    if prelude is None:
        cmd = [sys.executable, "-m", "experiments.party", *args]
    else:
        code = (f"{prelude}\nfrom absl import app\nfrom experiments import party\n"
                "app.run(party.main)\n")
        cmd = [sys.executable, "-c", code, "--worker", *args]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"party_{tag(party)}.log", "w") as logf:
        return subprocess.Popen(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, env=child_env())


def kill_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGKILL every party's process group (also stopped ones) and reap them."""
    for p in procs.values():
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs.values():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def log_text(out: pathlib.Path, party: str) -> str:
    path = out / f"party_{tag(party)}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def error_line(out: pathlib.Path, party: str) -> str:
    """The last `error:` line of a party's log ('' if none)."""
    lines = [l.strip() for l in log_text(out, party).splitlines() if "] error: " in l]
    return lines[-1] if lines else ""


def wait_for_log(out: pathlib.Path, parties, text: str, timeout: float,
                 procs: dict[str, subprocess.Popen] | None = None) -> float:
    """Wait until every party's log contains `text` -> the monotonic time it did; raises
    TimeoutError (also when one of `procs` exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(text in log_text(out, p) for p in parties):
            return time.monotonic()
        if procs and any(procs[p].poll() is not None for p in parties if p in procs):
            break
        time.sleep(0.05)
    raise TimeoutError(f"{text!r} did not appear in the logs of {list(parties)}")


def processes_mentioning(marker: str) -> list[int]:
    """Pids (other than this one) whose command line contains `marker`."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ")[-1][:1]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


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
    """Where a case keeps its files, and the free ports it may use."""
    root: pathlib.Path

    def case_dir(self, name: str) -> pathlib.Path:
        path = self.root / "cases" / re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    @staticmethod
    def ports(n: int) -> list[int]:
        from runtime.distributed.launch import free_ports
        return free_ports(n)


def _short(text: str, n: int = 260) -> str:
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


# ----- forged brpc frames (what a hostile peer or any local process can send) -------------------

def pb_varint(n: int) -> bytes:
    """Protobuf base-128 varint (forged frames here and forged messages in tests/test_wire.py)."""
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def pb_field(number: int, value) -> bytes:
    """A protobuf field: an int as a varint, bytes length-delimited."""
    if isinstance(value, int):
        return pb_varint(number << 3) + pb_varint(value)
    return pb_varint(number << 3 | 2) + pb_varint(len(value)) + value


def forge_frame(sender_rank: int, key: bytes, value: bytes = b"x" * 8,
                message_length: int | None = None, chunk_offset: int = 0,
                service: bytes = b"org.interconnection.link.ReceiverService",
                body_size: int | None = None) -> bytes:
    """A brpc baidu_std frame carrying a yacl Push as SPU 0.9.5's link sends it (fields read
    off the wire: see runtime/distributed/front.py), with any field set to a lie:
    `message_length` makes it a chunk of a message of that length at `chunk_offset`;
    `body_size` overrides the header's body size (the rest is not sent)."""
    request = pb_field(1, service) + pb_field(2, b"Push")
    meta = pb_field(1, request) + pb_field(3, 0) + pb_field(4, 12345)
    push = pb_field(1, sender_rank) + pb_field(2, key + b"\x01\x020") + pb_field(3, value)
    if message_length is not None:
        push += pb_field(4, 1) + pb_field(5, pb_field(1, message_length)
                                            + pb_field(2, chunk_offset))
    body = meta + push
    import struct
    header = struct.pack(">4sII", b"PRPC", len(body) if body_size is None else body_size,
                         len(meta))
    return header + (body if body_size is None else b"")


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
    expected: str = ("the front drops the frame, closes the connection naming the peer; "
                     "nothing of it reaches brpc; the front lives")

    def run(self, ctx: Context) -> Observed:
        import socket
        from runtime.distributed import front as front_mod
        folder = ctx.case_dir(self.name)
        proc, spec, backend, received = start_test_front(folder, ctx.ports(1)[0], tls=self.tls)
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


def start_test_front(folder: pathlib.Path, port: int, tls: bool = False,
                     max_message_bytes: int = 1 << 20, spec_overrides: dict | None = None):
    """A front for node:1 of a 3-party config (ranks 0-2) on 127.0.0.1:port, plain or TLS
    (certificates under folder/certs), with a recording stand-in backend -> (process, spec,
    backend socket, list of received byte strings)."""
    import socket
    import threading
    from runtime.distributed import front as front_mod
    from runtime.distributed.launch import child_env
    tls_spec = None
    if tls:
        make_certs(folder / "certs", ["node:0", "node:1", "node:2"])
        c = folder / "certs"
        tls_spec = {"ca": str(c / "ca.crt"), "cert": str(c / "node_1.crt"),
                    "key": str(c / "node_1.key"), "verify_depth": 1}
    spec = front_mod.FrontSpec(
        party="node:1", rank=1, listen_host="127.0.0.1", listen_port=port,
        link_id="test.3pc.run",
        peers={f"node:{r}": {"rank": r, "host": "127.0.0.1", "address": f"127.0.0.1:{port + 0}"}
               for r in (0, 2)},
        hello_key=(b"k" * 32).hex(), max_frame_bytes=(1 << 20) + (64 << 10),
        max_message_bytes=max_message_bytes, max_buffered_bytes=2 * max_message_bytes,
        events_path=str(folder / "front_events.jsonl"), tls=tls_spec)
    spec = dataclasses.replace(spec, **(spec_overrides or {}))
    pathlib.Path(spec.events_path).write_text("")
    proc = subprocess.Popen([sys.executable, front_mod.__file__, spec.to_json()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(folder / "front.log", "w"), env=child_env())
    ready = json.loads(proc.stdout.readline())
    backend = socket.socket()
    backend.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    backend.bind(("127.0.0.1", ready["backend_port"]))
    backend.listen()
    received: list[bytes] = []

    def serve():
        while True:
            try:
                conn, _ = backend.accept()
            except OSError:
                return
            def pump(conn=conn):
                while True:
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    received.append(data)
            threading.Thread(target=pump, daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return proc, spec, backend, received


def tls_client(address, folder: pathlib.Path, cert_tag: str = "node_0"):
    """A TLS client socket to `address` presenting folder/certs/<cert_tag>.crt."""
    import socket
    import ssl
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(folder / "certs" / "ca.crt")
    ctx.load_cert_chain(folder / "certs" / f"{cert_tag}.crt", folder / "certs" / f"{cert_tag}.key")
    return ctx.wrap_socket(socket.create_connection(address, timeout=10))


def front_answers_hello(spec, tls_folder: pathlib.Path | None) -> bool:
    import socket
    from runtime.distributed import front as front_mod
    address = ("127.0.0.1", spec.listen_port)
    try:
        sock = (tls_client(address, tls_folder) if tls_folder is not None
                else socket.create_connection(address, timeout=5))
        nonce = os.urandom(front_mod.HELLO_NONCE_BYTES)
        sock.sendall(front_mod.hello_request(nonce))
        reply = b""
        while len(reply) < 36:
            got = sock.recv(64)
            if not got:
                break
            reply += got
        sock.close()
    except OSError:
        return False
    return front_mod.check_hello_reply(reply, bytes.fromhex(spec.hello_key), nonce, spec.party)


def _sending(*frames: bytes, tls_cert: str | None = None):
    """An attack that connects (TLS with certs/<tls_cert> when given) and sends `frames`."""
    def attack(address, spec, folder):
        import socket
        sock = (tls_client(address, folder, tls_cert) if tls_cert
                else socket.create_connection(address, timeout=10))
        for frame in frames:
            try:
                sock.sendall(frame)
            except OSError:
                break
        return sock
    return attack


def _front_cases() -> list:
    run_key = b"test.3pc.run:P2P-1:0->1"
    big = 60 << 20

    def wrong_san(address, spec, folder):
        issue_cert(folder / "certs", "node_0_wrong_san", "node:0", san="IP:10.9.9.9")
        return _sending(forge_frame(0, run_key), tls_cert="node_0_wrong_san")(address, spec,
                                                                               folder)

    def sixty_mib_messages(address, spec, folder):
        import socket
        sock = socket.create_connection(address, timeout=10)
        for i in range(6):
            key = f"test.3pc.run:P2P-{100 + i}:0->1".encode()
            try:
                sock.sendall(forge_frame(0, key, b"y" * 1024, message_length=big))
            except OSError:
                break
        return sock

    return [
        FrontCase("front: chunk declaring 2^40 bytes", "a well-formed chunked Push from 'rank 0' "
                  "declaring a total length of 2^40 (std::bad_alloc in the worker before)",
                  _sending(forge_frame(0, run_key, message_length=1 << 40)),
                  ("declaring 1,099,511,627,776 bytes, over the cap",)),
        FrontCase("front: chunk offset 2^62", "a chunk at offset 2^62 of an 8-byte message "
                  "('invalid chunk info' abort in yacl before)",
                  _sending(forge_frame(0, run_key, message_length=8, chunk_offset=1 << 62)),
                  ("at offset 4,611,686,018,427,387,904", "does not fit its message of 8")),
        FrontCase("front: frame of 2^31 bytes", "a brpc header declaring a 2 GiB body",
                  _sending(forge_frame(0, run_key, body_size=(1 << 31))),
                  ("a frame of 2,147,483,648 bytes",)),
        FrontCase("front: own rank", "a Push claiming to come from the receiving party's own rank",
                  _sending(forge_frame(1, b"test.3pc.run:P2P-1:1->1")),
                  ("sender rank 1, which is not a peer",)),
        FrontCase("front: key of another link", "a Push under a key of another run's link",
                  _sending(forge_frame(0, b"other.run:P2P-1:0->1")),
                  ("not a key of this run's link",)),
        FrontCase("front: rank switch mid-connection", "a first frame as rank 0, then one as "
                  "rank 2 on the same connection",
                  _sending(forge_frame(0, run_key), forge_frame(2, b"test.3pc.run:P2P-1:2->1")),
                  ("claiming sender rank 2 on a connection of rank 0",),
                  legit_bytes=len(forge_frame(0, run_key))),
        FrontCase("front: 6 x 60 MiB messages", "six chunked messages of 60 MiB each under keys "
                  "the program never reads (RSS 300 -> 785 MB before)", sixty_mib_messages,
                  ("declaring 62,914,560 bytes, over the cap of 1,048,576",)),
        FrontCase("front: HTTP request", "an HTTP GET to the link port",
                  _sending(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
                  ("neither brpc nor the hello",)),
        FrontCase("front: TLS spoofed rank", "node:0's valid certificate, a Push claiming rank 2",
                  _sending(forge_frame(2, b"test.3pc.run:P2P-1:2->1"), tls_cert="node_0"),
                  ("node:0", "claiming sender rank 2 on a connection of rank 0"), tls=True),
        FrontCase("front: TLS right CN, wrong SAN", "a CA-signed certificate with CN=node:0 and "
                  "SAN IP:10.9.9.9 (brpc accepted it before)", wrong_san,
                  ("refused a TLS client", "no subjectAltName for node:0's host"), tls=True),
    ]


# ----- the list ---------------------------------------------------------------------------------

def _wire_cases() -> list:
    """Forged peer messages (in process)."""
    import pickle

    import numpy as np
    import spu

    from runtime.distributed import wire

    def io(protocol="ABY3"):
        cfg = spu.RuntimeConfig(protocol=getattr(spu.ProtocolKind, protocol),
                                field=spu.FieldType.FM64)
        return spu.Io({"ABY3": 3, "SEMI2K": 2}[protocol], cfg)

    def share(x, protocol="ABY3", vis=spu.Visibility.VIS_SECRET):
        kw = {"owner_rank": 0} if vis == spu.Visibility.VIS_SECRET else {}
        return io(protocol).make_shares(np.asarray(x), vis, **kw)[1]

    expect = wire.ShareSpec.like("v1", share(np.ones((2, 3), np.float32)))

    def decoding(message):
        return lambda folder: ((lambda: wire.decode_share(message, expect, "node:0")), None)

    class _Command:
        def __init__(self, command):
            self.command = command

        def __reduce__(self):
            return (os.system, (self.command,))

    def pickled(folder):
        marker = folder / "pwned"
        message = pickle.dumps(_Command(f"touch {marker}"))      # bytes only, never loaded
        return (lambda: wire.decode_share(message, expect, "node:0")), marker

    good = wire.encode_share("v1", share(np.ones((2, 3), np.float32)))
    deep = b"[" * 50_000
    import struct
    return [
        WireCase("wire: pickle (os.system)", "a share message that is a pickle whose "
                 "__reduce__ calls os.system('touch MARKER')", pickled),
        WireCase("wire: pickled SPU share", "pickle.dumps(libspu.Share) as the message",
                 decoding(pickle.dumps(share(np.ones((2, 3), np.float32))))),
        WireCase("wire: wrong dtype", "an int32 share where a float32 one is expected",
                 decoding(wire.encode_share("v1", share(np.ones((2, 3), np.int32))))),
        WireCase("wire: wrong shape", "a (3, 2) share where (2, 3) is expected",
                 decoding(wire.encode_share("v1", share(np.ones((3, 2), np.float32))))),
        WireCase("wire: public value", "a public value where a secret share is expected",
                 decoding(wire.encode_share("v1", share(np.ones((2, 3), np.float32),
                                                        vis=spu.Visibility.VIS_PUBLIC)))),
        WireCase("wire: other protocol", "a SEMI2K share where an ABY3 share is expected",
                 decoding(wire.encode_share("v1", share(np.ones((2, 3), np.float32),
                                                        "SEMI2K")))),
        WireCase("wire: truncated", "the share message minus its last byte",
                 decoding(good[:-1])),
        WireCase("wire: extra bytes", "the share message plus one byte", decoding(good + b"\0")),
        WireCase("wire: oversized header", "a header length of 1 MiB",
                 decoding(struct.pack(">I", 1 << 20) + good)),
        WireCase("wire: nested header", "a 50,000-deep JSON header (parser recursion)",
                 decoding(struct.pack(">I", len(deep)) + deep)),
        WireCase("wire: wrong name", "the share of 'v2' where 'v1' is expected",
                 decoding(wire.encode_share("v2", share(np.ones((2, 3), np.float32))))),
        WireCase("wire: wrong kind", "a JSON message where a share is expected",
                 decoding(wire.encode_json("v1", [1, 2, 3]))),
    ]


def _spu(raw: dict) -> dict:
    return raw["devices"]["SPU"]["config"]


def _tls_files(folder: pathlib.Path, parties, *, shared_imposter=False, swap=None,
               other_ca_for=None) -> dict:
    """Certificates under folder/certs and the link.tls section that uses them."""
    certs = folder / "certs"
    make_certs(certs, list(parties))
    files = {p: tag(p) for p in parties}
    if shared_imposter:
        issue_cert(certs, "imposter", "imposter", san="IP:10.9.9.9")
        files = {p: "imposter" for p in parties}
    if swap:
        files[swap[0]] = tag(swap[1])
    if other_ca_for:
        make_ca(certs, "ca2")
        issue_cert(certs, "other_ca", other_ca_for, ca="ca2")
        files[other_ca_for] = "other_ca"
    return tls_section(files)


def _config_cases() -> list:
    def link(**kw):
        return lambda raw, folder: _spu(raw)["link"].update(kw)

    def job(**kw):
        return lambda raw, folder: raw["job"].update(kw)

    def rename(raw, folder):
        raw["nodes"]["a/b"] = raw["nodes"].pop("node:2")
        _spu(raw)["node_ids"][2] = "a/b"

    def remote(raw, folder):
        raw["nodes"]["node:2"] = "10.0.0.3:61320"

    def all_one_cert(raw, folder):
        _spu(raw)["link"]["tls"] = _tls_files(folder, raw["nodes"], shared_imposter=True)

    def owner_with_node2_cert(raw, folder):
        _spu(raw)["link"]["tls"] = _tls_files(folder, raw["nodes"], swap=("node:1", "node:2"))

    def node2_at(address):
        def mutate(raw, folder):
            raw["nodes"]["node:2"] = address(raw)
        return mutate

    def same_port_as_node0(raw):
        return "localhost:" + raw["nodes"]["node:0"].rpartition(":")[2]

    def expired_cert(raw, folder):
        _spu(raw)["link"]["tls"] = _tls_files(folder, raw["nodes"])
        issue_cert(folder / "certs", "node_0", "node:0", days=-1)

    def repeat_node1(text):
        # {"node:0": ..., "node:1": A, "node:2": ...} -> a second "node:1" key in "nodes"
        start = text.index('"node:1": "127.0.0.1:')
        entry = text[start:text.index('"', start + len('"node:1": "')) + 1]
        return text.replace(entry, f'{entry}, {entry.replace("node:1", "node:1", 1)}', 1)

    held: list = []

    def hold_port_of(party):
        def mutate(raw, folder):
            import socket
            sock = socket.socket()
            sock.bind(("127.0.0.1", int(raw["nodes"][party].rpartition(":")[2])))
            sock.listen()
            held.append(sock)        # held until the process ends
        return mutate

    return [
        ConfigCase("config: own port busy", "another process listens on node:0's port (gave "
                   "'brpc server failed start', exit 3)", hold_port_of("node:0"),
                   ("address in use: node:0's link port 127.0.0.1:",), party="node:0",
                   expected="exit 2 at once: address in use, naming the port"),
        ConfigCase("config: own port busy (launcher)", "another process listens on node:2's port; "
                   "--party=all", hold_port_of("node:2"),
                   ("address in use: node:2's link port 127.0.0.1:",),
                   expected="exit 2 before any party starts: address in use"),
        ConfigCase("config: IPv6 literal", "node:2 at [::1]:P (the probe passed the brackets to "
                   "socket.create_connection: a healthy peer was reported hung)",
                   node2_at(lambda raw: "[::1]:" + raw["nodes"]["node:2"].rpartition(":")[2]),
                   ("nodes['node:2']='[::1]:", "IPv6 address: not supported")),
        ConfigCase("config: full-width port", "node:2's port in full-width digits "
                   "('\uff16\uff12\uff14\uff11\uff12'.isdigit() is true)",
                   node2_at(lambda raw: "127.0.0.1:\uff16\uff12\uff14\uff11\uff12"),
                   ("ASCII digits 0-9",)),
        ConfigCase("config: connect_timeout_s 1e12", "link.connect_timeout_s = 1e12 (a pybind "
                   "TypeError traceback from the retry count)", link(connect_timeout_s=1e12),
                   ("link.connect_timeout_s=1e+12 is beyond", "use at most 604800")),
        ConfigCase("config: repeated node id", 'the key "node:1" twice in "nodes" (the last '
                   "won, silently)", lambda raw, folder: None,
                   ("the key 'node:1' appears twice",), rewrite=repeat_node1),
        ConfigCase("config: same port via localhost", "node:2 at localhost:P where node:0 is at "
                   "127.0.0.1:P", node2_at(same_port_as_node0),
                   ("nodes 'node:0' and 'node:2' both use port",)),
        ConfigCase("config: negative shaping delay", 'link.shape = {"delay_ms": -1}',
                   link(shape={"delay_ms": -1}), ("link.shape.delay_ms=-1 must be",)),
        ConfigCase("config: negative shaping rate", 'link.shape = {"rate_mb_s": -40}',
                   link(shape={"rate_mb_s": -40}), ("link.shape.rate_mb_s=-40 must be",)),
        ConfigCase("config: expired certificate", "node:0's CA-signed certificate expired "
                   "yesterday (caught only at run time)", expired_cert,
                   ("link.tls.certs['node:0'].cert=", "expired on")),
        ConfigCase("config: node id a/b", "node id 'a/b' (crashed the launcher, which left "
                   "parties holding ports)", rename, ("node id 'a/b' is not allowed",)),
        ConfigCase("config: string peer_timeout_s", 'link.peer_timeout_s = "10"',
                   link(peer_timeout_s="10"), ("link.peer_timeout_s='10' must be a number",)),
        ConfigCase("config: non-integer retries", "link.connect_retry_times = 1.5",
                   link(connect_retry_times=1.5), ("link.connect_retry_times=1.5 must be an "
                                                   "integer",)),
        ConfigCase("config: string prompt_ids", 'job.prompt_ids = ["1", "2", ...] (32 strings)',
                   job(prompt_ids=[str(i) for i in range(32)]),
                   ("job.prompt_ids must be a list of integer token ids",)),
        ConfigCase("config: seq_len 1e9", "job.seq_len = 1000000000 (grew past 6 GB)",
                   job(seq_len=10**9), ("exceeds llama-tiny's context of 4096",)),
        ConfigCase("config: max_new_tokens 1e6", "job.max_new_tokens = 1000000 (ran until the "
                   "job timeout)", job(max_new_tokens=10**6), ("exceeds llama-tiny's context",)),
        ConfigCase("config: memory estimate", "llama2-d1024 (all 32 layers), seq_len 4000, "
                   "ABY3, 3 parties on this machine",
                   job(model="llama2-d1024", num_layers=None, seq_len=4000, policy="full",
                       policy_options={}),
                   ("per party", "over the limit")),
        ConfigCase("config: --job override", "--job='{\"timeout_s\": \"60\"}' to the launcher",
                   lambda raw, folder: None, ("job.timeout_s='60' must be a number",),
                   extra_args=('--job={"timeout_s": "60"}',)),
        ConfigCase("config: plain TCP off loopback", "node:2 at 10.0.0.3, no link.tls, no "
                   "insecure (ran as plain TCP without a warning)", remote,
                   ('add "insecure": true', "not on loopback"), party="node:0"),
        ConfigCase("config: one cert for all (launcher)", "one certificate (CN=imposter, SAN "
                   "IP:10.9.9.9) for all three nodes", all_one_cert,
                   ("node 'node:0'", "CN='imposter'")),
        ConfigCase("config: owner has node:2's cert", "the prompt owner node:1 configured with "
                   "node:2's certificate", owner_with_node2_cert,
                   ("node 'node:1'", "CN='node:2'")),
    ]


def _write_config(folder: pathlib.Path, raw: dict, name: str = "nodes.json") -> pathlib.Path:
    path = folder / name
    path.write_text(json.dumps(raw))
    return path


def _party_cases() -> list:
    parties3 = ["node:0", "node:1", "node:2"]

    def tls_plan(**tls_kw):
        """Every party reads a config whose certs follow tls_kw; all run patched to skip their
        own certificate check (a party controls its own code)."""
        def setup(ctx, folder):
            raw = node_config(3, "ABY3", ctx.ports(3), connect_timeout_s=20)
            _spu(raw)["link"]["tls"] = _tls_files(folder, parties3, **tls_kw)
            path = _write_config(folder, raw)
            return {p: (path, SKIP_OWN_CERT_CHECK) for p in parties3}
        return setup

    def swapped_owner(ctx, folder):
        raw = node_config(3, "ABY3", ctx.ports(3), connect_timeout_s=20)
        _spu(raw)["link"]["tls"] = _tls_files(folder, parties3)
        honest = _write_config(folder, raw)
        _spu(raw)["link"]["tls"]["certs"]["node:1"] = dict(
            _spu(raw)["link"]["tls"]["certs"]["node:2"])
        hostile = _write_config(folder, raw, "nodes_node1.json")
        return {"node:0": (honest, None), "node:1": (hostile, SKIP_OWN_CERT_CHECK),
                "node:2": (honest, None)}

    def plain(n=3, start=None, prelude=None, **link):
        def setup(ctx, folder):
            raw = node_config(n, "ABY3" if n == 3 else "SEMI2K", ctx.ports(n), **link)
            path = _write_config(folder, raw)
            ids = [f"node:{i}" for i in range(n)]
            return {p: (path, (prelude or {}).get(p)) for p in (start or ids)}
        return setup

    def kill(party, sig=signal.SIGKILL):
        def fault(procs):
            os.killpg(procs[party].pid, sig)
        return fault

    def no_marker(folder):
        marker = pathlib.Path("/tmp/mpcache_fault_case_pwned")
        return f"{marker} was created" if marker.exists() else ""

    marker = "/tmp/mpcache_fault_case_pwned"
    if os.path.exists(marker):
        os.remove(marker)

    def insecure_remote(ctx, folder):
        ports = ctx.ports(2)
        raw = node_config(2, "SEMI2K", ports, connect_timeout_s=5, insecure=True)
        raw["nodes"]["node:1"] = f"10.255.255.1:{ports[1]}"
        return {"node:0": (_write_config(folder, raw), None)}

    def other_policy(ctx, folder):
        raw = node_config(3, "ABY3", ctx.ports(3))
        honest = _write_config(folder, raw)
        raw["job"].update(policy="full", policy_options={})
        other = _write_config(folder, raw, "nodes_node2.json")
        return {"node:0": (honest, None), "node:1": (honest, None), "node:2": (other, None)}

    def stopped_by_sigterm(folder):
        text = log_text(folder / "out", "node:2")
        return "" if "error: stopped by SIGTERM" in text else "node:2 did not report SIGTERM"

    def warned(folder):
        text = log_text(folder / "out", "node:0")
        return "" if "warning: link.insecure=true" in text else "no warning printed"

    http_servers: list = []

    def web_server_on_node2(ctx, folder):
        import http.server
        import threading
        ports = ctx.ports(3)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", ports[2]),
                                                 http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        http_servers.append(server)
        raw = node_config(3, "ABY3", ports, connect_timeout_s=8)
        path = _write_config(folder, raw)
        return {"node:0": (path, None), "node:1": (path, None)}

    def stop_web_server(folder):
        while http_servers:
            http_servers.pop().shutdown()
        return ""

    def forged_frames_mid_run(procs):
        import socket
        config = json.loads(pathlib.Path(mid_run_config[0]).read_text())
        port = int(config["nodes"]["node:1"].rpartition(":")[2])
        link_id = config["id"] + ".run"
        for frame in (forge_frame(0, f"{link_id}:P2P-1:0->1".encode(), message_length=1 << 40),
                      forge_frame(0, f"{link_id}:P2P-1:0->1".encode(), message_length=8,
                                  chunk_offset=1 << 62)):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(frame)
                try:
                    sock.recv(10)
                except OSError:
                    pass

    mid_run_config: list = []

    def plain_recording(ctx, folder):
        plan = plain(job={"max_new_tokens": 4})(ctx, folder)
        mid_run_config[:] = [str(next(iter(plan.values()))[0])]
        return plan

    def front_dropped(folder):
        text = log_text(folder / "out", "node:1")
        n = text.count("front: dropped a frame")
        return "" if n >= 2 else f"node:1's front logged {n} dropped frames"

    return [
        PartiesCase("blame: a web server on node:2's port", "an HTTP server listens on node:2's "
                    "port; node:0 and node:1 started, connect_timeout_s=8 (waited 95 s with "
                    "connect_timeout_s=8 and blamed a healthy party before)",
                    "node:0 and node:1 exit 3 within connect_timeout_s: port P on host H "
                    "answers but is not node:2", web_server_on_node2, ("node:0", "node:1"),
                    ("answers but is not node:2", "party node:2 never came up"),
                    check=stop_web_server),
        PartiesCase("front: forged frames mid-run", "once linked, a local process sends node:1 "
                    "(the prompt owner) a chunk declaring 2^40 bytes and one at offset 2^62 "
                    "(each aborted the worker before)",
                    "the front drops them, naming the connection; the run completes (every "
                    "party exits 0)", plain_recording, ("node:0", "node:1", "node:2"), (),
                    fault=forged_frames_mid_run, fault_after="] link up", judge_exit=0,
                    check=front_dropped),
        PartiesCase("tls: one cert for all (patched)", "one CA-signed certificate (CN=imposter, "
                    "SAN IP:10.9.9.9) for all three nodes; every party's own check skipped",
                    "every party exits 3; those that saw a peer name it, the expected node and "
                    "CN='imposter' (the others see the first ones gone)",
                    tls_plan(shared_imposter=True), ("node:0", "node:1", "node:2"),
                    ("is not who the config says", "CN='imposter'", "where node 'node:"),
                    say_in="any", clock="start"),
        PartiesCase("tls: owner presents node:2's cert", "the prompt owner node:1 presents "
                    "node:2's (valid, CA-signed) certificate; its own check skipped",
                    "node:0 and node:2 exit 3 naming node:1 and CN='node:2'", swapped_owner,
                    ("node:0", "node:2"), ("party node:1 ", "CN='node:2'", "node 'node:1'"),
                    clock="start"),
        PartiesCase("tls: certificate from another CA", "node:2's certificate is signed by "
                    "another CA", "node:0 and node:1 exit 3: node:2 failed the TLS handshake",
                    tls_plan(other_ca_for="node:2"), ("node:0", "node:1"),
                    ("party node:2 ", "TLS handshake"), clock="start"),
        PartiesCase("insecure: plain TCP off loopback", 'node:1 at 10.255.255.1 (unroutable), '
                    '"insecure": true; only node:0 started',
                    "warning printed; node:0 exits 3: node:1 never came up within "
                    "connect_timeout_s=5", insecure_remote, ("node:0",),
                    ("party node:1 never came up within link.connect_timeout_s=5 s",),
                    check=warned),
        PartiesCase("fault: party never started", "3 parties, node:2 never started, "
                    "connect_timeout_s=5", "node:0 and node:1 exit 3 naming node:2 within "
                    "connect_timeout_s", plain(start=["node:0", "node:1"], connect_timeout_s=5),
                    ("node:0", "node:1"),
                    ("party node:2 never came up within link.connect_timeout_s=5 s",)),
        PartiesCase("fault: killed before link-up", "node:2 SIGKILLed 1 s after it was started "
                    "(during start-up), connect_timeout_s=5",
                    "node:0 and node:1 exit 3 naming node:2 within connect_timeout_s",
                    plain(connect_timeout_s=5), ("node:0", "node:1"),
                    ("party node:2 never came up",),
                    fault=lambda procs: (time.sleep(1.0), kill("node:2")(procs))),
        PartiesCase("fault: killed after link-up", "node:2 SIGKILLed once every party is "
                    "linked, peer_timeout_s=3", "node:0 and node:1 exit 3 naming node:2",
                    plain(peer_timeout_s=3), ("node:0", "node:1"), ("party node:2 ",),
                    fault=kill("node:2"), fault_after="] link up"),
        PartiesCase("fault: hung after link-up", "node:2 SIGSTOPped once every party is linked, "
                    "peer_timeout_s=3", "node:0 and node:1 exit 3 naming node:2",
                    plain(peer_timeout_s=3), ("node:0", "node:1"), ("party node:2 ",),
                    fault=kill("node:2", signal.SIGSTOP), fault_after="] link up"),
        PartiesCase("fault: SIGTERM to one party", "SIGTERM to node:2's supervisor once every "
                    "party is linked, peer_timeout_s=3", "node:2 kills its worker and exits 143 "
                    "saying so; node:0 and node:1 exit 3 naming node:2", plain(peer_timeout_s=3),
                    ("node:0", "node:1"), ("party node:2 ",),
                    fault=lambda procs: procs["node:2"].send_signal(signal.SIGTERM),
                    fault_after="] link up", check=stopped_by_sigterm),
        PartiesCase("fault: different job on one party", "node:2's config runs policy 'full', "
                    "the others 'mpcache'", "every party exits 3: the compiled programs' "
                    "SHA-256 differ (parties named)", other_policy, ("node:0", "node:1", "node:2"),
                    ("compiled a different",)),
        PartiesCase("wire: model owner sends a pickle", "node:0 (patched) sends a pickle that "
                    f"would run `touch {marker}` instead of its first weight share",
                    "node:1 and node:2 exit 3 naming node:0; no marker file",
                    plain(prelude={"node:0": SEND_PICKLE.format(marker=marker)}),
                    ("node:1", "node:2"), ("party node:0 sent", "weight sharing"),
                    check=no_marker),
        PartiesCase("wire: model owner sends a wrong shape", "node:0 (patched) sends its first "
                    "weight share with an extra dimension", "node:1 and node:2 exit 3 naming "
                    "node:0", plain(prelude={"node:0": SEND_WRONG_SHAPE}), ("node:1", "node:2"),
                    ("party node:0 sent", "shape")),
    ]


def _launcher_cases() -> list:
    return [
        LauncherSignalCase("launcher: SIGTERM", signal.SIGTERM, "SIGTERM to `experiments.party "
                           "--party=all` once every party is linked (16-token job)",
                           "launcher exits 143; no party process; no results.jsonl/outputs.npz"),
        LauncherSignalCase("launcher: SIGKILL (crash)", signal.SIGKILL, "SIGKILL to the "
                           "launcher once every party is linked", "no party process (they die "
                           "with it); no results.jsonl/outputs.npz"),
    ]


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


def _write(name: str, text: str) -> Callable[[pathlib.Path], None]:
    return lambda folder: (folder / name).write_text(text)


def _cli_cases() -> list:
    acc = ("--experiment=accuracy", "--model=smollm2-135m", "--num_layers=1", "--lengths=200",
           "--num_samples=1", "--policies=full", "--max_new_tokens=2")
    lb = (*acc, "--task=longbench_jsonl", "--metric=contains")
    return [
        CliCase("cli: generate ignores --task", "--experiment=generate --policies=full "
                "--task=passkey (was ignored, yet recorded)",
                ("--experiment=generate", "--policies=full", "--task=passkey"),
                ("--task is not used by --experiment=generate",)),
        CliCase("cli: generate with --policies=foo", "--experiment=generate --policies=foo "
                "(was ignored: plaintext full ran)", ("--experiment=generate", "--policies=foo"),
                ("unknown policy 'foo'",)),
        CliCase("cli: generate with two policies", "--experiment=generate --policies=full,mpcache",
                ("--experiment=generate", "--policies=full,mpcache"),
                ("runs one policy: give --policies",)),
        CliCase("cli: accuracy ignores --backend", "--experiment=accuracy --backend=xla",
                (*acc, "--backend=xla"), ("--backend is not used by --experiment=accuracy",)),
        CliCase("cli: protocol vs node config", "--backend=spu_nodes with the 2-party SEMI2K "
                "config and --protocol=ABY3 (ran SEMI2K)",
                ("--experiment=generate", "--backend=spu_nodes", "--policies=full",
                 "--node_config=experiments/nodes/2pc_semi2k.json", "--protocol=ABY3"),
                ("--protocol=ABY3 conflicts with", "which runs SEMI2K")),
        CliCase("cli: mpc_cost with an unknown policy", "--policies=full,foo (failed after "
                "costing full, leaving partial rows)",
                ("--experiment=mpc_cost", "--model=llama-tiny", "--policies=full,foo"),
                ("unknown policy 'foo'",)),
        CliCase("cli: --resume with another --seed", "a finished record made with --seed=0, "
                "then --resume --seed=1 (relabelled the old outputs)",
                (*acc, "--task=passkey", "--resume", "--seed=1", "--output_dir={dir}/old"),
                ("--resume", "--seed (0 then, 1 now)"),
                prepare=_resume_folder),
        CliCase("cli: empty LongBench file", "--data_path to an empty file (ZeroDivisionError "
                "in plotting)", (*lb, "--data_path={dir}/empty.jsonl"), ("empty.jsonl", "no samples"),
                prepare=_write("empty.jsonl", "")),
        CliCase("cli: malformed LongBench line", "line 2 of the JSONL is cut short (reported "
                "without the file and with the wrong line)",
                (*lb, "--num_samples=3", "--data_path={dir}/bad.jsonl"),
                ("bad.jsonl:2:", "not a JSON object"),
                prepare=_write("bad.jsonl", '{"context": "a", "input": "b", "answers": ["c"]}\n'
                               '{"context": "a", "input": \n')),
        CliCase("cli: --output_dir is a file", "--output_dir pointing at a file (raised after "
                "the whole run)", (*acc, "--task=passkey", "--output_dir={dir}/afile"),
                ("is a file, not a directory",), prepare=_write("afile", "x")),
        CliCase("cli: unknown model", "--model=llama-9000",
                ("--experiment=generate", "--policies=full", "--model=llama-9000"),
                ("unknown model 'llama-9000'",)),
    ]


def _resume_folder(folder: pathlib.Path) -> None:
    """An output folder holding one record made with --seed=0 (and its run_config.json)."""
    from experiments.common import config_hash
    old = folder / "old"
    old.mkdir()
    settings = {"seed": 0}
    digest = config_hash(settings)
    (old / "samples.jsonl").write_text(json.dumps(
        {"task": "passkey", "sample_id": "passkey-0", "policy": "full", "budget": 1.0,
         "config_hash": digest}) + "\n")
    (old / "run_config.json").write_text(json.dumps(settings))
    (old / "results.jsonl").write_text('{"previous": true}\n')


def all_cases() -> list:
    """Every case, fast ones first."""
    return (_wire_cases() + _front_cases() + _config_cases() + _cli_cases() + _party_cases()
            + _launcher_cases())


# ----- running and reporting ---------------------------------------------------------------------

def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(rows: list[tuple]) -> str:
    """Markdown table of (case, observed) pairs."""
    head = ("| case | what was done | observed: exit | observed: error line | time to detect "
            "| expected | result |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for case, obs in rows:
        took = "-" if obs.detect_s is None else (f"{obs.detect_s * 1000:.1f} ms"
                                                 if obs.detect_s < 0.5 else
                                                 f"{obs.detect_s:.1f} s")
        if obs.detect_s is not None and obs.detect_from:
            took += f" ({obs.detect_from})"
        result = "pass" if obs.passed else "FAIL"
        if obs.note:
            result += f" ({obs.note})"
        lines.append("| " + " | ".join(_cell(x) for x in (
            case.name, case.did, obs.exit_codes, _short(obs.error), took, case.expected,
            result)) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="results/fault_cases")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    ctx = Context(root)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    cases = [c for c in all_cases() if not wanted or any(w in c.name for w in wanted)]
    rows = []
    records = root / "fault_cases.jsonl"
    start = time.perf_counter()
    with open(records, "w") as f:
        for case in cases:
            t = time.perf_counter()
            try:
                obs = case.run(ctx)
            except Exception as err:  # noqa: BLE001 - one broken case must not hide the rest
                obs = Observed("-", f"case error: {type(err).__name__}: {err}", None, False)
            rows.append((case, obs))
            f.write(json.dumps({"case": case.name, "did": case.did, "expected": case.expected,
                                **dataclasses.asdict(obs), "case_s": time.perf_counter() - t})
                    + "\n")
            f.flush()
            took = time.perf_counter() - t
            print(f"{'pass' if obs.passed else 'FAIL'}  {case.name}  ({took:.1f} s)  "
                  f"{_short(obs.error, 160)}", flush=True)
    text = table(rows)
    passed = sum(obs.passed for _, obs in rows)
    summary = (f"{passed}/{len(rows)} cases pass ({time.perf_counter() - start:.0f} s; "
               f"`python -m experiments.fault_cases --output_dir={args.output_dir}`)")
    (root / "fault_cases.md").write_text(text + "\n\n" + summary + "\n")
    print()
    print(text)
    print()
    print(summary)
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
