"""What parties send each other: typed messages checked against what the receiver expects.

Parties do not trust each other, so nothing received is ever deserialized into objects that
can run code (no pickle). A message is

    4-byte big-endian header length | UTF-8 JSON header | payload bytes

with the header naming the message's kind and name and describing the payload exactly:

- "share": one party's share of one value: the SPU value meta (a small protobuf) and its
  chunks. The receiver checks name, shape, dtype, complex flag, visibility and storage type
  (decoded from the meta by a minimal, strict protobuf reader: SPU's fields only, each once)
  and every chunk's declared total size, offset and content size against the value it expects
  (the compiled program's input, or the output it asked for), before SPU sees a byte.
- "json": a small public control message (a decision, a digest, a cost record) parsed with
  `json` (data only) and checked by the caller.

Anything else (another kind, another name, a wrong shape or dtype, extra or missing bytes, an
oversized header) raises `WireError` naming the sender.
"""
from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

MAX_HEADER_BYTES = 1 << 16
MAX_JSON_BYTES = 1 << 24


class WireError(ValueError):
    """A peer sent a message that is not what this party expects; `party` names the sender."""

    def __init__(self, party: str, message: str):
        super().__init__(f"party {party} sent {message}")
        self.party = party


# ----- framing -----------------------------------------------------------------------------------
def pack(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(head)) + head + payload


