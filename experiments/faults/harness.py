"""Running parties for fault cases and tests: loopback node configs, certificates made with
openssl, party processes started and killed, their logs read (shared with
tests/test_distributed.py)."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY_JOB = {"model": "llama-tiny", "num_layers": 2, "policy": "mpcache_exact", "budget": 0.5,
            # oversample 0: both levels choose (at half of 32 tokens, 2x the budget would
            # keep every coarse cluster)
            "policy_options": {"static_sinks": 4, "static_recent": 8,
                               "levels": [[8, 0.5], [4, None]], "oversample": 0},
            "seq_len": 32, "max_new_tokens": 2, "reveal_logits": False, "timeout_s": 240}

# Preludes run in a party's worker before its main (party_main; simulated hostile code).
SKIP_OWN_CERT_CHECK = ("import runtime.distributed.config as _config\n"
                       "_config.check_own_certificate = lambda *a, **k: None\n"
                       "_config.check_key_and_ca = lambda *a, **k: None\n")


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
    out/party_<tag>.log; dies with this process (process.child_env)."""
    from runtime.distributed.process import child_env
    args = [f"--node_config={config_path}", f"--party={party}", f"--output_dir={out}"]
    if prelude is None:
        cmd = [sys.executable, "-m", "experiments.party", *args]
    else:
        code = (f"{prelude}\nfrom absl import app\nfrom runtime.distributed import party_main\n"
                "app.run(party_main.main)\n")
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


# ----- what a process on the same machine sees of a party (/proc) ------------------------------

def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (from /proc/*/stat)."""
    parents: dict[int, int] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text()
                                               .rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = [root], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        tree += children
        frontier = children
    return tree


def socket_inodes(pids) -> set[int]:
    """The inodes of the sockets the processes `pids` hold open (/proc/PID/fd)."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(pathlib.Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def listening_tcp_ports(root: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening that a process of `root`'s tree holds
    (/proc/net/tcp and tcp6: state 0A), as any process on the machine can find them."""
    inodes = socket_inodes(process_tree(root))
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A" or int(fields[9]) not in inodes:
                continue
            address, port = fields[1].split(":")
            host = (".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0))
                    if width == 8 else "::")
            found.append((host, int(port, 16)))
    return sorted(set(found))


def unix_sockets(root: int) -> list[str]:
    """The paths of the Unix sockets bound by `root`'s process tree (/proc/net/unix)."""
    inodes = socket_inodes(process_tree(root))
    paths = []
    for line in pathlib.Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and int(fields[6]) in inodes and fields[7].startswith("/"):
            paths.append(fields[7])
    return sorted(set(paths))
