"""The front's raw relay halves and its outbound side (under TLS, and in plain TCP to remote
peers: `relay_outbound`): brpc connects to a Unix socket per peer in the party's private
directory (`to_<node>.sock`, mode 0600) that serves the party's worker only (SO_PEERCRED:
any other process is refused before a byte is read, with an event); the front connects to
the peer's front (under TLS with this party's certificate, checking the peer's by the
identity rule before relaying a byte) and reads this party's acknowledgements among brpc's
requests (the peer's unread window, rules.PeerLedger). Standard library only.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
import struct

from runtime.distributed.certs import certificate_node
from runtime.distributed.frames import FrameError
from runtime.distributed.front_state import Front
from runtime.distributed.rules import note_acknowledgements

# Per-connection socket buffers of the relay (flow control: reading pauses above this).
HIGH_WATER_BYTES = 4 << 20


class Relay(asyncio.Protocol):
    """A raw relay half: bytes in go to `other`'s transport (kept until it has one); closing
    one side closes the other. Carries brpc's replies back to an inbound connection (front.py),
    and both directions of an outbound connection."""

    def __init__(self, other: "asyncio.Protocol | None" = None):
        self.transport = None
        self.other = other
        self.buffer: list[bytes] = []

    def connection_made(self, transport):
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER_BYTES)

    def data_received(self, data):
        if self.other is not None and self.other.transport is not None:
            self.other.transport.write(data)
        else:
            self.buffer.append(data)

    def connection_lost(self, exc):
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()

    def pause_writing(self):
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self):
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()


def peer_process(transport) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix-socket transport (SO_PEERCRED:
    the process that connected)."""
    sock = transport.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


class Outbound(Relay):
    """The local half of an outbound relay: this party's brpc requests to `peer`, read for
    the acknowledgements that mark the peer's messages as read (PeerLedger.unread) before
    they are forwarded. Serves the party's worker only: a connection from any other process
    (SO_PEERCRED) is refused before a byte of it is read."""

    def __init__(self, front: Front, peer: str, ctx: ssl.SSLContext | None):
        super().__init__()
        self.front, self.peer, self.ctx = front, peer, ctx
        self.ledger = front.ledger(peer) if front.max_unread else None
        self.buf = bytearray()

    def connection_made(self, transport):
        try:
            pid, uid = peer_process(transport)
        except (OSError, AttributeError, struct.error):
            pid, uid = -1, -1
        if pid != self.front.spec.worker_pid:
            self.front.event("refused a local connection", f"pid {pid}", None,
                             f"the outbound socket to {self.peer} serves this party's worker "
                             f"(pid {self.front.spec.worker_pid}) only; pid {pid} (uid {uid}) "
                             "connected")
            transport.abort()
            return
        super().connection_made(transport)
        asyncio.ensure_future(connect_outbound(self.front, self.peer, self, self.ctx))

    def data_received(self, data):
        if self.ledger is not None:
            self.buf += data
            try:
                del self.buf[:note_acknowledgements(self.buf, 0, self.front.spec.max_frame_bytes,
                                                    self.ledger)]
            except FrameError as err:
                # Never from this party's own brpc (the only process served here): stop
                # reading rather than hold the peer to a window no longer seen released.
                self.front.event("stopped reading this party's frames", "outbound",
                                 self.peer, str(err))
                self.front.no_window.add(self.peer)
                self.ledger, self.buf = None, bytearray()
        super().data_received(data)


async def connect_outbound(front: Front, peer: str, local: Outbound,
                           ctx: ssl.SSLContext | None) -> None:
    """brpc's plain connection to `peer` -> a connection to the peer's front (TLS with `ctx`:
    relayed once the peer's certificate names `peer` and its host; plain TCP without)."""
    loop = asyncio.get_running_loop()
    info = front.spec.peers[peer]
    host, _, port = info["address"].rpartition(":")
    try:
        transport, remote = await loop.create_connection(Relay, host, int(port), ssl=ctx)
    except (OSError, ssl.SSLError):
        local.transport.close()      # brpc retries; the watchdog names a peer that stays away
        return
    node, why = (certificate_node(transport.get_extra_info("peercert"), {peer: info})
                 if ctx is not None else (peer, ""))
    if node != peer:
        front.event("refused the server", info["address"], peer, why or "wrong identity")
        transport.abort()
        local.transport.close()
        return
    remote.other, local.other = local, remote
    for data in local.buffer:
        transport.write(data)
    local.buffer.clear()
    if local.transport.is_closing():
        transport.close()


