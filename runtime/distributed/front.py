"""The front door of a party: the only socket of a party that anything outside it can reach.

Every party's public link port ("nodes" in the node config) is served by this front, a small
asyncio TCP relay owned by the project. SPU's brpc server listens behind it on a Unix socket
in the party's private directory (mode 0700, made by the party's supervisor or worker:
`FrontSpec.private_dir`, `brpc.sock`), so brpc has no TCP port at all. For each incoming
connection the front

1. counts it: at most `max_connections` open in all and `max_per_source` from one source
   address; a new connection over either cap closes the oldest connection of that scope that
   has not sent its hello yet (its first whole frame, or the project's hello), else it is
   refused. Its hello must arrive within `frame_deadline_s` of its start (TLS handshake
   included), and every later frame within `frame_deadline_s` of its first byte; the clock
   does not restart on a read, and between frames a connection may idle. Connections closed
   without a hello are logged per source address (at most FLOOD_EVENTS_PER_S lines a second,
   the rest counted), so that the party's blame can name the flood ("127.0.0.1 held 260
   connections without a hello");
2. under TLS, terminates mutual TLS (here, `loop.start_tls`, after counting the connection):
   the client certificate must chain to `link.tls.ca`, have CN = a node id of the config (not
   this party's) and a subjectAltName for that node's host (the identity rule of config.py).
   The connection is bound to that node;
3. reads its first 4 bytes: b"PRPC" starts a brpc (baidu_std) stream, b"MPCH" the project's
   hello (`hello_answer`, what liveness probes check), anything else is refused and closed;
4. reads every brpc frame header before forwarding anything of it. A frame is

       b"PRPC" | body_size u32 BE | meta_size u32 BE | RpcMeta (meta_size bytes) | payload

   where the payload is yacl's PushRequest protobuf: 1 sender_rank (varint), 2 key (bytes,
   "<link id>...:<src>-><dst>\\x01\\x02<seq>" or "connect_<src>\\x01\\x02<seq>"), 3 value,
   4 trans_type (1 = chunked), 5 chunk_info {1 message_length, 2 chunk_offset}. The frame is
   dropped and the connection closed, with a log line naming the peer, when: its body exceeds
   `max_frame_bytes` (yacl splits messages into chunks of the link's
   http_max_payload_size, 1 MiB); its meta is not a plain `ReceiverService.Push` request
   (RpcMeta fields 1, 3, 4, 5 only, uncompressed, no attachment); a field of the meta, the
   request, the Push or its chunk_info appears twice (protobuf would merge them); a declared
   message length exceeds `max_message_bytes` (the largest message the job's programs
   receive, `party.message_cap_bytes`); a chunk does not fit its message (offset + chunk >
   length) or restates another length; the sender rank is not the node the
   connection is bound to (under TLS: its certificate; in plain TCP: its first frame), or
   is this party, or the key's `src->dst` is not `bound rank -> this party`; the unfinished
   chunked messages the connection started would hold more than `max_buffered_bytes` or
   number more than MAX_UNFINISHED_MESSAGES (each connection has its own budget, cleared
   when it closes: UnfinishedBook), or those of all connections together, with what closed
   ones left unfinished (the worker still holds their buffers), (peers + 1) times that (the
   event then names the connection that holds the most, not this one); a message number of
   a rank comes again under another key (two senders claim the rank: yacl keeps the first;
   FORGED); with an outbound side (TLS, or plain TCP to remote peers), the peer would have
   more than `max_unread_messages` complete messages this party has not read (PeerLedger:
   the outbound side reads this party's acknowledgements).

Frames are relayed whole (store and forward, at most one frame of `max_frame_bytes` buffered
per connection), so nothing that fails a check reaches brpc; the connection to brpc opens
with the first frame that passes. Under TLS, and in plain TCP when a peer is not on loopback
(`relay_outbound`), a party's outgoing brpc connections also go through this process: brpc
connects to a Unix socket per peer in the private directory (`to_<node>.sock`, mode 0600),
which serves the party's worker only (the connecting process, by SO_PEERCRED, must be
`worker_pid`; any other is refused before a byte is read, with an event), and the front opens
the connection to the peer's front (under TLS with this party's certificate, checking the
peer's certificate by the identity rule before relaying a byte) and reads the
acknowledgements among brpc's requests.

Events (a refused connection, a dropped frame, a connection closed without a hello or at a
frame's deadline) are printed as one `[party X] front: ...` line each on stderr and
appended as JSON lines to `events_path`, which the party's worker and supervisor read to
name the peer (or the flood, or nobody) when the run then fails.

In plain TCP without an outbound side or shaping (every party on loopback), when
scripts/setup.sh has built fast_front.c, this process binds the public port, announces, and
executes that program in its place: the same rules, messages and events in C, for about half
the CPU per relayed frame (tests: every plain-TCP fault case against both, and a differential
fuzz of their verdicts). MPCACHE_FAST_FRONT=off keeps this file's front.

Runs as its own process (`python front.py SPEC_JSON`, stdlib only: it imports nothing of the
project but its sibling certs.py), started by the party's worker (`party.start_front`); on
start-up it prints one JSON line {"ready": true, "backend": PATH, "outbound": {node: PATH}} or
{"error": "...", "kind": "address in use" | ...} and exits 2. Reads "cap N" lines on stdin
(a new `max_message_bytes` once the prompt length is public) and "stats" lines (answers one
JSON line: frames and bytes relayed to brpc, the most messages of one peer held unread,
this process's CPU seconds). Never deserializes anything a
peer sent into objects: it reads integers and byte strings with bounds checks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import hashlib
import hmac
import json
import os
import pathlib
import re
import socket
import ssl
import stat
import struct
import sys
import time
from typing import Any, NamedTuple

if __package__:
    from runtime.distributed.certs import certificate_names, san_matches
else:
    # Run as a script (see above): certs.py from its own folder, first on sys.path. Not through
    # the package, whose __init__ loads the node config module and with it JAX.
    from certs import certificate_names, san_matches  # type: ignore[no-redef]

BRPC_MAGIC = b"PRPC"
HELLO_MAGIC = b"MPCH"
HELLO_NONCE_BYTES = 16
HEADER = struct.Struct(">4sII")
PUSH_SERVICE = b"org.interconnection.link.ReceiverService"
PUSH_METHOD = b"Push"
# RpcMeta field 1 (request) = {1: service, 2: method} exactly as brpc encodes a Push.
PUSH_META_PREFIX = (b"\x0a" + bytes([len(PUSH_SERVICE) + len(PUSH_METHOD) + 4]) + b"\x0a"
                    + bytes([len(PUSH_SERVICE)]) + PUSH_SERVICE + b"\x12"
                    + bytes([len(PUSH_METHOD)]) + PUSH_METHOD)
# The fields of brpc's RpcMeta that a Push request carries: request (1; the fast path reads it
# as PUSH_META_PREFIX), compress_type (3, must be 0), correlation_id (4), attachment_size (5,
# must be 0).
PUSH_META_FIELDS = {1, 3, 4, 5}
# The most a meta (RpcMeta) or a key may take; brpc's are ~60 bytes, yacl's keys ~30.
MAX_META_BYTES = 4096
MAX_KEY_BYTES = 512
SEQ_SEPARATOR = b"\x01\x02"
# The most chunked messages one peer may have unfinished at once. An honest peer has a few
# (yacl's throttle window holds at most 10 messages in flight); without a bound a peer could
# declare millions of one-byte messages within max_buffered_bytes.
MAX_UNFINISHED_MESSAGES = 64
# The sequence numbers of the messages each peer rank delivered, in a table of this many slots
# (slot = seq mod SEEN_SLOTS): a number that comes back under another key is a second sender
# for that rank (yacl keeps the message that came first and drops the other as a duplicate).
SEEN_SLOTS = 4096
FORGED = "dropped a forged message and closed the connection"
# Per-connection socket buffers of the relay (flow control: reading pauses above this).
HIGH_WATER_BYTES = 4 << 20
# An inbound connection's first read buffer; it grows (doubling) to hold a whole frame.
READ_BYTES = 64 << 10


class FrameError(ValueError):
    """A peer's bytes broke the front's rules; the message says which and how. `anonymous`:
    the fault is not (provably) this connection's own: the event then names no node; `kind`:
    the event's kind."""

    anonymous = False
    kind = "dropped a frame and closed the connection"


