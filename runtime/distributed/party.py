"""One party of a secure run: link up, compile, share, generate step by step, account.

Every party runs `run_party(config, party_id)` (usually via `python -m experiments.party`).
Sequence, identical on every host (lockstep):
  1. brpc link to every other party (mutual TLS when the config gives certificates), then
     every peer's identity is checked (its certificate must name its node id and host, see
     config.py) before anything is sent;
  2. every party compiles the job's prefill and decode-step programs itself from the public
     job and the parties compare their SHA-256 (a party never runs a program it did not
     compile; `NodeBackend.compile` also refuses a program that reveals a secret mid-way);
  3. the MODEL_OWNER secret-shares the weights once, one typed message per peer and weight;
  4. the PROMPT_OWNER announces the prompt length (public) and shares its prompt; prefill
     (with the policy's static eviction) runs, then one decode program per new token: the KV
     cache stays secret-shared in every party's runtime between steps, each sampled token is
     revealed to the prompt owner only (who streams it and feeds it back as a secret one-hot)
     and the prompt owner decides, publicly, when to stop;
  5. every step's profiled cost is exchanged (public); after every party confirmed success,
     the PROMPT_OWNER writes results.jsonl and outputs.npz (atomically).
Nothing received from a peer is deserialized into objects (`wire`: typed, checked messages);
a malformed message ends the run naming its sender. From start-up on (Watchdog): a peer that
does not come up within `link.connect_timeout_s` of this party starting its link, fails the
TLS handshake or presents another node's certificate, or (once up) is dead, hung or
unreachable for `link.peer_timeout_s`, ends this party with a message naming it; link errors
are explained by probing every peer (`blame`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time
from typing import Any

import jax
import numpy as np

from models import registry
from models.model import Model
from runtime.distributed.certs import identity_mismatch, tls_context
from runtime.distributed.bounds import FIELD_BYTES, SHARES_PER_PARTY, check_job_bounds
from runtime.distributed.config import NodeConfig, NodeConfigError, is_loopback, node_tag
from runtime.distributed import costs, frames, job as job_lib, wire
from runtime.distributed.rules import FORGED

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG, EXIT_PEER = 0, 1, 2, 3
LINGER_S = 1.0


class PartyFailure(RuntimeError):
    """Another party died, hung, could not be reached or misbehaved; `party` names it."""

    def __init__(self, party: str | None, message: str):
        super().__init__(message)
        self.party = party


def log(party_id: str, message: str) -> None:
    print(f"[party {party_id}] {message}", file=sys.stderr, flush=True)


# ----- link ---------------------------------------------------------------------------------

LINK_ID = "run"


def link_desc(config: NodeConfig, party_id: str, link_id: str, recv_timeout_s: float,
              front: "FrontHandle | None" = None):
    """spu.link.Desc for this config.

    With this party's `front` (the default path, see front.py): brpc listens on a Unix socket
    in the party's private directory (`unix:PATH`, mode 0700: no TCP port of brpc's), behind
    the front; it connects to each peer's front (under TLS, or to remote peers in plain TCP,
    through the front's Unix socket for that peer in the same directory, which serves this
    process only, does the TLS and checks the peer's identity), so brpc itself never listens
    on TCP. Without a front (tests of the bare link only): every party at its public address,
    TLS options from the config.

    brpc keeps retrying the connection to a peer for connect_retry_times x
    connect_retry_interval_ms; raised here to outlast link.connect_timeout_s, so that the
    Watchdog (which names the peer) decides when a peer is late, not brpc."""
    from spu import link
    desc = link.Desc()
    desc.id = f"{config.id}.{link_id}"
    for pid, address in config.parties:
        if front is not None and pid == party_id:
            address = f"unix:{front.backend}"
        elif front is not None and pid in front.outbound:
            address = f"unix:{front.outbound[pid]}"
        desc.add_party(pid, address)
    opts = config.link
    desc.recv_timeout_ms = int(recv_timeout_s * 1000)
    interval_ms = opts.connect_retry_interval_ms
    # Each failed attempt also waits up to 12 s (yacl's cyclic 2-12 s HTTP timeout) when the
    # peer's port is open but silent; counting only the interval keeps this an upper bound.
    needed = math.ceil((opts.connect_timeout_s + 30) * 1000 / interval_ms)
    desc.connect_retry_times = max(opts.connect_retry_times, needed)
    desc.connect_retry_interval_ms = interval_ms
    desc.http_timeout_ms = opts.http_timeout_ms
    if opts.tls is not None and front is None:
        mine = opts.tls.certs[party_id]
        desc.enable_ssl = True
        # Both directions: servers verify clients and clients verify servers (mutual TLS, CA
        # only: brpc has no per-peer identity check; `probe` checks identities).
        for side in (desc.server_ssl_opts, desc.client_ssl_opts):
            side.cert.certificate_path = mine.cert
            side.cert.private_key_path = mine.key
            side.verify.ca_file_path = opts.tls.ca
            side.verify.verify_depth = opts.tls.verify_depth
    return desc


# ----- the party's private directory ---------------------------------------------------------

# Set by the supervisor for its worker: the private directory it made (and removes after).
PRIVATE_DIR_ENV = "MPCACHE_PRIVATE_DIR"


def make_private_dir(party_id: str) -> str:
    """A new directory that only this user may enter (mode 0700), for the party's Unix sockets
    (brpc's, the front's outbound ones); under $TMPDIR, or /tmp when that is too long for a
    socket's path (107 bytes, with room for a node id's socket name)."""
    import tempfile
    prefix = f"mpcache-{node_tag(party_id)[:16]}-"
    base = tempfile.gettempdir()
    if len(base) + len(prefix) + 8 + len("/to_.sock") + 64 > 107:
        base = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def remove_private_dir(path: str | None) -> None:
    import shutil
    if path:
        shutil.rmtree(path, ignore_errors=True)


# The private directory this worker made itself (no supervisor made one): removed on exit.
_OWN_PRIVATE_DIR: list[str] = []


def exit_now(code: int) -> None:
    """Leave the process at once (os._exit: the link's threads may be blocked), removing the
    private directory this worker made for itself (a supervisor removes the one it made)."""
    for path in _OWN_PRIVATE_DIR:
        remove_private_dir(path)
    os._exit(code)


# ----- the front door (front.py) -------------------------------------------------------------

class AddressInUse(RuntimeError):
    """This party's own public port is taken by another process (exit 2)."""


@dataclasses.dataclass
class FrontHandle:
    """A running front process: the Unix socket brpc listens on behind it, the front's Unix
    socket per peer for brpc's outgoing connections (outbound side only), its events file."""

    proc: Any
    backend: str
    outbound: dict[str, str]
    events_path: pathlib.Path

    def stats(self) -> dict:
        """{"frames", "bytes" (relayed to brpc so far), "cpu_s" (the front's CPU)}; {} if the
        front does not answer."""
        try:
            self.proc.stdin.write(b"stats\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())
        except (BrokenPipeError, OSError, ValueError):
            return {}

    def set_cap(self, max_message_bytes: int) -> None:
        """A new cap on a message's declared length (once the prompt length is public)."""
        try:
            self.proc.stdin.write(f"cap {int(max_message_bytes)}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass


# A party's log line per generation step: what its front relayed (`run_party`).
FRONT_STEP = "front step "


def front_steps(log_text: str) -> list[dict]:
    """The `front step` records of a party's log, in order: {"phase", "position", "frames",
    "bytes", "cpu_s", "max_message_so_far", "most_unread_so_far"}."""
    return [json.loads(line.split(FRONT_STEP, 1)[1]) for line in log_text.splitlines()
            if FRONT_STEP in line]


def check_own_port(config: NodeConfig, party_id: str) -> None:
    """Raise AddressInUse (exit 2, at once) if `party_id`'s public port cannot be bound now
    (another process holds it). The front binds it for real moments later."""
    import errno
    import socket
    host, _, port = config.address(party_id).rpartition(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise AddressInUse(f"address in use: {party_id}'s link port {host}:{port} is "
                                   "taken by another process; stop it or give "
                                   f"nodes[{party_id!r}] another port") from None
            raise AddressInUse(f"{party_id} cannot listen on {host}:{port} ({err.strerror}): "
                               f"is {host} an address of this machine? fix "
                               f"nodes[{party_id!r}]") from None


def hello_key(config: NodeConfig) -> bytes:
    """The key of the fronts' hello: SHA-256 of the node config's public identity (id, nodes
    in rank order, runtime config). Every party of the same config has it; a process that is
    not one of this config's fronts cannot answer the hello (frames.hello_answer)."""
    import hashlib
    public = {"id": config.id, "parties": [list(p) for p in config.parties],
              "runtime": config.mpc.runtime_json()}
    return hashlib.sha256(json.dumps(public, sort_keys=True).encode()).digest()


# A frame's body is one chunk of at most the link's http_max_payload_size (1 MiB in SPU
# 0.9.5's Desc) plus its key and protobuf framing.
FRAME_SLACK_BYTES = 64 << 10
MESSAGE_SLACK_BYTES = 1 << 20
# yacl's sender waits once `throttle_window_size` (10 in SPU 0.9.5's Desc) of its messages are
# unread by the receiver; the front allows this many more before it blames the peer.
UNREAD_SLACK_MESSAGES = 2


def message_cap_bytes(config: NodeConfig, prompt_len: int | None = None) -> int:
    """The most bytes one message of this job may declare (front.py refuses larger ones).

        cap = 1 MiB + b * max(largest weight, T*V, 4 * max(H*T*(T+N), T*F, V))

    b = field bytes x shares per party (ABY3 FM64: 16), T = the prompt length (job.seq_len
    until the prompt owner announces it), N = max_new_tokens. The largest weight (the model
    owner's share of it is one typed message) and the prompt's secret one-hot rows [T, V]
    (one message from the prompt owner) are sent whole; inside a program the largest value
    (prefill attention scores of one layer over the heads [H, T, T+N], its MLP activations
    [T, F], the logits [V]) x4 for kernels that send more than one ring element per value
    (bit-decomposed comparisons, OT-based conversions); 1 MiB for the typed header. A bound
    from the job's shapes, not the exact largest message of the compiled programs."""
    job = config.job
    cfg = registry.get_config(job.model, num_layers=job.num_layers)
    largest_weight = max(int(math.prod(leaf.shape)) for leaf in
                         jax.tree_util.tree_leaves(Model(cfg).param_shapes()))
    T = job.seq_len if prompt_len is None else prompt_len
    N = job.max_new_tokens
    b = FIELD_BYTES.get(config.mpc.field, 8) * SHARES_PER_PARTY.get(config.mpc.protocol, 2)
    values = max(largest_weight, T * cfg.vocab_size,
                 4 * max(cfg.num_heads * T * (T + N), T * cfg.intermediate_size,
                         cfg.vocab_size))
    return MESSAGE_SLACK_BYTES + b * values


def front_spec(config: NodeConfig, party_id: str, events_path: pathlib.Path,
               private_dir: str = "", worker_pid: int = 0):
    """This party's front_state.FrontSpec from the config (`private_dir`: where its Unix sockets
    go; `worker_pid`: the process its outbound sockets serve)."""
    from runtime.distributed.front_state import FrontSpec
    host, _, port = config.address(party_id).rpartition(":")
    tls = config.link.tls
    cap = message_cap_bytes(config)
    shape = config.link.shape
    import spu.libspu.link as _link
    desc = _link.Desc()
    frame = int(desc.http_max_payload_size) + FRAME_SLACK_BYTES
    window = int(desc.throttle_window_size)
    return FrontSpec(
        party=party_id, rank=config.rank(party_id), listen_host=host, listen_port=int(port),
        link_id=f"{config.id}.{LINK_ID}",
        peers={pid: {"rank": config.rank(pid), "host": addr.rpartition(":")[0],
                     "address": addr} for pid, addr in config.parties if pid != party_id},
        hello_key=hello_key(config).hex(), max_frame_bytes=frame, max_message_bytes=cap,
        max_buffered_bytes=2 * cap, events_path=str(events_path), private_dir=private_dir,
        worker_pid=worker_pid, max_unread_messages=window + UNREAD_SLACK_MESSAGES if window else 0,
        # Plain TCP to a remote peer (link.insecure): brpc's outgoing connections pass the
        # front too, which reads this party's acknowledgements (the unread bound). Loopback
        # configs skip that hop (its cost: docs/results.md "The front door").
        relay_outbound=tls is None and any(not is_loopback(addr.rpartition(":")[0])
                                           for _, addr in config.parties),
        tls=None if tls is None else {"ca": tls.ca, "cert": tls.certs[party_id].cert,
                                      "key": tls.certs[party_id].key,
                                      "verify_depth": tls.verify_depth},
        delay_s=shape.delay_ms / 1000 if shape else 0.0,
        rate_bytes_s=shape.rate_mb_s * 1e6 if shape and shape.rate_mb_s else None)


def front_events_path(output_dir, party_id: str) -> pathlib.Path:
    return pathlib.Path(output_dir) / f"front_{node_tag(party_id)}.jsonl"


# Benchmarks only (`experiments.front_cost --floor`): a program started in the front's place,
# with the same argument and start-up line (experiments/bare_relay.c: a relay with no checks);
# refused under TLS and with remote peers (it has no outbound side).
FRONT_PROGRAM_ENV = "MPCACHE_FRONT_PROGRAM"


def start_front(config: NodeConfig, party_id: str, output_dir,
                private_dir: str | None = None) -> FrontHandle:
    """Start this party's front (a child process that dies with this one) and wait until it
    listens -> FrontHandle. `private_dir`: the party's private directory (a new one if None;
    see make_private_dir). Raises AddressInUse when the public port is taken."""
    import subprocess
    from runtime.distributed import front as front_mod
    from runtime.distributed.launch import child_env
    events = front_events_path(output_dir, party_id)
    events.write_text("")
    spec = front_spec(config, party_id, events, private_dir or make_private_dir(party_id),
                      os.getpid())
    program = [sys.executable, front_mod.__file__]
    stand_in = os.environ.get(FRONT_PROGRAM_ENV)
    if stand_in:
        if spec.tls is not None or spec.relay_outbound:
            raise RuntimeError(f"{FRONT_PROGRAM_ENV} is set: a stand-in front is for plain-TCP "
                               "loopback benchmarks only; unset it for a TLS run or remote "
                               "peers")
        print(f"[party {party_id}] front: {FRONT_PROGRAM_ENV}={stand_in} replaces the front "
              "(benchmarks only: no frame is checked)", file=sys.stderr, flush=True)
        program = [stand_in]
    proc = subprocess.Popen(program + [spec.to_json()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env())
    line = proc.stdout.readline().decode(errors="replace").strip()
    try:
        answer = json.loads(line) if line else {"error": "the front exited before listening",
                                                "kind": "front"}
    except json.JSONDecodeError:
        answer = {"error": f"the front said {line[:200]!r}", "kind": "front"}
    if not answer.get("ready"):
        proc.kill()
        proc.wait()
        address = config.address(party_id)
        if answer.get("kind") == "address in use":
            raise AddressInUse(f"address in use: {party_id}'s link port {address} is taken by "
                               "another process; stop it or give "
                               f"nodes[{party_id!r}] another port")
        raise RuntimeError(f"{party_id}'s front could not listen on {address}: "
                           f"{answer.get('error')}")
    if answer.get("program") == "fast_front":
        print(f"[party {party_id}] front: the front in C (fast_front.c) serves {spec.listen_host}:"
              f"{spec.listen_port}", file=sys.stderr, flush=True)
    return FrontHandle(proc, str(answer["backend"]),
                       {k: str(v) for k, v in answer.get("outbound", {}).items()}, events)


def front_events(path: pathlib.Path, since: int = 0) -> tuple[list[dict], int]:
    """The front's JSON event lines after byte offset `since` -> (events, new offset)."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            data = f.read()
    except OSError:
        return [], since
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].splitlines():
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, since + end


def failing_peer(config: NodeConfig, my_rank: int, err: BaseException) -> str | None:
    """The party an SPU/yacl link error points at (`rank=N`, or the other end of `a->b`)."""
    text = str(err)
    m = re.search(r"rank=(\d+)", text) or re.search(r"key=connect_(\d+)", text)
    if m:
        rank = int(m.group(1))
    else:
        m = re.search(r"(\d+)->(\d+)", text)
        if not m:
            return None
        src, dst = int(m.group(1)), int(m.group(2))
        rank = src if dst == my_rank else dst
    return config.party_ids[rank] if 0 <= rank < config.world_size else None


# Probe states. Up: ALIVE. Down: REFUSED (nothing listens), SILENT (no answer). TLS faults:
# TLS_REFUSED (the peer aborted the handshake: it does not accept this party's certificate, or
# does not speak TLS), UNTRUSTED (the peer's certificate does not chain to link.tls.ca),
# IMPOSTOR (a CA-signed certificate for another node, by the identity rule in config.py).
# FOREIGN: something answers on the peer's port, but not the hello of this config's front.
ALIVE, REFUSED, SILENT, FOREIGN = "alive", "refused", "silent", "foreign"
TLS_REFUSED, UNTRUSTED, IMPOSTOR = "tls-refused", "untrusted", "impostor"
DOWN = (REFUSED, SILENT)
TLS_FAULTS = (TLS_REFUSED, UNTRUSTED, IMPOSTOR)


@dataclasses.dataclass(frozen=True)
class Probe:
    """One probe of a peer's link endpoint: its state and, for TLS faults, why."""

    state: str
    detail: str = ""


def probe(config: NodeConfig, party_id: str, peer: str, timeout_s: float = 2.0) -> Probe:
    """Is `peer`'s link endpoint up, and is it `peer`'s front?

    Connects to the endpoint; under TLS completes a handshake with this party's own
    certificate and the config's CA and checks the peer's certificate by the identity rule
    (certs.identity_mismatch); then sends the fronts' hello (a fresh nonce) and checks the
    answer is `peer`'s (frames.check_hello_reply, keyed by the config's hash). Anything else
    that answers (a web server, another program, another config's party) is FOREIGN."""
    import socket
    import ssl
    host, _, port = config.address(peer).rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except ConnectionRefusedError:
        return Probe(REFUSED)
    except OSError:
        return Probe(SILENT)
    stage = "connect"
    try:
        if config.link.tls is not None:
            stage = "handshake"
            tls = config.link.tls
            sock = tls_context(tls.ca, tls.certs[party_id].cert,
                               tls.certs[party_id].key).wrap_socket(sock)
            why = identity_mismatch(sock.getpeercert(), peer, host)
            if why:
                return Probe(IMPOSTOR, why)
            stage = "first read"
        nonce = os.urandom(frames.HELLO_NONCE_BYTES)
        sock.sendall(frames.hello_request(nonce))
        reply = b""
        want = len(frames.HELLO_MAGIC) + 32
        while len(reply) < want:
            got = sock.recv(want - len(reply))
            if not got:
                break
            reply += got
        if frames.check_hello_reply(reply, hello_key(config), nonce, peer):
            return Probe(ALIVE)
        if not reply and stage == "first read":
            return _closed_after_handshake()
        if not reply:
            return Probe(REFUSED)     # closed without a word: going away
        return Probe(FOREIGN, f"it answered the project's hello with {reply[:24]!r}")
    except ssl.SSLCertVerificationError as err:
        return Probe(UNTRUSTED, f"its certificate does not verify against link.tls.ca="
                                f"{config.link.tls.ca} ({err.verify_message})")
    except ssl.SSLError as err:
        # TLS 1.3: a server that rejects the client's certificate says so after the client's
        # side of the handshake, at the first read.
        return Probe(TLS_REFUSED, f"it aborted the TLS {stage} ({err.reason or err}): it does "
                                  "not accept this party's certificate (another CA?), does not "
                                  "speak TLS, or stopped during the handshake")
    except ConnectionError:
        return _closed_after_handshake() if stage == "first read" else Probe(REFUSED)
    except OSError:
        return Probe(SILENT)
    finally:
        sock.close()


def _closed_after_handshake() -> Probe:
    # TLS 1.3: the client's side of the handshake completes before the server has checked
    # the client's certificate; a front that refuses it closes the connection.
    return Probe(TLS_REFUSED, "it closed the connection at the end of the TLS handshake: it "
                              "does not accept this party's certificate (another CA?)")


def probe_peers(config: NodeConfig, party_id: str) -> dict[str, Probe]:
    """Probe every other party at once -> {party: Probe}."""
    from concurrent.futures import ThreadPoolExecutor
    peers = [p for p in config.party_ids if p != party_id]
    with ThreadPoolExecutor(len(peers)) as pool:
        return dict(zip(peers, pool.map(lambda p: probe(config, party_id, p), peers)))


_DOWN_WORDS = {REFUSED: "is down (its link endpoint refuses connections)",
               SILENT: "does not respond (hung, stopped or cut off)"}


def _summary(states: dict[str, Probe]) -> str:
    return ", ".join(f"{p} {s.state}" for p, s in states.items())


def tls_fault_message(config: NodeConfig, peer: str, result: Probe) -> str:
    """The error for a TLS fault of `peer`; names the peer (and under IMPOSTOR both names)."""
    address = config.address(peer)
    if result.state == IMPOSTOR:
        return (f"party {peer} at {address} is not who the config says: {result.detail}; "
                "refusing to exchange anything with it (each node's certificate must have "
                "CN = its node id and a subjectAltName for its host)")
    if result.state == UNTRUSTED:
        return f"party {peer} at {address} failed the TLS handshake: {result.detail}"
    return f"party {peer} at {address} refused the TLS handshake: {result.detail}"


def foreign_message(config: NodeConfig, peer: str, result: Probe) -> str:
    """The error for a FOREIGN probe of `peer`: its port answers, but not as its front."""
    host, _, port = config.address(peer).rpartition(":")
    return (f"party {peer} never came up: port {port} on host {host} answers but is not "
            f"{peer} ({result.detail}); another program holds that port, or nodes[{peer!r}] "
            "names the wrong address")


def front_offences(config: NodeConfig, events_path: pathlib.Path | None,
                   authenticated_only: bool) -> list[dict]:
    """The front's dropped frames / refused connections attributed to a peer node (under TLS
    the node is the client certificate's; in plain TCP the rank a frame claimed)."""
    if events_path is None:
        return []
    events, _ = front_events(events_path)
    if authenticated_only and config.link.tls is None:
        return []
    # Dropped frames only: a refused server or client certificate is named by the probes'
    # identity check (tls_fault_message), with both names.
    return [e for e in events if e.get("node") in config.party_ids
            and str(e.get("kind", "")).startswith("dropped")]


def flood_message(events_path: pathlib.Path | None) -> str | None:
    """'127.0.0.1 held 260 connections without a hello ...' for the source address whose
    connections this party's front closed without a hello the most (their events count them),
    None if there were none."""
    if events_path is None:
        return None
    events, _ = front_events(events_path)
    held: dict[str, int] = {}
    why: dict[str, str] = {}
    for e in events:
        if e.get("kind") == "closed a connection without a hello":
            source = str(e.get("source") or str(e.get("address", "?")).rpartition(":")[0])
            count = e.get("connections", 1)
            count = count if isinstance(count, int) else 1
            held[source] = held.get(source, 0) + count
            if count == 1:
                why[source] = str(e.get("why", ""))
    if not held:
        return None
    source, n = max(held.items(), key=lambda kv: kv[1])
    return (f"{source} held {n} connection{'s' if n != 1 else ''} without a hello at this "
            f"party's front, which closed them (the last: {why.get(source, '?')})")


def anonymous_drops(events_path: pathlib.Path | None) -> list[dict]:
    """Frames this party's front dropped without naming the connection's node (the fault
    was another connection's: its `why` names it)."""
    if events_path is None:
        return []
    events, _ = front_events(events_path)
    return [e for e in events if e.get("node") is None
            and str(e.get("kind", "")).startswith("dropped")]


def forged_messages(events_path: pathlib.Path | None) -> list[dict]:
    """The front's events of a message number that came twice under different keys (two
    senders claim one rank; yacl kept the first)."""
    if events_path is None:
        return []
    return [e for e in front_events(events_path)[0] if e.get("kind") == FORGED]


def forged_message(event: dict) -> str:
    return (f"this party's front dropped a forged message from {event['address']}: "
            f"{event['why']}; the peer's messages can no longer be told from a forger's, so "
            "this party stops (in plain TCP any process on this machine can claim a rank: "
            "use link.tls)")


def offence_message(config: NodeConfig, event: dict) -> str:
    how = ("" if config.link.tls is not None
           else " (plain TCP: the rank it claimed, not proven)")
    return (f"party {event['node']}{how} sent bytes this party's front refused: "
            f"{event['why']}; the front {event['kind']} ({event['address']})")


def blame(config: NodeConfig, party_id: str, suspect: str | None,
          events_path: pathlib.Path | None = None) -> tuple[str | None, str]:
    """The failed party and why, from the peer a link error points at and a probe of all
    peers: a peer that is gone, silent or fails TLS is the cause even when the error points
    elsewhere (a live peer that stopped sending was itself waiting on the failed one)."""
    states = probe_peers(config, party_id)
    tls_bad = [p for p in config.party_ids if states.get(p, Probe(ALIVE)).state in TLS_FAULTS]
    if tls_bad:
        culprit = suspect if suspect in tls_bad else tls_bad[0]
        return culprit, (f"{tls_fault_message(config, culprit, states[culprit])} "
                         f"[probe: {_summary(states)}]")
    foreign = [p for p in config.party_ids if states.get(p, Probe(ALIVE)).state == FOREIGN]
    if foreign:
        culprit = suspect if suspect in foreign else foreign[0]
        return culprit, (f"{foreign_message(config, culprit, states[culprit])} "
                         f"[probe: {_summary(states)}]")
    offences = front_offences(config, events_path, authenticated_only=False)
    if offences:
        last = offences[-1]
        return last["node"], f"{offence_message(config, last)} [probe: {_summary(states)}]"
    # Not a peer's doing: a message forged under a peer's rank, connections that never said
    # hello, frames dropped because of what another connection holds. No peer is named.
    forged = forged_messages(events_path)
    if forged:
        return None, f"{forged_message(forged[0])} [probe: {_summary(states)}]"
    flood = flood_message(events_path)
    if flood:
        return None, f"{flood}; the link failed meanwhile [probe: {_summary(states)}]"
    drops = anonymous_drops(events_path)
    if drops:
        return None, (f"this party's front dropped a frame from {drops[-1]['address']}: "
                      f"{drops[-1]['why']} [probe: {_summary(states)}]")
    down = [p for p in config.party_ids if states.get(p, Probe(ALIVE)).state in DOWN]
    if down:
        culprit = suspect if suspect in down else down[0]
        return culprit, (f"party {culprit} {_DOWN_WORDS[states[culprit].state]} "
                         f"[probe: {_summary(states)}]")
    if suspect is None:
        return None, f"every peer answers a probe [{_summary(states)}]"
    return suspect, (f"party {suspect} sent nothing for link.recv_timeout_s="
                     f"{config.link.recv_timeout_s:g} s or dropped the connection, yet its "
                     f"endpoint answers [probe: {_summary(states)}]")


def explain_link_error(config: NodeConfig, party_id: str, stage: str,
                       err: BaseException, events_path: pathlib.Path | None = None
                       ) -> PartyFailure:
    """A PartyFailure naming the party a link error is due to (see `blame`)."""
    peer = failing_peer(config, config.rank(party_id), err)
    first = str(err).strip().splitlines()
    detail = " ".join(line.strip() for line in first[:2])[:300]
    culprit, why = blame(config, party_id, peer, events_path)
    if stage == "link setup" and culprit is not None and culprit == peer and "answers" in why:
        why = (f"party {peer} could not be reached at {config.address(peer)} within "
               f"link.recv_timeout_s={config.link.recv_timeout_s:g} s: is it running, is "
               "the port open, do the TLS certificates match?")
    return PartyFailure(culprit, f"{why} [during {stage}; {detail}]")


def verify_peers(config: NodeConfig, party_id: str) -> None:
    """Every peer's endpoint answers and (under TLS) proves to be the node the config names;
    raises PartyFailure naming the first that does not. Called after link-up and before the
    first share is sent."""
    states = probe_peers(config, party_id)
    for peer, result in states.items():
        if result.state in TLS_FAULTS:
            raise PartyFailure(peer, f"{tls_fault_message(config, peer, result)} "
                                     f"[during link setup; probe: {_summary(states)}]")
    for peer, result in states.items():
        if result.state == FOREIGN:
            raise PartyFailure(peer, f"{foreign_message(config, peer, result)} "
                                     f"[during link setup; probe: {_summary(states)}]")
        if result.state != ALIVE:
            raise PartyFailure(peer, f"party {peer} {_DOWN_WORDS[result.state]} right after "
                                     f"link-up [probe: {_summary(states)}]")


class Channel:
    """Byte messages between parties over the brpc link; errors name the failing peer."""

    def __init__(self, config: NodeConfig, party_id: str, ctx,
                 events_path: pathlib.Path | None = None):
        self.config, self.party_id, self.ctx = config, party_id, ctx
        self.rank = config.rank(party_id)
        self.events_path = events_path

    def _guard(self, stage: str, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as err:
            raise explain_link_error(self.config, self.party_id, stage, err,
                                     self.events_path) from None

    def send(self, peer: str, payload: bytes, stage: str) -> None:
        self._guard(stage, self.ctx.send, self.config.rank(peer), payload)

    def recv(self, peer: str, stage: str) -> bytes:
        return self._guard(stage, self.ctx.recv, self.config.rank(peer))

    def all_gather(self, payload: str, stage: str) -> list[str]:
        got = self._guard(stage, self.ctx.all_gather, payload)
        return [g.decode() if isinstance(g, bytes) else g for g in got]


def connect(config: NodeConfig, party_id: str, front: FrontHandle | None = None) -> Channel:
    """The brpc link to every peer, behind this party's `front` (blocks until all are
    connected; the Watchdog bounds the wait by link.connect_timeout_s)."""
    from spu import link
    try:
        ctx = link.create_brpc(link_desc(config, party_id, LINK_ID, config.link.recv_timeout_s,
                                         front), config.rank(party_id))
    except RuntimeError as err:
        raise explain_link_error(config, party_id, "link setup", err,
                                 front and front.events_path) from None
    return Channel(config, party_id, ctx, front and front.events_path)


class Watchdog:
    """Probes every peer once a second from a daemon thread, from this party's start-up to the
    end of the run, and ends the party (exit 3, one `error:` line naming the peer):

    - from start-up on (this party's front serves its endpoint), a TLS fault of a peer: another
      node's certificate, an untrusted certificate, a refused handshake. The party then keeps
      its endpoint up for TLS_LINGER_S before leaving, so the faulty peer can observe the
      refusal too and name this party, instead of finding it gone;
    - from `begin_link()` on, a peer not seen up within `link.connect_timeout_s` ("never came
      up");
    - a peer seen up that then stays down (refused or silent) for `link.peer_timeout_s`;
    - a peer whose port answers, but not the hello of its front (FOREIGN: another program on
      its port): reported at link.connect_timeout_s as "port P on host H answers but is not
      node:N" (never as a hang);
    - under TLS, a frame or connection this party's front refused from a peer whose
      certificate identified it (`front_events_path`): at once, naming that peer (in plain
      TCP a frame's rank is only a claim: such events are kept for `blame`, the run goes on).

    The link alone cannot tell who failed: in a ring protocol every live party is blocked on
    a neighbour, so the first receive timeout often points at a live peer that is itself
    waiting on the dead one. A probe answered by a blocked-but-alive peer clears it."""

    TLS_LINGER_S = 3.0

    def __init__(self, config: NodeConfig, party_id: str, interval_s: float = 1.0,
                 events_path: pathlib.Path | None = None):
        import threading
        self.config, self.party_id, self.interval_s = config, party_id, interval_s
        self.events_path = events_path
        self.stage = "start-up"
        self.link_started: float | None = None
        self.seen_up: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def begin_link(self) -> None:
        """This party now waits for its peers: each has link.connect_timeout_s to come up."""
        self.link_started = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _fail(self, message: str, linger_s: float = 0.0) -> None:
        if self._stop.is_set():
            return
        print(f"[party {self.party_id}] error: {message}", file=sys.stderr, flush=True)
        if linger_s:
            time.sleep(linger_s)
        exit_now(EXIT_PEER)  # the link threads may be blocked: leave at once

    def _loop(self) -> None:
        down_since: dict[str, float] = {}
        link = self.config.link
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            states = probe_peers(self.config, self.party_id)
            linking = self.link_started is not None
            # A peer failing the identity rule is the cause even when this party's front has
            # already dropped frames from a connection using its (or another's) certificate.
            for peer, result in states.items():
                if result.state in TLS_FAULTS:
                    self._fail(f"{tls_fault_message(self.config, peer, result)} "
                               f"[probe: {_summary(states)}; during {self.stage}]",
                               linger_s=self.TLS_LINGER_S)
            forged = forged_messages(self.events_path)
            if forged:
                self._fail(f"{forged_message(forged[0])} [during {self.stage}]",
                           linger_s=self.TLS_LINGER_S)
            offences = front_offences(self.config, self.events_path, authenticated_only=True)
            if offences:
                self._fail(f"{offence_message(self.config, offences[0])} "
                           f"[during {self.stage}]", linger_s=self.TLS_LINGER_S)
            for peer, result in states.items():
                where = f"[probe: {_summary(states)}; during {self.stage}]"
                if result.state == FOREIGN and peer not in self.seen_up:
                    if linking and now - self.link_started >= link.connect_timeout_s:
                        self._fail(f"{foreign_message(self.config, peer, result)} (within "
                                   f"link.connect_timeout_s={link.connect_timeout_s:g} s) "
                                   f"{where}")
                    continue
                if result.state == FOREIGN:
                    result = Probe(REFUSED)
                if result.state == ALIVE:
                    self.seen_up.add(peer)
                    down_since.pop(peer, None)
                    continue
                if result.state in TLS_FAULTS:
                    # This party's front serves its endpoint from start-up on, so a peer that
                    # fails TLS is named at once (it can see this party's refusal too).
                    self._fail(f"{tls_fault_message(self.config, peer, result)} {where}",
                               linger_s=self.TLS_LINGER_S)
                    continue
                if peer not in self.seen_up:
                    waited = None if not linking else now - self.link_started
                    if waited is not None and waited >= link.connect_timeout_s:
                        how = ("refuses connections" if result.state == REFUSED
                               else "does not answer")
                        self._fail(f"party {peer} never came up within link.connect_timeout_s="
                                   f"{link.connect_timeout_s:g} s (its endpoint "
                                   f"{self.config.address(peer)} {how}: is it started, is the "
                                   "address right, is it still loading? raise "
                                   f"link.connect_timeout_s if it needs longer) {where}")
                    continue
                down_since.setdefault(peer, now)
                if now - down_since[peer] >= link.peer_timeout_s:
                    self._fail(f"party {peer} {_DOWN_WORDS[result.state]} for "
                               f"{link.peer_timeout_s:g} s {where}")


# ----- logging / profile --------------------------------------------------------------------

def setup_spu_log(path: pathlib.Path) -> None:
    """Route this process's SPU log (per-op profile, link totals) to `path`."""
    import spu.libspu as libspu
    opts = libspu.logging.LogOptions()
    opts.enable_console_logger = False
    opts.system_log_path = str(path)
    libspu.logging.setup_logging(opts)


def spu_log_path(output_dir: str | os.PathLike, party_id: str) -> pathlib.Path:
    return pathlib.Path(output_dir) / f"spu_{node_tag(party_id)}.log"


# ----- the run ------------------------------------------------------------------------------

def write_atomically(path: pathlib.Path, write) -> None:
    """write(tmp_path), then rename over `path` (readers never see a partial file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def run_party(config: NodeConfig, party_id: str, output_dir: str | os.PathLike,
              prompt_file: str | None = None) -> dict | None:
    """Run this party's side of the job. Returns the summary record on the prompt owner (its
    per-step records go to `output_dir/results.jsonl`, tokens to `output_dir/outputs.npz`),
    None elsewhere. Raises PartyFailure naming the peer when another party fails."""
    from runtime.distributed.node_backend import NodeBackend, ProgramMismatch
    from runtime.mpc.backends import CLIENT
    from runtime.mpc.secure import SecureSession

    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = spu_log_path(out, party_id)
    setup_spu_log(log_path)
    is_model, is_client = party_id == config.model_owner, party_id == config.prompt_owner
    job = config.job
    if prompt_file is not None and not is_client:
        raise ValueError(f"--prompt_file is the prompt owner's ({config.prompt_owner}) input")
    if prompt_file is not None and job.prefill == "clear":
        raise ValueError("job.prefill=\"clear\" makes the prompt public (the model owner "
                         "prefills it in plaintext); a --prompt_file is private input: use "
                         "job.prompt_ids or the random prompt, or job.prefill=\"secure\"")
    # The front door first: a busy own port is an operator's error (AddressInUse, exit 2),
    # found before anything slow.
    # brpc's and the front's Unix sockets: in the directory the supervisor made (it removes
    # it after this process), else in one of this process's own.
    private_dir = os.environ.pop(PRIVATE_DIR_ENV, None)
    if not private_dir:
        import atexit
        private_dir = make_private_dir(party_id)
        _OWN_PRIVATE_DIR.append(private_dir)
        atexit.register(remove_private_dir, private_dir)
    front = start_front(config, party_id, out, private_dir)
    # From the first second: TLS faults of any peer end this party at once; peers get
    # link.connect_timeout_s from begin_link() to come up (Watchdog).
    watchdog = Watchdog(config, party_id, events_path=front.events_path).start()
    warn_if_insecure(config, party_id)
    parent = os.getppid()
    model, policy = job_lib.build(job)
    t_start = time.perf_counter()
    # Private inputs first: a bad one fails here, before any peer waits on this party.
    params = job_lib.load_weights(job) if is_model else job_lib.weight_shapes(job)
    # A clear prefill's prompt is public: every party draws it (job_lib.load_prompt).
    prompt_ids, stop_ids = (job_lib.load_prompt(job, prompt_file)
                            if is_client or job.prefill == "clear" else (None, ()))

    watchdog.stage = "link setup"
    log(party_id, f"linking to {[p for p in config.party_ids if p != party_id]} "
                  f"(link.connect_timeout_s={config.link.connect_timeout_s:g} s)")
    watchdog.begin_link()
    chan = connect(config, party_id, front)
    verify_peers(config, party_id)   # nothing is sent before every peer proved who it is
    log(party_id, f"link up ({config.world_size} parties, "
                  f"{'TLS, peer identities checked' if config.link.tls else 'plain TCP'})")
    backend = NodeBackend(config, party_id, chan, log_path)

    def stage(name):
        watchdog.stage = backend.stage = name
    try:
        stage("weight sharing")
        session = SecureSession(backend, model, params, policy)
        t_weights = time.perf_counter()
        stage("prompt length")
        T = backend.agree(len(prompt_ids) if is_client else None, owner=CLIENT)
        check_prompt_length(config, model, T)
        front.set_cap(message_cap_bytes(config, prompt_len=T))
        log(party_id, f"weights shared in {t_weights - t_start:.1f} s; prompt of {T} tokens")

        last = [front.stats()]

        def on_step(step, token):
            stage(f"{step.phase} at position {step.position}")
            now = front.stats()
            if now and last[0]:
                # What this party's front relayed during the step (one JSON line per step).
                log(party_id, FRONT_STEP + json.dumps({
                    "phase": step.phase, "position": step.position,
                    "frames": now["frames"] - last[0]["frames"],
                    "bytes": now["bytes"] - last[0]["bytes"],
                    "cpu_s": round(now["cpu_s"] - last[0]["cpu_s"], 4),
                    "max_message_so_far": now.get("max_message"),
                    "most_unread_so_far": now.get("most_unread")}))
            last[0] = now
            if is_client:
                log(party_id, f"token {token} ({step.phase}, {step.wall_s:.2f} s)")
        stage("compilation")
        result = session.generate(prompt_ids, job.max_new_tokens, prompt_len=T,
                                  stop_ids=stop_ids, on_step=on_step,
                                  reveal_logits=job.reveal_logits, prefill=job.prefill)
        stage("confirming success")
        # Results are reported only once every party has finished its side.
        if not all(backend.exchange("done", True)):
            raise PartyFailure(None, "a party did not confirm the end of the run")
    except wire.WireError as err:
        raise PartyFailure(err.party, f"{err} [during {watchdog.stage}]") from None
    except ProgramMismatch as err:
        raise PartyFailure(None, f"{err} [during {watchdog.stage}]") from None
    except RuntimeError as err:
        if isinstance(err, PartyFailure):
            raise
        raise explain_link_error(config, party_id, watchdog.stage, err,
                                 front.events_path) from None
    watchdog.stop()
    if os.getppid() != parent:
        # The supervisor (or launcher) that started this party is gone: nobody is left to
        # report success to, so nothing is written.
        raise PartyFailure(None, "this party's supervisor ended during the run; not writing "
                                 "results")
    record = None
    if is_client:
        records = costs.generation_records(
            result, backend="spu_nodes", policy=job.policy, budget=job.budget,
            model=job.model, num_layers=job.num_layers, protocol=config.protocol,
            parties=config.world_size, prompt_len=T, weights_s=round(t_weights - t_start, 3),
            node_config=config.id, tls=config.link.tls is not None, prefill=job.prefill,
            runtime_config=config.mpc.runtime_json())
        record = records[-1]
        arrays = {"tokens": np.asarray(result.tokens, np.int64)}
        if result.logits is not None:
            arrays["logits"] = np.stack(result.logits)
        write_atomically(out / "outputs.npz", lambda p: np.savez(open(p, "wb"), **arrays))
        results = out / "results.jsonl"
        earlier = results.read_text() if results.exists() else ""
        write_atomically(results, lambda p: p.write_text(
            earlier + "".join(json.dumps(r) + "\n" for r in records)))
        log(party_id, f"tokens {result.tokens}; {len(records)} records in {results}")
    # No stop_link: its shutdown messages race with peers that have already left, and a
    # failed send makes yacl end the process. Linger so in-flight acknowledgements complete,
    # then the caller exits the process (experiments.party uses exit_now).
    time.sleep(LINGER_S)
    return record


def check_prompt_length(config: NodeConfig, model, prompt_len) -> None:
    """Every party checks the announced (public) prompt length against the model, the job and
    the memory bound (config.check_job_bounds with the announced length)."""
    job = config.job
    if not isinstance(prompt_len, int) or isinstance(prompt_len, bool) or prompt_len < 1:
        raise PartyFailure(config.prompt_owner, f"party {config.prompt_owner} announced a "
                                                f"prompt length of {prompt_len!r}")
    if prompt_len + job.max_new_tokens > model.cfg.max_position:
        raise PartyFailure(config.prompt_owner, f"a prompt of {prompt_len} tokens + "
                           f"{job.max_new_tokens} new tokens exceeds the model's context of "
                           f"{model.cfg.max_position}")
    try:
        check_job_bounds(config, prompt_len=prompt_len)
    except NodeConfigError as err:
        raise PartyFailure(config.prompt_owner, f"party {config.prompt_owner} announced a "
                                                f"prompt of {prompt_len} tokens: {err}") from None


def warn_if_insecure(config: NodeConfig, party_id: str) -> None:
    """Print a warning when the config allows plain TCP to non-loopback peers."""
    remote = [pid for pid, address in config.parties
              if not is_loopback(address.rpartition(":")[0])]
    if config.link.tls is None and remote:
        log(party_id, f"warning: link.insecure=true: shares, tokens and results travel as plain "
                      f"TCP to {remote}, readable and forgeable on the network; add link.tls")
