"""A party's side of its front door (front.py): the front's spec from the node config (the
message cap from the job's shapes, the hello key from the config's hash), the front's
process (started by the party's worker, dying with it), its stats per step, and the check
that a party's own public port is free before anything starts.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import pathlib
import socket
import subprocess
import sys
from typing import Any

import jax

from models import registry
from models.model import Model
from runtime.distributed.bounds import FIELD_BYTES, SHARES_PER_PARTY
from runtime.distributed.config import NodeConfig, is_loopback
from runtime.distributed.front_state import FrontSpec
from runtime.distributed.process import child_env, make_private_dir, node_tag

# The front's program: run as a script (standard library only), not through the package.
FRONT_SCRIPT = pathlib.Path(__file__).with_name("front.py")
# The link's id after the config's ("<config id>.run"): the keys the fronts let through.
LINK_ID = "run"


class AddressInUse(RuntimeError):
    """This party's own public port is taken by another process (exit 2)."""


def address_in_use(party_id: str, address: str) -> AddressInUse:
    return AddressInUse(f"address in use: {party_id}'s link port {address} is taken by "
                        f"another process; stop it or give nodes[{party_id!r}] another port")


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
    host, _, port = config.address(party_id).rpartition(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise address_in_use(party_id, f"{host}:{port}") from None
            raise AddressInUse(f"{party_id} cannot listen on {host}:{port} ({err.strerror}): "
                               f"is {host} an address of this machine? fix "
                               f"nodes[{party_id!r}]") from None


def hello_key(config: NodeConfig) -> bytes:
    """The key of the fronts' hello: SHA-256 of the node config's public identity (id, nodes
    in rank order, runtime config). Every party of the same config has it; a process that is
    not one of this config's fronts cannot answer the hello (frames.hello_answer)."""
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
    """The most bytes one message of this job may declare (the front refuses larger ones).

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


def start_front(config: NodeConfig, party_id: str, output_dir, private_dir: str | None = None,
                program: str | None = None) -> FrontHandle:
    """Start this party's front (a child process that dies with this one) and wait until it
    listens -> FrontHandle. `private_dir`: the party's private directory (a new one if None;
    see make_private_dir). `program`: benchmarks only, a program started in the front's place
    with the same argument and start-up line (the fronts' cost benchmark's floor: a relay with
    no checks); refused under TLS and with remote peers (it has no outbound side). Raises
    AddressInUse when the public port is taken."""
    events = front_events_path(output_dir, party_id)
    events.write_text("")
    spec = front_spec(config, party_id, events, private_dir or make_private_dir(party_id),
                      os.getpid())
    if program and (spec.tls is not None or spec.relay_outbound):
        raise RuntimeError("front_program is given: a stand-in front is for plain-TCP loopback "
                           "benchmarks only; leave it out for a TLS run or remote peers")
    if program:
        print(f"[party {party_id}] front: front_program={program} replaces the front "
              "(benchmarks only: no frame is checked)", file=sys.stderr, flush=True)
    command = [program] if program else [sys.executable, str(FRONT_SCRIPT)]
    proc = subprocess.Popen(command + [spec.to_json()],
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
            raise address_in_use(party_id, address)
        raise RuntimeError(f"{party_id}'s front could not listen on {address}: "
                           f"{answer.get('error')}")
    if answer.get("program") == "fast_front":
        print(f"[party {party_id}] front: the front in C (fast_front.c) serves {spec.listen_host}:"
              f"{spec.listen_port}", file=sys.stderr, flush=True)
    return FrontHandle(proc, str(answer["backend"]),
                       {k: str(v) for k, v in answer.get("outbound", {}).items()}, events)

