"""The front door of a party: the only socket of a party that anything outside it can reach
(docs/design.md, "Front door"). Its own process (`python front.py SPEC_JSON`, standard
library only: the package's modules below are loaded without the package's __init__), started
by the party's worker (party_front.start_front). brpc listens behind it on a Unix socket in
the party's private directory (`FrontSpec.backend_path`), so brpc has no TCP port. Each
connection to the public port is counted first (front_state.Front.admit); under TLS its
handshake runs here after that (`loop.start_tls`: the client certificate must name a peer
node, certs.certificate_node, which binds the connection); its first 4 bytes say brpc
(b"PRPC") or the fronts' hello (b"MPCH", answered); every brpc frame is checked whole
(frames.py, rules.py) before a byte of it is forwarded (store and forward: nothing that fails
a check reaches brpc). With `link.shape`, checked frames wait for the connection's rate,
then for the one-way delay. The outbound side: relay.py. In plain TCP without an outbound
side or shaping, the front in C runs in this process's place (fast_front.py).

Start-up: one JSON line {"ready": true, "backend": PATH, "outbound": {node: PATH}}, or
{"error": "...", "kind": "address in use" | ...} and exit 2. stdin: "cap N" lines (a new
`max_message_bytes` once the prompt length is public) and "stats" lines (answered with one
JSON line: frames and bytes relayed to brpc, the most messages of one peer held unread, this
process's CPU seconds).
"""
from __future__ import annotations

import asyncio
import errno
import json
import os
import pathlib
import socket
import ssl
import sys
import time

if not __package__:
    # Run as a script (how a party starts it): the sibling modules are imported as the
    # package's, without the package's __init__ (which loads the node config and with it JAX).
    import types
    for _name, _path in (("runtime", 1), ("runtime.distributed", 0)):
        sys.modules[_name] = types.ModuleType(_name)
        sys.modules[_name].__path__ = [str(pathlib.Path(__file__).resolve().parents[_path])]

from runtime.distributed.certs import certificate_node, tls_context  # noqa: E402
from runtime.distributed.fast_front import fast_front_args, fast_front_binary  # noqa: E402
from runtime.distributed.frames import (BRPC_MAGIC, HEADER, HELLO_MAGIC,  # noqa: E402
                                        HELLO_REQUEST_BYTES, hello_answer, parse_hello)
from runtime.distributed.front_state import (Front, FrontSpec, check_private_dir,  # noqa: E402
                                             outbound_socket)
from runtime.distributed.process import bind_to_parent  # noqa: E402
from runtime.distributed.relay import HIGH_WATER_BYTES, Outbound, Relay  # noqa: E402
from runtime.distributed.rules import ConnLedger, PeerLedger  # noqa: E402

# An inbound connection's first read buffer; it grows (doubling) to hold a whole frame.
READ_BYTES = 64 << 10


