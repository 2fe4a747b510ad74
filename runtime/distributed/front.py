"""The front door of a party: the only socket of a party that a peer can reach.

Every party's public link port ("nodes" in the node config) is served by this front, a small
asyncio TCP relay owned by the project; SPU's brpc server listens on 127.0.0.1 behind it.
For each incoming connection the front

1. under TLS, terminates mutual TLS: the client certificate must chain to `link.tls.ca`,
   have CN = a node id of the config (not this party's) and a subjectAltName for that node's
   host (the identity rule of config.py). The connection is bound to that node;
2. reads its first 4 bytes: b"PRPC" starts a brpc (baidu_std) stream, b"MPCH" the project's
   hello (`hello_answer`, what liveness probes check), anything else is refused and closed;
3. reads every brpc frame header before forwarding anything of it. A frame is

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
   chunked messages of one peer would hold more than `max_buffered_bytes` or number more than
   MAX_UNFINISHED_MESSAGES; with an outbound
   side (TLS, or plain TCP to remote peers), the peer would have more than
   `max_unread_messages` complete messages this party has not read (PeerLedger: the outbound
   side reads this party's acknowledgements).

Frames are relayed whole (store and forward, at most one frame of `max_frame_bytes` buffered
per connection), so nothing that fails a check reaches brpc. Under TLS, and in plain TCP when a
peer is not on loopback (`relay_outbound`), a party's outgoing brpc connections also go through
this process: brpc connects in plain TCP to a local port per peer (`outbound`), the front
opens the connection to the peer's front (under TLS with this party's certificate, checking
the peer's certificate by the identity rule before relaying a byte) and reads the
acknowledgements among brpc's requests.

Events (a refused connection, a dropped frame) are printed as one `[party X] front: ...`
line each on stderr and appended as JSON lines to `events_path`, which the party's worker
and supervisor read to name the peer when the run then fails.

In plain TCP without an outbound side or shaping (every party on loopback), when
scripts/setup.sh has built fast_front.c, this process binds the public port, announces, and
executes that program in its place: the same rules, messages and events in C, for about half
the CPU per relayed frame (tests: every plain-TCP fault case against both, and a differential
fuzz of their verdicts). MPCACHE_FAST_FRONT=off keeps this file's front.

Runs as its own process (`python front.py SPEC_JSON`, stdlib only: it imports nothing of the
project but its sibling certs.py), started by the party's worker (`party.start_front`); on start-up it
prints one JSON line {"ready": true, "backend_port": P, "outbound": {node: port}} or
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
import pathlib
import re
import socket
import ssl
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
# Per-connection socket buffers of the relay (flow control: reading pauses above this).
HIGH_WATER_BYTES = 4 << 20
# An inbound connection's first read buffer; it grows (doubling) to hold a whole frame.
READ_BYTES = 64 << 10


class FrameError(ValueError):
    """A peer's bytes broke the front's rules; the message says which and how."""


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
    """What one peer node has in flight: unfinished chunked messages {key: [length, got]};
    with an outbound side also its complete messages this party has not read yet {seq: bytes}
    (`unread`: yacl acknowledges a message, naming its sequence number, when the program reads
    it, and a sender waits for acknowledgements once `throttle window` messages are unread, so
    an honest peer never has more unread here). `read_floor`/`read_above`: the sequence numbers
    already acknowledged (all up to the floor, and those above it), so that a retried
    delivery of a read message is not counted again."""

    unfinished: dict[bytes, list[int]] = dataclasses.field(default_factory=dict)
    unread: dict[int, int] = dataclasses.field(default_factory=dict)
    read_floor: int = 0
    read_above: set = dataclasses.field(default_factory=set)
    most_unread: int = 0       # the most messages held unread at once so far

    @property
    def buffered(self) -> int:
        return sum(length for length, _ in self.unfinished.values())

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


# MPCACHE_FRONT_DEBUG_KEYS=1: print each new shape of key seen (digits as N), once.
import os as _os
DEBUG_KEYS: set = {b""} if _os.environ.get("MPCACHE_FRONT_DEBUG_KEYS") else set()
CONTROL_KEYS = (b"ACK", b"FIN")
CONNECT_KEY = re.compile(rb"connect_(\d{1,4})$")


def check_push(push: Push, *, bound_rank: int, my_rank: int, link_id: bytes,
               max_message_bytes: int, max_buffered_bytes: int, ledger: PeerLedger,
               max_unread: int = 0) -> None:
    """The rules of the module docstring for one parsed frame from the peer of `bound_rank`;
    updates `ledger` (and its unread window when `max_unread` > 0). Raises FrameError."""
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
            ledger.received(push.seq, push.chunk_bytes, max_unread)
        return
    length, offset = push.message_length, push.chunk_offset
    if length > max_message_bytes:
        raise FrameError(f"a chunked message declaring {length:,} bytes, over the cap of "
                         f"{max_message_bytes:,} (the largest the job's programs receive)")
    if offset > length or push.chunk_bytes > length - offset:
        raise FrameError(f"a chunk at offset {offset:,} of {push.chunk_bytes:,} bytes that "
                         f"does not fit its message of {length:,} bytes")
    entry = ledger.unfinished.get(push.key)
    if entry is None:
        if len(ledger.unfinished) >= MAX_UNFINISHED_MESSAGES:
            raise FrameError(f"{len(ledger.unfinished) + 1} unfinished chunked messages in "
                             f"flight, over the per-peer cap of {MAX_UNFINISHED_MESSAGES}")
        if ledger.buffered + length > max_buffered_bytes:
            raise FrameError(f"unfinished messages of {ledger.buffered + length:,} bytes in "
                             f"flight, over the per-peer cap of {max_buffered_bytes:,}")
        entry = ledger.unfinished[push.key] = [length, 0]
    elif entry[0] != length:
        raise FrameError(f"a chunk restating its message's length as {length:,} "
                         f"(first {entry[0]:,})")
    entry[1] += push.chunk_bytes
    if entry[1] > length:
        raise FrameError(f"chunks adding up to {entry[1]:,} bytes, over their message's "
                         f"declared {length:,}")
    if entry[1] == length:
        del ledger.unfinished[push.key]
        if max_unread and push.seq:
            ledger.received(push.seq, length, max_unread)


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

@dataclasses.dataclass(frozen=True)
class FrontSpec:
    """Everything the front process needs, as JSON (no config loading in the front).

    peers: {node id: {"rank": int, "host": str, "address": "host:port"}} of every other party;
    sizes in bytes; tls: {"ca", "cert", "key", "verify_depth"} paths or None."""

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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "FrontSpec":
        return cls(**json.loads(text))


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
    """The relay's state: spec, per-peer ledgers, the event log."""

    def __init__(self, spec: FrontSpec, backend_port: int):
        self.spec, self.backend_port = spec, backend_port
        self.hello_key = bytes.fromhex(spec.hello_key)
        self.link_id = spec.link_id.encode()
        self.rank_of = {node: int(p["rank"]) for node, p in spec.peers.items()}
        self.node_of = {r: n for n, r in self.rank_of.items()}
        self.ledgers: dict[str, PeerLedger] = {}
        self.max_unread = spec.max_unread_messages if (spec.tls or spec.relay_outbound) else 0
        self.max_message_bytes = spec.max_message_bytes
        # Relayed so far: frames, bytes, the largest message (declared length) seen.
        self.stats = {"frames": 0, "bytes": 0, "max_message": 0}

    def ledger(self, node: str) -> PeerLedger:
        """The ledger of peer `node` (shared by its inbound connections and the outbound side
        that sees this party's acknowledgements to it)."""
        found = self.ledgers.get(node)
        if found is None:
            found = self.ledgers[node] = PeerLedger()
        return found

    def check_frames(self, conn, view) -> tuple[int, FrameError | None]:
        """The whole frames at the start of `view` from connection `conn` (its .node: the peer
        node it is bound to, None until its first frame binds it in plain TCP; .ledger) ->
        (bytes of those that pass, None), or the same and the FrameError of the first that
        does not. Counts the frames that pass in `stats`."""
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
                    conn.node = node
                if conn.ledger is None:     # one per peer node, shared by its connections
                    conn.ledger = self.ledger(conn.node)
                check_push(push, bound_rank=self.rank_of[conn.node], my_rank=spec.rank,
                           link_id=self.link_id, max_message_bytes=self.max_message_bytes,
                           max_buffered_bytes=spec.max_buffered_bytes, ledger=conn.ledger,
                           max_unread=self.max_unread)
            except FrameError as err:
                return at, err
            at += push.frame_bytes
            self.stats["frames"] += 1
            size = push.message_length if push.message_length is not None else push.chunk_bytes
            if size > self.stats["max_message"]:
                self.stats["max_message"] = size

    def event(self, kind: str, peer_address: str, node: str | None, why: str) -> None:
        who = f"{node} ({peer_address})" if node else peer_address
        line = f"[party {self.spec.party}] front: {kind} from {who}: {why}"
        print(line, file=sys.stderr, flush=True)
        record = {"t": time.time(), "kind": kind, "address": peer_address, "node": node,
                  "why": why}
        with open(self.spec.events_path, "a") as f:
            f.write(json.dumps(record) + "\n")


