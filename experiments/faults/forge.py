"""What a hostile peer sends: preludes that make a party's worker send a pickle or a forged
share, protobuf-encoded brpc frames with chosen sizes, ranks and keys, and a front door
started on its own to receive them."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

from experiments.faults.harness import REPO, make_certs

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
from experiments.faults.forge import pb_varint as _v
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
                body_size: int | None = None, seq: int = 1, meta_extra: bytes = b"",
                push_extra: bytes = b"") -> bytes:
    """A brpc baidu_std frame carrying a yacl Push as SPU 0.9.5's link sends it (fields read
    off the wire: see runtime/distributed/frames.py), with any field set to a lie:
    `message_length` makes it a chunk of a message of that length at `chunk_offset`;
    `body_size` overrides the header's body size (the rest is not sent); `seq` is yacl's
    sequence number after the key (0: unnumbered, as only its connection test sends);
    `meta_extra` / `push_extra`: raw protobuf fields appended to the RpcMeta / the Push."""
    request = pb_field(1, service) + pb_field(2, b"Push")
    meta = pb_field(1, request) + pb_field(3, 0) + pb_field(4, 12345) + meta_extra
    push = (pb_field(1, sender_rank) + pb_field(2, key + b"\x01\x02" + str(seq).encode())
            + pb_field(3, value))
    if message_length is not None:
        push += pb_field(4, 1) + pb_field(5, pb_field(1, message_length)
                                            + pb_field(2, chunk_offset))
    push += push_extra
    body = meta + push
    import struct
    header = struct.pack(">4sII", b"PRPC", len(body) if body_size is None else body_size,
                         len(meta))
    return header + (body if body_size is None else b"")


def private_dir() -> str:
    """A party's private directory for a test front (mode 0700, under /tmp: a socket's path
    must fit 107 bytes)."""
    import atexit
    import shutil
    import tempfile
    path = tempfile.mkdtemp(prefix="mpcache-test-", dir="/tmp")
    atexit.register(shutil.rmtree, path, True)
    return path


def build_fast_front(binary: pathlib.Path) -> str | None:
    """Build runtime/distributed/fast_front.c at `binary` (scripts/build_fast_front.py, with
    its .sha256 beside it) -> None, or why it could not."""
    made = subprocess.run([sys.executable, str(REPO / "scripts" / "build_fast_front.py"),
                           str(binary)], capture_output=True, text=True)
    return None if made.returncode == 0 else (made.stderr.strip() or "it failed")


def start_test_front(folder: pathlib.Path, port: int, tls: bool = False,
                     max_message_bytes: int = 1 << 20, spec_overrides: dict | None = None,
                     fast_front: pathlib.Path | None = None):
    """A front for node:1 of a 3-party config (ranks 0-2) on 127.0.0.1:port, plain or TLS
    (certificates under folder/certs), with a recording stand-in backend on its Unix socket
    -> (process, spec, backend socket, list of received byte strings). front.py, or with
    `fast_front` (a build of fast_front.c) that program where front.py would run it (plain
    TCP)."""
    import socket
    import threading
    from runtime.distributed.fast_front import FAST_FRONT_ENV
    from runtime.distributed.front_state import FrontSpec
    from runtime.distributed.party_front import FRONT_SCRIPT
    from runtime.distributed.process import child_env
    tls_spec = None
    if tls:
        make_certs(folder / "certs", ["node:0", "node:1", "node:2"])
        c = folder / "certs"
        tls_spec = {"ca": str(c / "ca.crt"), "cert": str(c / "node_1.crt"),
                    "key": str(c / "node_1.key"), "verify_depth": 1}
    spec = FrontSpec(
        party="node:1", rank=1, listen_host="127.0.0.1", listen_port=port,
        link_id="test.3pc.run",
        peers={f"node:{r}": {"rank": r, "host": "127.0.0.1", "address": f"127.0.0.1:{port + 0}"}
               for r in (0, 2)},
        hello_key=(b"k" * 32).hex(), max_frame_bytes=(1 << 20) + (64 << 10),
        max_message_bytes=max_message_bytes, max_buffered_bytes=2 * max_message_bytes,
        events_path=str(folder / "front_events.jsonl"), private_dir=private_dir(),
        worker_pid=os.getpid(), tls=tls_spec,
        max_unread_messages=12)     # a party's: SPU's throttle window of 10 + 2
    spec = dataclasses.replace(spec, **(spec_overrides or {}))
    pathlib.Path(spec.events_path).write_text("")
    proc = subprocess.Popen([sys.executable, str(FRONT_SCRIPT), spec.to_json()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=open(folder / "front.log", "w"),
                            env=child_env({FAST_FRONT_ENV: str(fast_front or "off")}))
    ready = json.loads(proc.stdout.readline())
    backend = socket.socket(socket.AF_UNIX)
    backend.bind(ready["backend"])
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
    from runtime.distributed import frames
    address = ("127.0.0.1", spec.listen_port)
    try:
        sock = (tls_client(address, tls_folder) if tls_folder is not None
                else socket.create_connection(address, timeout=5))
        nonce = os.urandom(frames.HELLO_NONCE_BYTES)
        sock.sendall(frames.hello_request(nonce))
        reply = b""
        while len(reply) < 36:
            got = sock.recv(64)
            if not got:
                break
            reply += got
        sock.close()
    except OSError:
        return False
    return frames.check_hello_reply(reply, bytes.fromhex(spec.hello_key), nonce, spec.party)


def sending(*frames: bytes, tls_cert: str | None = None):
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