def unpack(message: bytes, sender: str) -> tuple[dict, memoryview]:
    if not isinstance(message, (bytes, bytearray, memoryview)) or len(message) < 4:
        raise WireError(sender, "a message without a header")
    size = struct.unpack(">I", bytes(message[:4]))[0]
    if size > MAX_HEADER_BYTES or 4 + size > len(message):
        raise WireError(sender, f"a message that is not a typed message (its header would be "
                                f"{size} bytes: at most {MAX_HEADER_BYTES}, and the message has "
                                f"{len(message)}; a pickle or other foreign bytes?)")
    try:
        header = json.loads(bytes(message[4:4 + size]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise WireError(sender, f"an unreadable message header ({err})") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise WireError(sender, "a message header that is not a JSON object with a 'kind'")
    return header, memoryview(message)[4 + size:]


# ----- SPU value meta (protobuf ValueMetaProto: 1 data_type, 3 visibility, 4 shape, 5 storage) -----
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message: varints and length-delimited
    fields only (what SPU's value metas use); anything else is an error."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("truncated field")
            value, pos = bytes(buf[pos:pos + size]), pos + size
        else:
            raise ValueError(f"unexpected wire type {wire}")
        out.append((field, wire, value))
    return out


def _strict_fields(buf: bytes, allowed: dict[int, int], what: str) -> dict[int, Any]:
    """{field: value} of a protobuf message that may hold only the `allowed` fields ({field:
    wire type}), each at most once; any other field, wire type or a repeat is a ValueError
    (SPU would otherwise interpret fields this party did not check)."""
    out: dict[int, Any] = {}
    for field, wire, value in _fields(buf):
        if allowed.get(field) != wire:
            raise ValueError(f"{what} has an unexpected field {field} (wire type {wire})")
        if field in out:
            raise ValueError(f"{what} repeats field {field}")
        out[field] = value
    return out


# SPU's DataType and Visibility enums (libspu/spu.proto), for messages.
DATA_TYPES = {0: "invalid", 1: "bool", 2: "int8", 3: "uint8", 4: "int16", 5: "uint16",
              6: "int32", 7: "uint32", 8: "int64", 9: "uint64", 10: "float16", 11: "float32",
              12: "float64"}
VISIBILITIES = {0: "invalid", 1: "secret", 2: "public", 3: "private"}


def describe_meta(shape, data_type, is_complex, visibility, storage) -> str:
    """'shape (2, 3) float32 secret aby3.AShr<FM64>' (for messages)."""
    return (f"shape {tuple(shape)} {DATA_TYPES.get(data_type, data_type)}"
            f"{' complex' if is_complex else ''} {VISIBILITIES.get(visibility, visibility)} "
            f"{storage or '(no storage type)'}")


# ValueMetaProto: 1 data_type, 2 is_complex, 3 visibility, 4 shape (ShapeProto: 1 dims), 5 storage.
_META_FIELDS = {1: 0, 2: 0, 3: 0, 4: 2, 5: 2}
# ValueChunkProto: 1 total_bytes, 2 chunk_offset, 3 content.
_CHUNK_FIELDS = {1: 0, 2: 0, 3: 2}


def parse_meta(meta: bytes) -> dict:
    """{"data_type", "is_complex", "visibility", "shape", "storage"} of a serialized SPU value
    meta; unknown or repeated fields are a ValueError."""
    fields = _strict_fields(meta, _META_FIELDS, "the value meta")
    dims = []
    if 4 in fields:
        for sub, sub_wire, sub_value in _fields(fields[4]):
            if sub != 1:
                raise ValueError(f"the value shape has an unexpected field {sub}")
            if sub_wire == 2:        # packed
                pos = 0
                while pos < len(sub_value):
                    dim, pos = _varint(sub_value, pos)
                    dims.append(dim)
            else:
                dims.append(sub_value)
    try:
        storage = fields.get(5, b"").decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("the storage type is not ASCII") from None
    return {"data_type": fields.get(1, 0), "is_complex": fields.get(2, 0),
            "visibility": fields.get(3, 0), "shape": tuple(dims), "storage": storage}


def parse_chunk(chunk: bytes) -> tuple[int, int, int]:
    """(total_bytes, chunk_offset, content bytes) of a serialized SPU value chunk; unknown or
    repeated fields are a ValueError."""
    fields = _strict_fields(chunk, _CHUNK_FIELDS, "a value chunk")
    return fields.get(1, 0), fields.get(2, 0), len(fields.get(3, b""))


def chunk_content_size(chunk: bytes) -> int:
    """Bytes of content in a serialized SPU value chunk (field 3)."""
    return parse_chunk(chunk)[2]


# ----- shares ------------------------------------------------------------------------------------
class ShareSpec:
    """What a share must look like: name, shape, SPU data type, complex flag, visibility,
    storage type and the exact number of content bytes of its chunks."""

    def __init__(self, name: str, meta: bytes, content_bytes: int, shape=None):
        ref = parse_meta(meta)
        self.name = name
        self.shape = tuple(int(n) for n in (ref["shape"] if shape is None else shape))
        self.data_type, self.is_complex = ref["data_type"], ref["is_complex"]
        self.visibility, self.storage = ref["visibility"], ref["storage"]
        self.content_bytes = int(content_bytes)

    @classmethod
    def for_input(cls, name: str, shape, reference_meta: bytes, bytes_per_element: int):
        """An input of `shape` whose one-element reference share has this meta and content."""
        numel = int(np.prod(tuple(shape), dtype=np.int64))
        return cls(name, reference_meta, numel * bytes_per_element, shape)

    @classmethod
    def like(cls, name: str, share):
        """A peer's share of the value this party holds `share` of (same program and
        protocol: the same meta and content size)."""
        content = sum(chunk_content_size(bytes(c)) for c in share.share_chunks)
        return cls(name, bytes(share.meta), content)

    def describe(self) -> tuple:
        return (self.shape, self.data_type, self.visibility, self.storage)


def encode_share(name: str, share) -> bytes:
    """One libspu.Share as a typed message."""
    chunks = [bytes(c) for c in share.share_chunks]
    meta = bytes(share.meta)
    header = {"kind": "share", "name": name, "meta": len(meta), "chunks": [len(c) for c in chunks]}
    return pack(header, meta + b"".join(chunks))


def _is_size(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def decode_share(message: bytes, spec: ShareSpec, sender: str):
    """The libspu.Share in `message`, after checking it against `spec` (else WireError).

    Checked before SPU sees a byte: kind and name; header sizes against the payload; the value
    meta (only SPU's five fields, each once) against the spec's shape, data type, complex flag,
    visibility and storage; every chunk (only its three fields) declares the expected total
    size, the chunks are contiguous from offset 0 and their content adds up to exactly the
    expected bytes (SPU copies chunk contents at their declared offsets)."""
    import spu.libspu as libspu
    header, payload = unpack(message, sender)
    if header.get("kind") != "share" or header.get("name") != spec.name:
        raise WireError(sender, f"{header.get('kind')!r} {header.get('name')!r} where the share "
                                f"of {spec.name!r} was expected")
    meta_len, chunk_lens = header.get("meta"), header.get("chunks")
    if (not _is_size(meta_len) or not isinstance(chunk_lens, list) or
            not all(_is_size(n) for n in chunk_lens) or
            meta_len + sum(chunk_lens) != len(payload)):
        raise WireError(sender, f"a share of {spec.name!r} whose sizes do not add up "
                                f"(header: meta {meta_len!r}, chunks {str(chunk_lens)[:80]}; "
                                f"payload {len(payload)} bytes)")
    meta = bytes(payload[:meta_len])
    try:
        info = parse_meta(meta)
    except ValueError as err:
        raise WireError(sender, f"an unreadable value meta for {spec.name!r} ({err})") from None
    want = (spec.shape, spec.data_type, spec.is_complex, spec.visibility, spec.storage)
    got = (info["shape"], info["data_type"], info["is_complex"], info["visibility"],
           info["storage"])
    if got != want:
        diff = [what for what, g, w in zip(("shape", "data type", "complex flag", "visibility",
                                            "storage"), got, want) if g != w]
        raise WireError(sender, f"a share of {spec.name!r} with the wrong {', '.join(diff)}: "
                                f"{describe_meta(*got)}, expected {describe_meta(*want)}")
    chunks, pos, offset = [], meta_len, 0
    for i, n in enumerate(chunk_lens):
        chunk = bytes(payload[pos:pos + n])
        pos += n
        try:
            total, chunk_offset, content = parse_chunk(chunk)
        except ValueError as err:
            raise WireError(sender, f"an unreadable chunk {i} of {spec.name!r} ({err})") from None
        if total != spec.content_bytes or chunk_offset != offset:
            raise WireError(sender, f"chunk {i} of {spec.name!r} at offset {chunk_offset} of "
                                    f"{total} bytes, expected offset {offset} of "
                                    f"{spec.content_bytes}")
        offset += content
        chunks.append(chunk)
    if offset != spec.content_bytes:
        raise WireError(sender, f"{offset} bytes of share content for {spec.name!r}, expected "
                                f"{spec.content_bytes}")
    share = libspu.Share()
    share.meta = meta
    share.share_chunks = chunks
    return share


# ----- public control messages ----------------------------------------------------------------------
def encode_json(name: str, value) -> bytes:
    body = json.dumps(value, separators=(",", ":")).encode()
    return pack({"kind": "json", "name": name, "size": len(body)}, body)


def decode_json(message: bytes, name: str, sender: str):
    header, payload = unpack(message, sender)
    if header.get("kind") != "json" or header.get("name") != name:
        raise WireError(sender, f"{header.get('kind')!r} {header.get('name')!r} where the "
                                f"message {name!r} was expected")
    size = header.get("size")
    if not _is_size(size) or len(payload) != size or size > MAX_JSON_BYTES:
        raise WireError(sender, f"a {name!r} message of {len(payload)} bytes")
    try:
        return json.loads(bytes(payload).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise WireError(sender, f"an unreadable {name!r} message ({err})") from None


def json_text(name: str, value) -> str:
    """A named JSON value as text (for the link's all-gather of strings)."""
    return json.dumps({"name": name, "value": value}, separators=(",", ":"))


def from_json_text(text, name: str, sender: str):
    """The value of `json_text(name, value)` from `sender`, checked (else WireError)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str) or len(text) > MAX_JSON_BYTES:
        raise WireError(sender, f"a {name!r} message that is not bounded text")
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise WireError(sender, f"an unreadable {name!r} message ({err})") from None
    if not isinstance(obj, dict) or obj.get("name") != name or "value" not in obj:
        raise WireError(sender, f"{str(obj)[:80]!r} where the message {name!r} was expected")
    return obj["value"]