class _Inbound(asyncio.BufferedProtocol):
    """One connection to the public port: hello or checked brpc frames relayed to brpc.

    The event loop reads straight into `buf` (a BufferedProtocol), which holds at most the
    current frame and the start of the next: a frame spread over many reads is copied once,
    when it is forwarded, not once per read and again when whole."""

    def __init__(self, front: Front):
        self.front = front
        self.buf = bytearray(READ_BYTES)
        self.filled = 0                     # buf[:filled] has been read and not yet forwarded
        # The most buf may grow to: a whole frame of the largest size the link sends (the
        # header was checked before the rest is read) plus one read of the next.
        self.max_buf = HEADER.size + front.spec.max_frame_bytes + READ_BYTES
        self.mode = None
        self.node: str | None = None        # the peer node the connection is bound to
        self.ledger: PeerLedger | None = None   # that node's
        self.pipe: _Relay | None = None     # brpc's side: its replies come back through it
        self.pending: list[bytes] = []
        self.closed = False
        self.free_at = 0.0          # shaping: when this connection's rate is free again
        self.queued = 0             # shaping: bytes waiting for their release time

    def connection_made(self, transport):
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER_BYTES)
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.address = f"{peer[0]}:{peer[1]}"
        if self.front.spec.tls is not None:
            node, why = certificate_node(transport.get_extra_info("peercert"),
                                         self.front.spec.peers)
            if node is None:
                self._refuse("refused a TLS client", why)
                return
            self.node = node

    def _refuse(self, kind: str, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.front.event(kind, self.address, self.node, why)
        self.transport.abort()
        if self.pipe is not None and self.pipe.transport is not None:
            self.pipe.transport.close()

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
                asyncio.ensure_future(self._open_backend())
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
            self._refuse("dropped a frame and closed the connection", str(err))
            return
        if at:
            rest = self.filled - at
            self.buf[:rest] = self.buf[at:self.filled]
            self.filled = rest

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
        else:
            self.pending.append(chunk)

    async def _open_backend(self):
        loop = asyncio.get_running_loop()
        try:
            _, pipe = await loop.create_connection(lambda: _Relay(self), "127.0.0.1",
                                                   self.front.backend_port)
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


class _Outbound(_Relay):
    """The local half of an outbound relay: this party's brpc requests to `peer`, read for
    the acknowledgements that mark the peer's messages as read (PeerLedger.unread) before
    they are forwarded."""

    def __init__(self, front: Front, peer: str, ctx: ssl.SSLContext | None):
        super().__init__()
        self.front, self.peer, self.ctx = front, peer, ctx
        self.ledger = front.ledger(peer) if front.max_unread else None
        self.buf = bytearray()

    def connection_made(self, transport):
        super().connection_made(transport)
        asyncio.ensure_future(_outbound(self.front, self.peer, self, self.ctx))

    def data_received(self, data):
        if self.ledger is not None:
            self.buf += data
            try:
                del self.buf[:note_acknowledgements(self.buf, 0, self.front.spec.max_frame_bytes,
                                                    self.ledger)]
            except FrameError as err:
                # Never from this party's own brpc: stop reading rather than hold its peer to
                # a window it can no longer see released.
                self.front.event("stopped reading this party's frames", "outbound",
                                 self.peer, str(err))
                self.front.max_unread = 0
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def serve(spec: FrontSpec, announce=print) -> None:
    """Bind the public port (and, with an outbound side, one local port per peer), announce,
    serve."""
    loop = asyncio.get_running_loop()
    backend_port = free_port()
    front = Front(spec, backend_port)
    server_ctx = _server_context(spec.tls) if spec.tls else None
    try:
        server = await loop.create_server(lambda: _Inbound(front), spec.listen_host,
                                          spec.listen_port, ssl=server_ctx,
                                          reuse_address=True)
    except OSError as err:
        _cannot_listen(spec, err, announce)
    outbound = {}
    servers = [server]
    if spec.tls or spec.relay_outbound:
        client_ctx = _client_context(spec.tls) if spec.tls else None
        for peer in spec.peers:
            srv = await loop.create_server(lambda peer=peer: _Outbound(front, peer, client_ctx),
                                           "127.0.0.1", 0)
            servers.append(srv)
            outbound[peer] = srv.sockets[0].getsockname()[1]
    announce(json.dumps({"ready": True, "backend_port": backend_port, "outbound": outbound}))

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
    import os
    family = socket.AF_INET6 if ":" in spec.listen_host else socket.AF_INET
    try:
        listener = socket.create_server((spec.listen_host, spec.listen_port), family=family)
    except OSError as err:
        _cannot_listen(spec, err, announce)
    backend_port = free_port()
    announce(json.dumps({"ready": True, "backend_port": backend_port, "outbound": {},
                         "program": "fast_front"}))
    os.set_inheritable(listener.fileno(), True)
    peers = [str(x) for node, p in spec.peers.items() for x in (node, int(p["rank"]))]
    os.execv(binary, [str(binary), str(listener.fileno()), str(backend_port), spec.party,
                      str(spec.rank), spec.link_id, spec.hello_key, str(spec.max_frame_bytes),
                      str(spec.max_message_bytes), str(spec.max_buffered_bytes),
                      spec.events_path] + peers)


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
    fast = fast_front_binary(spec)
    if fast is not None:
        exec_fast_front(spec, fast, announce)
    _keep_freed_memory(spec.max_frame_bytes)
    try:
        import uvloop      # optional: about 2x less CPU per relayed frame than asyncio's loop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve(spec, announce=announce))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
