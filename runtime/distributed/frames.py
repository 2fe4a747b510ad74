"""The bytes a party's front reads from a peer: brpc frames carrying yacl's Push, and the
fronts' hello. Integers and byte strings are read with bounds checks; nothing a peer sent
becomes an object. A frame is

    b"PRPC" | body_size u32 BE | meta_size u32 BE | RpcMeta (meta_size bytes) | payload

where the payload is yacl's PushRequest protobuf: 1 sender_rank (varint), 2 key (bytes,
"<link id>...:<src>-><dst>\\x01\\x02<seq>" or "connect_<src>\\x01\\x02<seq>"), 3 value,
4 trans_type (1 = chunked), 5 chunk_info {1 message_length, 2 chunk_offset}. The meta must
be a plain `ReceiverService.Push` request (RpcMeta fields 1, 3, 4, 5 only, uncompressed, no
attachment), and a field given twice or a varint over 64 bits is refused (FrameError), as
protobuf would merge the one and cannot read the other. The hello (b"MPCH <nonce hex>")
is what liveness probes send; a front answers it with an HMAC keyed by the node config's
hash. Standard library only (the front is a light process).
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any, NamedTuple

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