class _Inbound(asyncio.BufferedProtocol):
    """One connection to the public port: hello or checked brpc frames relayed to brpc.

    The event loop reads straight into `buf` (a BufferedProtocol), which holds at most the
    current frame and the start of the next: a frame spread over many reads is copied once,
    when it is forwarded, not once per read and again when whole. Under TLS the connection
    is counted from its first byte and the handshake runs here (`loop.start_tls`), within
    the hello's deadline."""

    def __init__(self, front: Front, tls: ssl.SSLContext | None = None):
        self.front, self.tls = front, tls
        self.buf = bytearray(READ_BYTES)
        self.filled = 0                     # buf[:filled] has been read and not yet forwarded
        # The most buf may grow to: a whole frame of the largest size the link sends (the
        # header was checked before the rest is read) plus one read of the next.
        self.max_buf = HEADER.size + front.spec.max_frame_bytes + READ_BYTES
        self.mode = None
        self.node: str | None = None        # the peer node the connection is bound to
        self.ledger: PeerLedger | None = None   # that node's unread window
        self.unfinished = ConnLedger()
        self.pipe: Relay | None = None     # brpc's side: its replies come back through it
        self.opening = False
        self.pending: list[bytes] = []
        self.closed = False
        self.introduced = False             # its hello (a whole first frame) has arrived
        self.tls_ready = tls is None        # under TLS: handshake done, certificate checked
        self.frame_since: float | None = None   # the frame being read began (None: idle)
        self.timer = None
        self.free_at = 0.0          # shaping: when this connection's rate is free again
        self.queued = 0             # shaping: bytes waiting for their release time

    def connection_made(self, transport):
        self.transport = transport
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.source = str(peer[0])
        self.address = self.unfinished.address = f"{peer[0]}:{peer[1]}"
        if not self.front.admit(self):
            self.closed = True
            transport.abort()
            return
        transport.set_write_buffer_limits(high=HIGH_WATER_BYTES)
        self.frame_since = asyncio.get_running_loop().time()
        self._arm()
        if self.tls is not None:
            transport.pause_reading()    # the handshake's bytes are start_tls's, not frames
            asyncio.ensure_future(self._handshake())

    async def _handshake(self):
        loop = asyncio.get_running_loop()
        try:
            # Its own timeout comes after the hello's deadline (`_deadline`), which decides.
            transport = await loop.start_tls(
                self.transport, self, self.tls, server_side=True,
                ssl_handshake_timeout=self.front.spec.frame_deadline_s + 5)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError) as err:
            if not self.closed:
                self._refuse("refused a TLS client", f"the TLS handshake failed "
                             f"({getattr(err, 'reason', None) or type(err).__name__})")
            return
        if self.closed:
            transport.abort()
            return
        self.transport = transport
        node, why = certificate_node(transport.get_extra_info("peercert"), self.front.spec.peers)
        if node is None:
            self._refuse("refused a TLS client", why)
            return
        self.node = self.unfinished.node = node
        self.tls_ready = True
        if self.filled:     # what arrived before this coroutine resumed
            self._received()

    def abort(self) -> None:
        self.closed = True
        self.transport.abort()
        if self.pipe is not None and self.pipe.transport is not None:
            self.pipe.transport.close()

    def _refuse(self, kind: str, why: str, anonymous: bool = False) -> None:
        if self.closed:
            return
        self.front.event(kind, self.address, None if anonymous else self.node, why)
        self.abort()

    # -- the deadline of the frame (or hello) being read --

    def _arm(self) -> None:
        if self.timer is None and self.frame_since is not None:
            self.timer = asyncio.get_running_loop().call_at(
                self.frame_since + self.front.spec.frame_deadline_s, self._deadline)

    def _deadline(self) -> None:
        self.timer = None
        if self.closed or self.frame_since is None:
            return
        now = asyncio.get_running_loop().time()
        limit = self.front.spec.frame_deadline_s
        if not self.transport.is_reading() and self.introduced:
            self.frame_since = now       # brpc (or the shaper) holds the bytes, not the peer
        if now < self.frame_since + limit:
            self._arm()
            return
        if not self.introduced:
            got = ("its TLS handshake did not complete" if self.tls is not None
                   and self.node is None else f"{self.filled} bytes received")
            self.front.close_without_hello(self, f"no hello within {limit:g} s of its start "
                                                 f"({got})")
            return
        self.front.event("closed a slow connection", self.address, self.node,
                         f"a frame not whole within {limit:g} s of its first byte "
                         f"({self.filled:,} bytes of it arrived)")
        self.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.closed:
            self.filled = 0     # a refused connection's last bytes: read and dropped
        if len(self.buf) - self.filled < READ_BYTES // 2 and len(self.buf) < self.max_buf:
            self.buf.extend(bytes(min(len(self.buf), self.max_buf - len(self.buf))))
        return memoryview(self.buf)[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        self.filled += nbytes
        if self.tls_ready:
            self._received()
        # Under TLS, bytes that arrive between the end of the handshake and `_handshake`
        # resuming wait in buf (replies must go out through the TLS transport).

    def _received(self) -> None:
        if self.mode == "brpc":
            self._frames()
            return
        head = bytes(self.buf[:min(self.filled, 4)])
        if self.mode is None:
            if len(head) < 4:
                if not (BRPC_MAGIC.startswith(head) or HELLO_MAGIC.startswith(head)):
                    self._refuse("refused a connection", "its first bytes are neither brpc "
                                 f"nor the hello ({head!r})")
                return
            if head == HELLO_MAGIC:
                self.mode = "hello"
            elif head == BRPC_MAGIC:
                self.mode = "brpc"
                self._frames()
                return
            else:
                self._refuse("refused a connection", f"its first bytes are neither brpc nor "
                             f"the hello ({head!r})")
                return
        if self.filled >= HELLO_REQUEST_BYTES:
            nonce = parse_hello(bytes(self.buf[:HELLO_REQUEST_BYTES]))
            if nonce is None:
                self._refuse("refused a connection", "a malformed hello")
                return
            self.introduced = True
            self.transport.write(HELLO_MAGIC + hello_answer(self.front.hello_key, nonce,
                                                            self.front.spec.party))
            self.transport.close()
            self.closed = True

    def _frames(self) -> None:
        """Check the whole frames in buf[:filled]; forward them in one write; move an
        incomplete frame's bytes to the start of buf for the next read."""
        view = memoryview(self.buf)[:self.filled]
        at, err = self.front.check_frames(self, view)
        self.front.stats["bytes"] += at
        self._forward(view, at)     # the whole frames before a bad one were checked
        view.release()
        if err is not None:
            self._refuse(err.kind, str(err), err.anonymous)
            return
        if at:
            self.introduced = True
            rest = self.filled - at
            self.buf[:rest] = self.buf[at:self.filled]
            self.filled = rest
            # The next frame began in this read, or the connection is between frames.
            self.frame_since = asyncio.get_running_loop().time() if rest else None
        elif self.frame_since is None:
            self.frame_since = asyncio.get_running_loop().time()
        self._arm()

    def _forward(self, view, end: int) -> None:
        """Send view[:end] (checked frames) to brpc, or keep it until brpc's side is open;
        with shaping, once the connection's rate has passed it and the delay is over."""
        if not end:
            return
        chunk = bytes(view[:end])
        spec = self.front.spec
        if spec.delay_s <= 0 and not spec.rate_bytes_s:
            self._deliver(chunk)
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = max(now, self.free_at)
        self.free_at = start + (len(chunk) / spec.rate_bytes_s if spec.rate_bytes_s else 0.0)
        self.queued += len(chunk)
        if self.queued > HIGH_WATER_BYTES:
            self.transport.pause_reading()      # bounded: the shaper holds at most this much
        loop.call_at(self.free_at + spec.delay_s, self._release, chunk)

    def _release(self, chunk: bytes) -> None:
        self.queued -= len(chunk)
        if not self.closed:
            self._deliver(chunk)
            if self.queued <= HIGH_WATER_BYTES // 2:
                self.transport.resume_reading()

    def _deliver(self, chunk: bytes) -> None:
        if self.pipe is not None and self.pipe.transport is not None:
            self.pipe.transport.write(chunk)
            return
        self.pending.append(chunk)
        if not self.opening:        # brpc's side opens with the first checked frame
            self.opening = True
            asyncio.ensure_future(self._open_backend())

    async def _open_backend(self):
        loop = asyncio.get_running_loop()
        try:
            _, pipe = await loop.create_unix_connection(lambda: Relay(self),
                                                        self.front.spec.backend_path)
        except OSError:
            self.transport.close()    # brpc not up yet: the client retries
            self.closed = True
            return
        if self.closed:
            # Refused or gone before brpc's side was open: the frames checked before that
            # still go to brpc, as they would have on an open connection.
            for frame in self.pending:
                pipe.transport.write(frame)
            self.pending.clear()
            pipe.transport.close()
            return
        self.pipe = pipe
        for frame in self.pending:
            pipe.transport.write(frame)
        self.pending.clear()

    def connection_lost(self, exc):
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.front.forget(self)
        if self.pipe is not None and self.pipe.transport is not None:
            self.pipe.transport.close()

    def pause_writing(self):
        if self.pipe is not None and self.pipe.transport is not None:
            self.pipe.transport.pause_reading()

    def resume_writing(self):
        if self.pipe is not None and self.pipe.transport is not None:
            self.pipe.transport.resume_reading()


def _refuse_start(announce, error: str, kind: str) -> None:
    announce(json.dumps({"error": error, "kind": kind}))
    raise SystemExit(2)


def _cannot_listen(spec: FrontSpec, err: OSError, announce) -> None:
    _refuse_start(announce, f"{spec.listen_host}:{spec.listen_port}: {err.strerror}",
                  "address in use" if err.errno == errno.EADDRINUSE else "cannot listen")


async def serve(spec: FrontSpec, announce=print) -> None:
    """Bind the public port (and, with an outbound side, one Unix socket per peer in the
    party's private directory), announce, serve."""
    loop = asyncio.get_running_loop()
    front = Front(spec)
    tls = spec.tls
    server_ctx = tls_context(tls["ca"], tls["cert"], tls["key"], server=True) if tls else None
    try:
        server = await loop.create_server(lambda: _Inbound(front, server_ctx), spec.listen_host,
                                          spec.listen_port, reuse_address=True)
    except OSError as err:
        _cannot_listen(spec, err, announce)
    outbound = {}
    servers = [server]      # held: a server object that is collected stops listening
    if spec.tls or spec.relay_outbound:
        client_ctx = tls_context(tls["ca"], tls["cert"], tls["key"]) if tls else None
        for peer in spec.peers:
            path = outbound_socket(spec.private_dir, peer)
            servers.append(await loop.create_unix_server(
                lambda peer=peer: Outbound(front, peer, client_ctx), path))
            os.chmod(path, 0o600)
            outbound[peer] = path
    announce(json.dumps({"ready": True, "backend": spec.backend_path, "outbound": outbound}))

    async def control():
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = await reader.readline()
            if not line:
                return
            parts = line.decode(errors="replace").split()
            if len(parts) == 2 and parts[0] == "cap" and parts[1].isascii() and parts[1].isdigit():
                front.max_message_bytes = int(parts[1])
            elif parts == ["stats"]:
                most_unread = max((ledger.most_unread for ledger in front.ledgers.values()),
                                  default=0)
                announce(json.dumps({**front.stats, "most_unread": most_unread,
                                     "cpu_s": round(time.process_time(), 4)}))
    await control()
    await asyncio.Event().wait()
    del servers


def _keep_freed_memory(max_frame_bytes: int) -> None:
    """Have glibc's malloc keep freed memory for reuse instead of returning it to the kernel
    after every frame: a relayed frame of up to `max_frame_bytes` is a fresh buffer, which
    glibc by default maps and unmaps (mmap above 128 KiB, then brk and trim), so that each
    frame costs page faults on every page it touches; that was most of this process's CPU per
    frame on 1 MiB frames. The memory kept is what the largest frames in flight needed, bounded
    by the caps. A no-op where malloc is not glibc's."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mmap_above = min(max(4 * max_frame_bytes, 8 << 20), 32 << 20)   # glibc's largest: 32 MiB
    mallopt(m_mmap_threshold, mmap_above)
    mallopt(m_trim_threshold, 4 * mmap_above)
    mallopt(m_top_pad, 2 * max_frame_bytes)


def exec_fast_front(spec: FrontSpec, binary: pathlib.Path, announce) -> None:
    """Bind the public port, announce, and replace this process with the C front, which
    inherits the bound socket, the control pipe and stderr (does not return)."""
    family = socket.AF_INET6 if ":" in spec.listen_host else socket.AF_INET
    try:
        listener = socket.create_server((spec.listen_host, spec.listen_port), family=family)
    except OSError as err:
        _cannot_listen(spec, err, announce)
    announce(json.dumps({"ready": True, "backend": spec.backend_path, "outbound": {},
                         "program": "fast_front"}))
    os.set_inheritable(listener.fileno(), True)
    os.execv(binary, [str(binary), str(listener.fileno())] + fast_front_args(spec))


def main(argv: list[str]) -> int:
    bind_to_parent(always=True)     # never outlive the party's worker, nor hold its port
    spec = FrontSpec.from_json(argv[1])
    announce = lambda line: print(line, flush=True)    # noqa: E731
    why = check_private_dir(spec)
    if why:
        _refuse_start(announce, why, "front")
    fast = fast_front_binary(spec)
    if fast is not None:
        exec_fast_front(spec, fast, announce)
    _keep_freed_memory(spec.max_frame_bytes)
    run = asyncio.run
    if spec.tls is None:
        # Under TLS each connection is counted before its handshake, which runs here
        # (`loop.start_tls`): asyncio's own loop keeps a new connection unread until then,
        # uvloop 0.23 may read its first bytes before (they would be lost to the handshake).
        try:
            import uvloop      # optional: about 2x less CPU per relayed frame
            run = uvloop.run
        except ImportError:
            pass
    try:
        run(serve(spec, announce=announce))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