# ----- protobuf reading (integers and byte strings only) -------------------------------------

def read_varint(buf, i: int, end: int) -> tuple[int, int]:
    """A base-128 varint at buf[i:end] -> (value, next index); at most 10 bytes and 64 bits."""
    value = shift = 0
    for k in range(10):
        if i >= end:
            raise FrameError("a protobuf varint runs past its field")
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value >> 64:
                raise FrameError("a protobuf varint over 64 bits")
            return value, i
        shift += 7
    raise FrameError("a protobuf varint is longer than 10 bytes")


def sequence_number(raw: bytes) -> int:
    """yacl's decimal sequence number (a key's suffix after "\x01\x02", an ACK's value) -> int;
    0 for anything that is not 1-20 ASCII digits."""
    return int(raw) if 0 < len(raw) <= 20 and raw.isdigit() else 0


def read_fields(buf, start: int, end: int) -> dict[int, Any]:
    """The fields of one protobuf message in buf[start:end] -> {number: value}: varints as
    int, length-delimited as (offset, length) into buf, fixed 32/64-bit as int. A field number
    below 16 (every field brpc or yacl reads in these messages) that appears twice is refused:
    protobuf would keep the last scalar but merge two embedded messages field by field, so a
    second chunk_info or request could change, after the check, what the receiver reads (none
    of the messages read here has a repeated field). One-byte
    varints (nearly every key, rank and length a frame carries) are read inline: this runs for
    every relayed frame."""
    fields: dict[int, Any] = {}
    i = start
    while i < end:
        key = buf[i]
        if key < 0x80:
            i += 1
        else:
            key, i = read_varint(buf, i, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            if i < end and buf[i] < 0x80:
                value, i = buf[i], i + 1
            else:
                value, i = read_varint(buf, i, end)
        elif wire_type == 2:
            if i < end and buf[i] < 0x80:
                n, i = buf[i], i + 1
            else:
                n, i = read_varint(buf, i, end)
            if n > end - i:
                raise FrameError(f"protobuf field {number} declares {n} bytes, {end - i} remain")
            value, i = (i, n), i + n
        elif wire_type in (1, 5):
            n = 8 if wire_type == 1 else 4
            if n > end - i:
                raise FrameError(f"protobuf field {number} is cut short")
            value, i = int.from_bytes(bytes(buf[i:i + n]), "little"), i + n
        else:
            raise FrameError(f"protobuf field {number} has wire type {wire_type}")
        if number < 16 and number in fields:
            raise FrameError(f"protobuf field {number} appears twice in one message")
        fields[number] = value
    return fields


class Push(NamedTuple):
    """The parts of one brpc frame carrying a yacl Push that the front checks."""

    frame_bytes: int           # the whole frame, header included
    sender_rank: int
    key: bytes                 # without the "\x01\x02<seq>" suffix
    chunk_bytes: int           # this frame's value
    message_length: int | None  # chunked: the whole message's declared length
    chunk_offset: int | None
    seq: int = 0               # yacl's per-channel sequence number ("\x01\x02<seq>"; 0: none)
    value_at: int = 0          # where the value starts in the parsed buffer


def parse_frame(buf, max_frame_bytes: int, at: int = 0) -> Push | None:
    """The brpc frame starting at buf[at] -> Push, or None if more bytes are needed. Raises
    FrameError for anything that is not a plain ReceiverService.Push request within bounds;
    the header is checked before the body has arrived."""
    have = len(buf) - at
    if have < HEADER.size:
        if bytes(buf[at:at + 4]) != BRPC_MAGIC[:min(have, 4)]:
            raise FrameError(f"bytes that are not a brpc frame (starts "
                             f"{bytes(buf[at:at + 4])!r})")
        return None
    magic, body, meta = HEADER.unpack_from(buf, at)
    if magic != BRPC_MAGIC:
        raise FrameError(f"bytes that are not a brpc frame (starts {magic!r})")
    if body > max_frame_bytes:
        raise FrameError(f"a frame of {body:,} bytes (the link sends at most {max_frame_bytes:,})")
    if meta > min(body, MAX_META_BYTES):
        raise FrameError(f"a frame whose meta of {meta:,} bytes does not fit (body {body:,}, "
                         f"at most {MAX_META_BYTES})")
    if have < HEADER.size + body:
        return None
    start, meta_end, end = at + HEADER.size, at + HEADER.size + meta, at + HEADER.size + body
    if (meta >= len(PUSH_META_PREFIX)
            and buf[start:start + len(PUSH_META_PREFIX)] == PUSH_META_PREFIX):
        # The request part as brpc writes it for yacl's Push (every frame of a run).
        rpc = read_fields(buf, start + len(PUSH_META_PREFIX), meta_end)
        if 1 in rpc:
            raise FrameError("protobuf field 1 appears twice in one message (a brpc meta "
                             "with a second request)")
    else:
        rpc = read_fields(buf, start, meta_end)
        request = rpc.get(1)
        if request is None or not isinstance(request, tuple):
            raise FrameError("a brpc frame that is not a request")
        req = read_fields(buf, request[0], request[0] + request[1])
        service, method = req.get(1), req.get(2)
        if (not isinstance(service, tuple)
                or bytes(buf[service[0]:sum(service)]) != PUSH_SERVICE
                or not isinstance(method, tuple)
                or bytes(buf[method[0]:sum(method)]) != PUSH_METHOD):
            raise FrameError("a brpc request for another service than ReceiverService.Push")
    if rpc.get(3, 0) != 0 or rpc.get(5, 0) != 0:
        raise FrameError("a compressed brpc frame or one with an attachment")
    other = sorted(set(rpc) - PUSH_META_FIELDS)
    if other:
        raise FrameError(f"a brpc meta with field {other[0]}, which a plain Push request does "
                         "not have (a response, chunk, authentication, stream or user fields)")
    push = read_fields(buf, meta_end, end)
    rank = push.get(1, 0)
    key = push.get(2)
    if not isinstance(rank, int) or not isinstance(key, tuple) or key[1] > MAX_KEY_BYTES:
        raise FrameError("a Push without a sender rank or with a key over "
                         f"{MAX_KEY_BYTES} bytes")
    key_bytes, _, seq = bytes(buf[key[0]:sum(key)]).partition(SEQ_SEPARATOR)
    value = push.get(3, (0, 0))
    value_at, chunk_bytes = value if isinstance(value, tuple) else (0, 0)
    length = offset = None
    if push.get(4, 0) == 1:
        info = push.get(5)
        if not isinstance(info, tuple):
            raise FrameError("a chunked Push without chunk info")
        chunk = read_fields(buf, info[0], info[0] + info[1])
        length, offset = chunk.get(1, 0), chunk.get(2, 0)
        if not isinstance(length, int) or not isinstance(offset, int):
            raise FrameError("a chunked Push whose chunk info is not two integers")
    return Push(HEADER.size + body, rank, key_bytes, chunk_bytes, length, offset,
                sequence_number(seq), value_at)


# ----- the checks of one peer ---------------------------------------------------------------

@dataclasses.dataclass
class PeerLedger:
    """One peer node's complete messages this party has not read yet {seq: bytes}, with an
    outbound side only (`unread`: yacl acknowledges a message, naming its sequence number, when
    the program reads it, and a sender waits for acknowledgements once `throttle window`
    messages are unread, so an honest peer never has more unread here). `read_floor` /
    `read_above`: the sequence numbers already acknowledged (all up to the floor, and those
    above it), so that a retried delivery of a read message is not counted again."""

    unread: dict[int, int] = dataclasses.field(default_factory=dict)
    read_floor: int = 0
    read_above: set = dataclasses.field(default_factory=set)
    most_unread: int = 0       # the most messages held unread at once so far

    def received(self, seq: int, nbytes: int, max_unread: int) -> None:
        """A complete message `seq` of `nbytes` arrived; raises FrameError when the peer then
        has more than `max_unread` messages this party has not read."""
        if seq <= self.read_floor or seq in self.read_above:
            return
        self.unread[seq] = nbytes
        self.most_unread = max(self.most_unread, len(self.unread))
        if len(self.unread) > max_unread:
            raise FrameError(
                f"{len(self.unread)} messages ({sum(self.unread.values()):,} bytes) that this "
                f"party has not read, over the {max_unread} a peer may have unread (the link's "
                "throttle window: an honest peer waits for this party to read its messages; "
                "these are under keys the program does not read)")

    def read(self, seq: int) -> None:
        """This party acknowledged (read) the peer's message `seq`."""
        self.unread.pop(seq, None)
        if seq <= self.read_floor:
            return
        self.read_above.add(seq)
        while self.read_floor + 1 in self.read_above:
            self.read_floor += 1
            self.read_above.discard(self.read_floor)


# ----- unfinished chunked messages, per connection ------------------------------------------

@dataclasses.dataclass(eq=False)
class ConnLedger:
    """What one connection is charged for: the unfinished chunked messages it started (their
    number and declared bytes). Cleared when the connection closes (UnfinishedBook.close)."""

    address: str = "?"
    node: str | None = None
    count: int = 0
    bytes: int = 0
    keys: set = dataclasses.field(default_factory=set)

    def label(self) -> str:
        return f"{self.address} ({self.node})" if self.node else self.address


@dataclasses.dataclass(eq=False)
class Unfinished:
    """One chunked message this party's worker holds a buffer for (yacl allocates the
    declared length at the first chunk and frees it only when the message is whole)."""

    length: int
    got: int
    owner: ConnLedger | None        # None: left by a connection that closed
    left_by: str = ""


class UnfinishedBook:
    """Every unfinished chunked message of every connection, by (sender rank, key): a
    connection may have at most MAX_UNFINISHED_MESSAGES of them and `max_buffered_bytes` of
    declared lengths (its own budget: another connection claiming the same rank cannot use
    it up); all connections together, with the messages left unfinished by connections that
    closed (the worker still holds their buffers), at most (peers + 1) times that. A chunk of a
    message left by a closed connection continues it (brpc resends on a new connection)."""

    def __init__(self, max_buffered_bytes: int, peers: int):
        self.max_buffered = max_buffered_bytes
        self.max_count = MAX_UNFINISHED_MESSAGES * (peers + 1)
        self.max_bytes = max_buffered_bytes * (peers + 1)
        self.entries: dict[tuple[int, bytes], Unfinished] = {}
        self.total_bytes = 0

    def _charge(self, conn: ConnLedger, length: int) -> None:
        if conn.count >= MAX_UNFINISHED_MESSAGES:
            raise FrameError(f"{conn.count + 1} unfinished chunked messages in flight on this "
                             f"connection, over the per-connection cap of "
                             f"{MAX_UNFINISHED_MESSAGES}")
        if conn.bytes + length > self.max_buffered:
            raise FrameError(f"unfinished messages of {conn.bytes + length:,} bytes in flight "
                             f"on this connection, over the per-connection cap of "
                             f"{self.max_buffered:,}")

    def _holder(self) -> tuple[str, int, int, ConnLedger | None]:
        """The connection (or closed one) whose unfinished messages hold the most bytes ->
        (label, bytes, messages, its ledger or None); ties: the first seen."""
        held: dict[str, list] = {}
        for entry in self.entries.values():
            label = entry.owner.label() if entry.owner else f"{entry.left_by}, closed"
            row = held.setdefault(label, [0, 0, entry.owner])
            row[0] += entry.length
            row[1] += 1
        label, (nbytes, count, owner) = max(held.items(), key=lambda kv: kv[1][0])
        return label, nbytes, count, owner

    def chunk(self, conn: ConnLedger, rank: int, key: bytes, length: int,
              chunk_bytes: int) -> bool:
        """A chunk of `chunk_bytes` of the message (rank, key) of `length` bytes arrived on
        `conn` -> whether the message is now whole. Raises FrameError (with `.anonymous` set
        when the connection is not the one that holds the most: the event then names no
        node)."""
        entry = self.entries.get((rank, key))
        if entry is None:
            self._charge(conn, length)
            if len(self.entries) >= self.max_count or self.total_bytes + length > self.max_bytes:
                label, nbytes, count, owner = self._holder()
                err = FrameError(
                    f"{len(self.entries) + 1} unfinished chunked messages "
                    f"({self.total_bytes + length:,} bytes) at this party, over its total of "
                    f"{self.max_count} messages / {self.max_bytes:,} bytes for all connections "
                    f"together; the most, {nbytes:,} bytes in {count}, from {label}")
                err.anonymous = owner is not conn
                raise err
            entry = self.entries[(rank, key)] = Unfinished(length, 0, conn)
            conn.count += 1
            conn.bytes += length
            conn.keys.add((rank, key))
            self.total_bytes += length
        elif entry.length != length:
            raise FrameError(f"a chunk restating its message's length as {length:,} "
                             f"(first {entry.length:,})")
        elif entry.owner is None:
            self._charge(conn, length)       # a message a closed connection left: resumed
            entry.owner = conn
            conn.count += 1
            conn.bytes += length
            conn.keys.add((rank, key))
        entry.got += chunk_bytes
        if entry.got > length:
            raise FrameError(f"chunks adding up to {entry.got:,} bytes, over their message's "
                             f"declared {length:,}")
        if entry.got < length:
            return False
        del self.entries[(rank, key)]
        self.total_bytes -= length
        if entry.owner is not None:
            entry.owner.count -= 1
            entry.owner.bytes -= length
            entry.owner.keys.discard((rank, key))
        return True

    def close(self, conn: ConnLedger) -> None:
        """`conn` closed: its messages stay unfinished in the worker, charged to no
        connection (they count in the total until whole)."""
        label = conn.label()
        for k in conn.keys:
            entry = self.entries.get(k)
            if entry is not None and entry.owner is conn:
                entry.owner, entry.left_by = None, label
        conn.keys.clear()
        conn.count = conn.bytes = 0


# MPCACHE_FRONT_DEBUG_KEYS=1: print each new shape of key seen (digits as N), once.
DEBUG_KEYS: set = {b""} if os.environ.get("MPCACHE_FRONT_DEBUG_KEYS") else set()
CONTROL_KEYS = (b"ACK", b"FIN")
CONNECT_KEY = re.compile(rb"connect_(\d{1,4})$")


def check_push(push: Push, *, bound_rank: int, my_rank: int, link_id: bytes,
               max_message_bytes: int, book: UnfinishedBook, conn: ConnLedger,
               peer: PeerLedger | None = None, max_unread: int = 0) -> None:
    """The rules of the module docstring for one parsed frame from the peer of `bound_rank`
    on the connection `conn`; updates `book` (unfinished chunked messages) and, when
    `max_unread` > 0, the peer's unread window in `peer`. Raises FrameError."""
    if push.sender_rank != bound_rank:
        raise FrameError(f"a Push claiming sender rank {push.sender_rank} on a connection of "
                         f"rank {bound_rank}")
    m = CONNECT_KEY.fullmatch(push.key)
    if m:
        src, dst = int(m.group(1)), my_rank
    elif push.key in CONTROL_KEYS:
        src, dst = bound_rank, my_rank     # yacl's acknowledgements / end of stream
    else:
        if not (push.key.startswith(link_id) and push.key[len(link_id):len(link_id) + 1]
                in (b":", b"-")):
            raise FrameError(f"a Push under the key {push.key[:80]!r}, not a key of this run's "
                             f"link {link_id.decode()!r}")
        if not push.seq:
            # yacl numbers every message of a link; it keeps an unnumbered one (meant for its
            # connection test) unread for the whole run.
            raise FrameError(f"a Push under the key {push.key[:80]!r} without a sequence number")
        # Point-to-point keys end in ":<src>-><dst>"; collectives' ("<id>:<n>:ALLGATHER")
        # name no ranks.
        src, arrow, dst = push.key.rpartition(b":")[2].partition(b"->")
        if (arrow and 0 < len(src) <= 4 and 0 < len(dst) <= 4 and src.isdigit()
                and dst.isdigit()):
            src, dst = int(src), int(dst)
        else:
            src, dst = bound_rank, my_rank
    if DEBUG_KEYS:
        shape = re.sub(rb"\d+", b"N", push.key)
        if shape not in DEBUG_KEYS:
            DEBUG_KEYS.add(shape)
            print(f"front: key shape {shape!r}", file=sys.stderr, flush=True)
    if (src, dst) != (bound_rank, my_rank):
        raise FrameError(f"a Push under the key {push.key[:80]!r} ({src}->{dst}) on a "
                         f"connection from rank {bound_rank} to this party (rank {my_rank})")
    if push.message_length is None:
        if push.chunk_bytes > max_message_bytes:
            raise FrameError(f"a message of {push.chunk_bytes:,} bytes, over the cap of "
                             f"{max_message_bytes:,} (the largest the job's programs receive)")
        if max_unread and push.seq:
            peer.received(push.seq, push.chunk_bytes, max_unread)
        return
    length, offset = push.message_length, push.chunk_offset
    if length > max_message_bytes:
        raise FrameError(f"a chunked message declaring {length:,} bytes, over the cap of "
                         f"{max_message_bytes:,} (the largest the job's programs receive)")
    if offset > length or push.chunk_bytes > length - offset:
        raise FrameError(f"a chunk at offset {offset:,} of {push.chunk_bytes:,} bytes that "
                         f"does not fit its message of {length:,} bytes")
    if book.chunk(conn, bound_rank, push.key, length, push.chunk_bytes) and max_unread \
            and push.seq:
        peer.received(push.seq, length, max_unread)


def note_acknowledgements(buf, at: int, max_frame_bytes: int, ledger: PeerLedger) -> int:
    """Read this party's own outgoing frames to a peer in buf[at:] (its brpc's requests, relayed
    by the outbound side): each yacl ACK marks the peer's message it names as read in `ledger`.
    Returns where the first incomplete frame starts. Raises FrameError on bytes that are not
    brpc frames (this party's own brpc never sends them)."""
    while True:
        push = parse_frame(buf, max_frame_bytes, at)
        if push is None:
            return at
        if push.key == b"ACK":
            seq = sequence_number(bytes(buf[push.value_at:push.value_at + push.chunk_bytes]))
            if seq:
                ledger.read(seq)
        at += push.frame_bytes


# ----- the hello ----------------------------------------------------------------------------

def hello_answer(hello_key: bytes, nonce: bytes, node: str) -> bytes:
    """What node `node`'s front answers to a hello with `nonce`: HMAC-SHA256 keyed by the hash
    of the public node config (a protocol check that an unrelated listener cannot pass, not
    an authentication: every party knows the key; identities come from TLS)."""
    return hmac.new(hello_key, b"mpcache hello\0" + nonce + node.encode(), hashlib.sha256).digest()


def hello_request(nonce: bytes) -> bytes:
    """b"MPCH <nonce hex>\r\n\r\n": shaped like a request line, so that an unrelated HTTP
    server answers it (with an error) instead of waiting for more."""
    return HELLO_MAGIC + b" " + nonce.hex().encode() + b"\r\n\r\n"


HELLO_REQUEST_BYTES = len(hello_request(bytes(HELLO_NONCE_BYTES)))


def parse_hello(request: bytes) -> bytes | None:
    """The nonce of a hello request, or None if it is not one."""
    if len(request) != HELLO_REQUEST_BYTES or not request.startswith(HELLO_MAGIC + b" ") \
            or not request.endswith(b"\r\n\r\n"):
        return None
    try:
        nonce = bytes.fromhex(request[5:5 + 2 * HELLO_NONCE_BYTES].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    return nonce if len(nonce) == HELLO_NONCE_BYTES else None    # fromhex skips spaces


def check_hello_reply(reply: bytes, hello_key: bytes, nonce: bytes, node: str) -> bool:
    """Is `reply` the answer of node `node`'s front to `hello_request(nonce)`?"""
    want = HELLO_MAGIC + hello_answer(hello_key, nonce, node)
    return hmac.compare_digest(reply[:len(want)], want)


# ----- the relay ----------------------------------------------------------------------------

# A whole frame must arrive within this long of its first byte, and a connection's hello (its
# first whole frame, or the project's hello) within this long of the connection's start (TLS
# handshake included). The clock does not restart on every read; between frames a connection
# may stay idle (brpc's connections wait between steps).
FRAME_DEADLINE_S = 10.0
# Open connections to the public port: at most MAX_CONNECTIONS in all and MAX_PER_SOURCE
# from one source address. A new connection over either cap closes the oldest connection of
# that scope that has not sent its hello yet; if every one has, the new one is refused.
MAX_CONNECTIONS = 256
MAX_PER_SOURCE = 64
# Events about connections closed without a hello: at most this many lines per source
# address and second; the others are counted in the next line ("connections": n).
FLOOD_EVENTS_PER_S = 20
FLOOD_SOURCES = 4096
# In the party's private directory (mode 0700, made by its worker): the socket brpc listens
# on, and one socket per peer for brpc's outgoing connections (outbound side only).
BACKEND_SOCKET = "brpc.sock"


def outbound_socket(private_dir: str, node: str) -> str:
    return os.path.join(private_dir, f"to_{node.replace(':', '_')}.sock")


@dataclasses.dataclass(frozen=True)
class FrontSpec:
    """Everything the front process needs, as JSON (no config loading in the front).

    peers: {node id: {"rank": int, "host": str, "address": "host:port"}} of every other party;
    sizes in bytes; tls: {"ca", "cert", "key", "verify_depth"} paths or None; private_dir:
    the party's directory that only its own user may enter (brpc's socket and the outbound
    sockets live there); worker_pid: the one process the outbound sockets serve (the party's
    worker, whose brpc connects there)."""

    party: str
    rank: int
    listen_host: str
    listen_port: int
    link_id: str
    peers: dict[str, dict[str, Any]]
    hello_key: str                 # hex
    max_frame_bytes: int
    max_message_bytes: int
    max_buffered_bytes: int
    events_path: str
    private_dir: str
    worker_pid: int = 0
    # The most complete messages of one peer this party may hold unread (the link's throttle
    # window + slack; 0 = no bound). Needs the outbound side, which sees this party's
    # acknowledgements: under TLS, or with `relay_outbound` (plain TCP to remote peers).
    max_unread_messages: int = 0
    relay_outbound: bool = False
    tls: dict[str, Any] | None = None
    # Traffic shaping of the frames this party receives (config.ShapeSpec): each waits for
    # its connection's rate (bytes per second, None = none), then `delay_s`.
    delay_s: float = 0.0
    rate_bytes_s: float | None = None
    frame_deadline_s: float = FRAME_DEADLINE_S
    max_connections: int = MAX_CONNECTIONS
    max_per_source: int = MAX_PER_SOURCE

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "FrontSpec":
        return cls(**json.loads(text))

    @property
    def backend_path(self) -> str:
        return os.path.join(self.private_dir, BACKEND_SOCKET)


def check_private_dir(spec: FrontSpec) -> str | None:
    """Why spec.private_dir cannot hold the party's Unix sockets (None if it can): it must be
    a directory of this user that nobody else may enter (no group or other permissions), and
    short enough for each socket's path (107 bytes)."""
    path = spec.private_dir
    try:
        info = os.lstat(path)
    except OSError as err:
        return f"the private directory {path!r} cannot be read ({err.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return f"the private directory {path!r} is not a directory"
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        return (f"the private directory {path!r} must belong to this user and have mode 0700 "
                f"(it has uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})")
    for socket_path in [spec.backend_path] + [outbound_socket(path, p) for p in spec.peers]:
        if len(socket_path.encode()) > 107:
            return f"{socket_path!r} is too long for a Unix socket's path (107 bytes)"
    return None


def certificate_node(cert: dict | None, peers: dict[str, dict]) -> tuple[str | None, str]:
    """The peer node a client certificate identifies by the identity rule -> (node, '') or
    (None, why not)."""
    if not cert:
        return None, "it presented no certificate"
    cn, sans = certificate_names(cert)
    if cn not in peers:
        return None, f"its certificate's CN {cn!r} is not a peer node of the config"
    if not san_matches(peers[cn]["host"], sans):
        return None, (f"its certificate (CN={cn!r}) has no subjectAltName for {cn}'s host "
                      f"{peers[cn]['host']}")
    return cn, ""


class Front:
    """The relay's state: spec, the open connections by source address, the unfinished
    messages of every connection, the peers' unread windows, the event log."""

    def __init__(self, spec: FrontSpec):
        self.spec = spec
        self.hello_key = bytes.fromhex(spec.hello_key)
        self.link_id = spec.link_id.encode()
        self.rank_of = {node: int(p["rank"]) for node, p in spec.peers.items()}
        self.node_of = {r: n for n, r in self.rank_of.items()}
        self.ledgers: dict[str, PeerLedger] = {}
        self.book = UnfinishedBook(spec.max_buffered_bytes, len(spec.peers))
        self.seen: dict[int, dict] = {}     # rank -> {seq % SEEN_SLOTS: (seq, key, label)}
        self.max_unread = spec.max_unread_messages if (spec.tls or spec.relay_outbound) else 0
        self.no_window: set[str] = set()    # peers whose acknowledgements could not be read
        self.max_message_bytes = spec.max_message_bytes
        # Relayed so far: frames, bytes, the largest message (declared length) seen.
        self.stats = {"frames": 0, "bytes": 0, "max_message": 0}
        self.open: dict[str, list] = {}     # source address -> its open connections, oldest first
        self.n_open = 0
        self.flood: dict[str, list] = {}    # source -> [second, lines in it, not logged]

    def ledger(self, node: str) -> PeerLedger:
        """The unread window of peer `node` (shared by its inbound connections and the
        outbound side that sees this party's acknowledgements to it)."""
        found = self.ledgers.get(node)
        if found is None:
            found = self.ledgers[node] = PeerLedger()
        return found

    # -- connections --

    def admit(self, conn) -> bool:
        """Count a new connection (`conn.source`, `.address`, `.introduced`); over a cap, close
        the oldest connection without a hello of that scope for it -> False if none could be
        (the new one is then refused, with an event)."""
        spec = self.spec
        mine = self.open.setdefault(conn.source, [])
        if len(mine) >= spec.max_per_source:
            victim = next((c for c in mine if not c.introduced), None)
            if victim is None:
                self.event("refused a connection", conn.address, None,
                           f"{conn.source} has {len(mine)} connections open, each past its "
                           f"hello (at most {spec.max_per_source} per source address)")
                return False
            self.close_without_hello(victim, f"closed for a newer connection: the oldest "
                                     f"without a hello of the {len(mine)} connections open "
                                     f"from {conn.source} (at most {spec.max_per_source} per "
                                     "source address)")
        if self.n_open >= spec.max_connections:
            waiting = [c for conns in self.open.values() for c in conns if not c.introduced]
            if not waiting:
                self.event("refused a connection", conn.address, None,
                           f"{self.n_open} connections are open, each past its hello (at "
                           f"most {spec.max_connections} in all)")
                return False
            victim = min(waiting, key=lambda c: c.serial)
            self.close_without_hello(victim, f"closed for a newer connection: the oldest "
                                     f"without a hello of the {self.n_open} connections open "
                                     f"(at most {spec.max_connections} in all)")
        conn.serial = self.n_serial = getattr(self, "n_serial", 0) + 1
        mine.append(conn)
        self.n_open += 1
        return True

    def forget(self, conn) -> None:
        """`conn` closed: it no longer counts, nor do the unfinished messages it started."""
        mine = self.open.get(conn.source)
        if mine is not None and conn in mine:
            mine.remove(conn)
            self.n_open -= 1
            if not mine:
                del self.open[conn.source]
        self.book.close(conn.unfinished)

    def close_without_hello(self, conn, why: str) -> None:
        """Close `conn`, which has not sent its hello, with an event (at most
        FLOOD_EVENTS_PER_S lines per source address and second; the others are counted in
        one line at the end of that second)."""
        conn.abort()
        self.forget(conn)
        now = time.monotonic()
        if conn.source not in self.flood and len(self.flood) >= FLOOD_SOURCES:
            self.flood.clear()
        window = self.flood.setdefault(conn.source, [now, 0, 0])
        if now - window[0] >= 1.0:
            window[0], window[1] = now, 0
        if window[1] >= FLOOD_EVENTS_PER_S:
            window[2] += 1
            if window[2] == 1:
                asyncio.get_running_loop().call_later(window[0] + 1.0 - now,
                                                      self.flush_flood, conn.source)
            return
        window[1] += 1
        self.event("closed a connection without a hello", conn.address, conn.node, why,
                   source=conn.source, connections=1)

    def flush_flood(self, source: str) -> None:
        """The connections of `source` closed without a hello but not logged one by one."""
        window = self.flood.get(source)
        if window and window[2]:
            n, window[2] = window[2], 0
            self.event("closed a connection without a hello", source, None,
                       f"{n} more connections from {source} closed without a hello within a "
                       "second (not logged one by one)", source=source, connections=n)

    # -- frames --

    def check_frames(self, conn, view) -> tuple[int, FrameError | None]:
        """The whole frames at the start of `view` from connection `conn` (its .node: the peer
        node it is bound to, None until its first frame binds it in plain TCP; .ledger: that
        node's unread window; .unfinished: its ConnLedger) -> (bytes of those that pass, None),
        or the same and the FrameError of the first that does not. Counts the frames that
        pass in `stats`."""
        spec, at = self.spec, 0
        while True:
            try:
                push = parse_frame(view, spec.max_frame_bytes, at)
                if push is None:
                    return at, None
                if conn.node is None:
                    # Plain TCP: the first frame binds the connection to a peer's rank.
                    node = self.node_of.get(push.sender_rank)
                    if node is None:
                        raise FrameError(f"a Push claiming sender rank {push.sender_rank}, "
                                         f"which is not a peer of this party (rank "
                                         f"{spec.rank}; peers {sorted(self.rank_of.values())})")
                    conn.node = conn.unfinished.node = node
                if conn.ledger is None:     # one per peer node, shared by its connections
                    conn.ledger = self.ledger(conn.node)
                rank = self.rank_of[conn.node]
                check_push(push, bound_rank=rank, my_rank=spec.rank,
                           link_id=self.link_id, max_message_bytes=self.max_message_bytes,
                           book=self.book, conn=conn.unfinished, peer=conn.ledger,
                           max_unread=0 if conn.node in self.no_window else self.max_unread)
                if push.seq and push.key not in CONTROL_KEYS \
                        and not CONNECT_KEY.fullmatch(push.key):
                    self.note_seq(conn.unfinished, rank, push)
            except FrameError as err:
                return at, err
            at += push.frame_bytes
            self.stats["frames"] += 1
            size = push.message_length if push.message_length is not None else push.chunk_bytes
            if size > self.stats["max_message"]:
                self.stats["max_message"] = size

    def note_seq(self, conn: ConnLedger, rank: int, push: Push) -> None:
        """Message `push.seq` of `rank` arrived on `conn` under `push.key`: FrameError if that
        number came under another key before (two senders claim the rank: in plain TCP any
        process here can; yacl keeps the first message and drops this one)."""
        table = self.seen.setdefault(rank, {})
        slot = push.seq % SEEN_SLOTS
        before = table.get(slot)
        if before is not None and before[0] == push.seq and before[1] != push.key:
            err = FrameError(
                f"message {push.seq} of rank {rank} under the key {push.key[:80]!r} on "
                f"{conn.label()}, after it came under the key {before[1][:80]!r} on "
                f"{before[2]}: two connections claim rank {rank}, and yacl keeps the first")
            err.anonymous = self.spec.tls is None
            err.kind = FORGED
            raise err
        if before is None or before[0] != push.seq:
            table[slot] = (push.seq, push.key, conn.label())

    def event(self, kind: str, peer_address: str, node: str | None, why: str,
              **extra) -> None:
        who = f"{node} ({peer_address})" if node else peer_address
        line = f"[party {self.spec.party}] front: {kind} from {who}: {why}"
        print(line, file=sys.stderr, flush=True)
        record = {"t": time.time(), "kind": kind, "address": peer_address, "node": node,
                  "why": why, **extra}
        with open(self.spec.events_path, "a") as f:
            f.write(json.dumps(record) + "\n")


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
        self.pipe: _Relay | None = None     # brpc's side: its replies come back through it
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
            _, pipe = await loop.create_unix_connection(lambda: _Relay(self),
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


class _Relay(asyncio.Protocol):
    """A raw relay half: bytes in go to `other`'s transport (kept until it has one); closing
    one side closes the other. Carries brpc's replies back to an _Inbound connection, and both
    directions of an outbound connection."""

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


class _Outbound(_Relay):
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
        asyncio.ensure_future(_outbound(self.front, self.peer, self, self.ctx))

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


def _client_context(tls: dict) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False      # the identity rule is checked on the certificate
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(tls["ca"])
    ctx.load_cert_chain(tls["cert"], tls["key"])
    return ctx


def _server_context(tls: dict) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(tls["ca"])
    ctx.load_cert_chain(tls["cert"], tls["key"])
    return ctx


async def _outbound(front: Front, peer: str, local: _Outbound,
                    ctx: ssl.SSLContext | None) -> None:
    """brpc's plain connection to `peer` -> a connection to the peer's front (TLS with `ctx`:
    relayed once the peer's certificate names `peer` and its host; plain TCP without)."""
    loop = asyncio.get_running_loop()
    info = front.spec.peers[peer]
    host, _, port = info["address"].rpartition(":")
    try:
        transport, remote = await loop.create_connection(_Relay, host, int(port), ssl=ctx)
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


def _announce_error(announce, error: str, kind: str) -> None:
    announce(json.dumps({"error": error, "kind": kind}))
    raise SystemExit(2)


async def serve(spec: FrontSpec, announce=print) -> None:
    """Bind the public port (and, with an outbound side, one Unix socket per peer in the
    party's private directory), announce, serve."""
    loop = asyncio.get_running_loop()
    front = Front(spec)
    server_ctx = _server_context(spec.tls) if spec.tls else None
    try:
        server = await loop.create_server(lambda: _Inbound(front, server_ctx), spec.listen_host,
                                          spec.listen_port, reuse_address=True)
    except OSError as err:
        _cannot_listen(spec, err, announce)
    outbound = {}
    servers = [server]      # held: a server object that is collected stops listening
    if spec.tls or spec.relay_outbound:
        client_ctx = _client_context(spec.tls) if spec.tls else None
        for peer in spec.peers:
            path = outbound_socket(spec.private_dir, peer)
            servers.append(await loop.create_unix_server(
                lambda peer=peer: _Outbound(front, peer, client_ctx), path))
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


def _die_with_parent() -> None:
    """Die (SIGKILL) with the party's worker that started this front (Linux prctl
    PR_SET_PDEATHSIG; the front must never outlive its party and hold its port)."""
    import os
    import signal
    parent = os.environ.pop("MPCACHE_DIE_WITH_PARENT", None)
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != int(parent):
        os._exit(1)


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


# ----- the front in C for plain TCP (fast_front.c) -------------------------------------------

FAST_FRONT_SOURCE = pathlib.Path(__file__).with_name("fast_front.c")
# Where scripts/setup.sh builds it (beside the venv's python), and the variable that picks
# another build ("off": always this file's front).
FAST_FRONT_NAME = "mpcache-fast-front"
FAST_FRONT_ENV = "MPCACHE_FAST_FRONT"


def fast_front_source_hash() -> str:
    return hashlib.sha256(FAST_FRONT_SOURCE.read_bytes()).hexdigest()


def _installed_fast_front() -> pathlib.Path:
    """Where scripts/setup.sh builds the front in C: beside this venv's python."""
    return pathlib.Path(sys.prefix) / "bin" / FAST_FRONT_NAME


def _built_from(binary: pathlib.Path) -> str | None:
    """The source hash `binary` was built from (its .sha256 beside it), None if unknown."""
    try:
        return pathlib.Path(f"{binary}.sha256").read_text().strip()
    except OSError:
        return None


def build_fast_front(binary: pathlib.Path) -> str | None:
    """Compile fast_front.c into `binary` (cc, OpenSSL's libcrypto), and beside it
    `binary`.sha256 naming the source it was built from -> None, or why it could not."""
    import subprocess
    import tempfile
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=binary.parent) as scratch:
        built = pathlib.Path(scratch) / binary.name
        try:
            made = subprocess.run(["cc", "-O2", "-pthread", "-o", str(built),
                                   str(FAST_FRONT_SOURCE), "-lcrypto"],
                                  capture_output=True, text=True)
        except OSError as err:
            return f"no C compiler ({err.strerror})"
        if made.returncode != 0:
            last = made.stderr.strip().splitlines()[-1:]
            if not last:
                return "cc failed"
            return "cc failed (OpenSSL's headers, Debian's libssl-dev?): " + last[0][:300]
        built.replace(binary)
    pathlib.Path(f"{binary}.sha256").write_text(fast_front_source_hash() + "\n")
    return None


def fast_front_binary(spec: FrontSpec) -> pathlib.Path | None:
    """The C front to run in this process's place for `spec`, or None: only in plain TCP
    with no outbound side and no shaping on an IP address, and only a build of this
    checkout's fast_front.c (its .sha256 beside it); MPCACHE_FAST_FRONT names another build
    or is "off"."""
    import ipaddress
    import os
    choice = os.environ.get(FAST_FRONT_ENV, "")
    if choice == "off" or spec.tls is not None or spec.relay_outbound or spec.delay_s > 0 \
            or spec.rate_bytes_s:
        return None
    try:
        ipaddress.ip_address(spec.listen_host)
    except ValueError:
        return None
    binary = pathlib.Path(choice) if choice else _installed_fast_front()
    built_from = _built_from(binary)
    if built_from is None:
        if choice:
            print(f"[party {spec.party}] front: {FAST_FRONT_ENV}={choice} has no .sha256 beside "
                  "it (build it with front.build_fast_front); running front.py",
                  file=sys.stderr, flush=True)
        return None
    if built_from != fast_front_source_hash():
        print(f"[party {spec.party}] front: {binary} was built from another fast_front.c; "
              "running front.py (rebuild: bash scripts/setup.sh)", file=sys.stderr, flush=True)
        return None
    return binary


def _cannot_listen(spec: FrontSpec, err: OSError, announce) -> None:
    kind = "address in use" if err.errno == errno.EADDRINUSE else "cannot listen"
    announce(json.dumps({"error": f"{spec.listen_host}:{spec.listen_port}: {err.strerror}",
                         "kind": kind}))
    raise SystemExit(2)


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


def fast_front_args(spec: FrontSpec) -> list[str]:
    """The C front's arguments after LISTEN_FD (fast_front.c's usage)."""
    peers = [str(x) for node, p in spec.peers.items() for x in (node, int(p["rank"]))]
    return [spec.backend_path, spec.party, str(spec.rank), spec.link_id, spec.hello_key,
            str(spec.max_frame_bytes), str(spec.max_message_bytes),
            str(spec.max_buffered_bytes), spec.events_path,
            str(round(spec.frame_deadline_s * 1000)), str(spec.max_connections),
            str(spec.max_per_source)] + peers


def install_fast_front() -> str:
    """Build fast_front.c beside this venv's python unless the build there is of this source
    (scripts/setup.sh: `python runtime/distributed/front.py --build-fast-front`) -> what
    happened, one line."""
    binary = _installed_fast_front()
    if _built_from(binary) == fast_front_source_hash():
        return f"the parties' front in C is up to date ({binary})"
    why = build_fast_front(binary)
    if why:
        return (f"the parties' front in C was not built ({why}); every party runs front.py: the "
                "same checks, about twice the CPU per relayed frame")
    return f"built the parties' front in C for plain-TCP runs ({binary})"


def main(argv: list[str]) -> int:
    if argv[1:] == ["--build-fast-front"]:
        print("setup: " + install_fast_front())
        return 0
    _die_with_parent()
    spec = FrontSpec.from_json(argv[1])
    announce = lambda line: print(line, flush=True)    # noqa: E731
    why = check_private_dir(spec)
    if why:
        _announce_error(announce, why, "front")
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
