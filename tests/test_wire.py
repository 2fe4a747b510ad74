"""The wire format between parties (runtime/distributed/wire.py): no process, no link.

A peer's message is only ever parsed as a JSON header + SPU value protobufs checked field by
field against what the receiver expects; anything else is a WireError naming the sender, and
nothing a peer sends is unpickled (a pickle that would run a command is built here as bytes,
never loaded, and the marker file its command would create must not appear).
"""
from __future__ import annotations

import json
import os
import pickle
import struct

import numpy as np
import pytest
import spu

from experiments.faults.forge import pb_field
from runtime.distributed import wire
from runtime.distributed.wire import ShareSpec, WireError

SENDER = "node:0"
PARTIES = {"ABY3": 3, "SEMI2K": 2}


def make_io(protocol: str, field=spu.FieldType.FM64):
    config = spu.RuntimeConfig(protocol=getattr(spu.ProtocolKind, protocol), field=field,
                               fxp_fraction_bits=18)
    return spu.Io(PARTIES[protocol], config)


def shares_of(x, protocol="ABY3", visibility=spu.Visibility.VIS_SECRET, **kw):
    io = make_io(protocol, **kw)
    if visibility == spu.Visibility.VIS_SECRET:
        return io.make_shares(np.asarray(x), visibility, owner_rank=0)
    return io.make_shares(np.asarray(x), visibility)


def input_spec(name, shape, dtype, protocol="ABY3", rank=1) -> ShareSpec:
    """What NodeBackend expects for a secret input: scaled from a one-element share made here."""
    ref = shares_of(np.zeros((1,), dtype), protocol)[rank]
    per_element = sum(wire.chunk_content_size(bytes(c)) for c in ref.share_chunks)
    return ShareSpec.for_input(name, shape, bytes(ref.meta), per_element)


def rejected(fn, *args, match: str | None = None) -> WireError:
    with pytest.raises(WireError) as info:
        fn(*args)
    err = info.value
    assert err.party == SENDER and str(err).startswith(f"party {SENDER} sent "), str(err)
    if match is not None:
        assert match in str(err), str(err)
    return err


# ----- protobuf helpers to forge messages ----------------------------------------------------
def chunk_proto(total: int, offset: int, content: bytes) -> bytes:
    return pb_field(1, total) + pb_field(2, offset) + pb_field(3, content)


def share_message(name: str, meta: bytes, chunks: list[bytes]) -> bytes:
    return wire.pack({"kind": "share", "name": name, "meta": len(meta),
                      "chunks": [len(c) for c in chunks]}, meta + b"".join(chunks))


# ----- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["ABY3", "SEMI2K"])
@pytest.mark.parametrize("x", [np.arange(-3, 3, dtype=np.float32).reshape(2, 3) / 4,
                               np.arange(7, dtype=np.int32) * 1000 - 3000],
                         ids=["float32", "int32"])
def test_a_real_share_round_trips_and_reconstructs(protocol, x):
    io = make_io(protocol)
    shares = io.make_shares(x, spu.Visibility.VIS_SECRET, owner_rank=0)
    received = []
    for rank, share in enumerate(shares):
        message = wire.encode_share("v7", share)
        # Each receiver's expectation: from the program's input (owner side) or from its own
        # share of the same value (output side); both accept an honest share.
        spec = input_spec("v7", x.shape, x.dtype, protocol, rank)
        got = wire.decode_share(message, spec, SENDER)
        again = wire.decode_share(message, ShareSpec.like("v7", share), SENDER)
        assert bytes(got.meta) == bytes(share.meta) == bytes(again.meta)
        assert [bytes(c) for c in got.share_chunks] == [bytes(c) for c in share.share_chunks]
        received.append(got)
    value = np.asarray(io.reconstruct(received))
    assert value.dtype == x.dtype
    np.testing.assert_allclose(value, x, atol=1e-4)


def test_an_empty_value_round_trips():
    """SPU serializes a zero-size value without chunks; that is accepted only when expected."""
    io = make_io("ABY3")
    shares = io.make_shares(np.zeros((0, 4), np.float32), spu.Visibility.VIS_SECRET, owner_rank=0)
    got = [wire.decode_share(wire.encode_share("v", s), ShareSpec.like("v", s), SENDER)
           for s in shares]
    assert np.asarray(io.reconstruct(got)).shape == (0, 4)
    rejected(wire.decode_share, wire.encode_share("v", shares[1]),
             ShareSpec.like("v", make_io("ABY3").make_shares(
                 np.zeros((1, 4), np.float32), spu.Visibility.VIS_SECRET, owner_rank=0)[1]),
             SENDER, match="shape")


def test_json_messages_round_trip():
    message = wire.encode_json("decision", {"stop": False, "n": 3})
    assert wire.decode_json(message, "decision", SENDER) == {"stop": False, "n": 3}
    text = wire.json_text("done", True)
    assert wire.from_json_text(text.encode(), "done", SENDER) is True


# ----- a pickle is never loaded --------------------------------------------------------------
class _Command:
    """Pickles to a call of os.system(command): what a hostile peer would send."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fail the test if anything calls the pickle loaders while decoding."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a peer's bytes were unpickled")
    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)


def test_a_pickle_from_a_peer_is_rejected_by_name_and_nothing_runs(tmp_path, no_unpickling):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Command(f"touch {marker}"))      # bytes only: never loaded
    real = shares_of(np.ones((2, 3), np.float32))[1]
    spec = ShareSpec.like("v1", real)
    good_meta = bytes(real.meta)
    good_chunks = [bytes(c) for c in real.share_chunks]

    rejected(wire.decode_share, evil, spec, SENDER)                    # the raw pickle
    rejected(wire.decode_share, pickle.dumps(real), spec, SENDER)      # a pickled libspu.Share
    rejected(wire.decode_share, share_message("v1", evil, good_chunks), spec, SENDER)
    rejected(wire.decode_share, share_message("v1", good_meta, [evil]), spec, SENDER)
    rejected(wire.decode_share, wire.pack({"kind": "pickle", "name": "v1"}, evil), spec, SENDER)
    rejected(wire.decode_json, evil, "decision", SENDER)
    rejected(wire.decode_json, wire.pack({"kind": "json", "name": "decision", "size": len(evil)},
                                         evil), "decision", SENDER)
    rejected(wire.from_json_text, evil, "done", SENDER)
    assert not marker.exists()


# ----- wrong type, shape, visibility, storage --------------------------------------------------
def test_a_share_with_the_wrong_dtype_is_rejected():
    spec = input_spec("v1", (2, 3), np.float32)
    message = wire.encode_share("v1", shares_of(np.ones((2, 3), np.int32))[1])
    rejected(wire.decode_share, message, spec, SENDER, match="wrong data type: shape (2, 3) "
                                                             "int32 secret")


@pytest.mark.parametrize("shape", [(3, 2), (6,), (2, 3, 1), (2, 4)])
def test_a_share_with_the_wrong_shape_is_rejected(shape):
    spec = input_spec("v1", (2, 3), np.float32)
    message = wire.encode_share("v1", shares_of(np.ones(shape, np.float32))[1])
    rejected(wire.decode_share, message, spec, SENDER, match="wrong shape")


def test_a_public_value_where_a_share_is_expected_is_rejected():
    spec = input_spec("v1", (2, 3), np.float32)
    public = shares_of(np.ones((2, 3), np.float32), visibility=spu.Visibility.VIS_PUBLIC)[1]
    rejected(wire.decode_share, wire.encode_share("v1", public), spec, SENDER,
             match="float32 public Pub2k<FM64>, expected shape (2, 3) float32 secret")


@pytest.mark.parametrize("protocol,field", [("SEMI2K", spu.FieldType.FM64),
                                            ("ABY3", spu.FieldType.FM128)])
def test_a_share_of_another_protocol_or_field_is_rejected(protocol, field):
    spec = input_spec("v1", (2, 3), np.float32, "ABY3")
    other = shares_of(np.ones((2, 3), np.float32), protocol, field=field)[1]
    rejected(wire.decode_share, wire.encode_share("v1", other), spec, SENDER, match="storage")


def test_a_meta_with_extra_or_complex_fields_is_rejected():
    real = shares_of(np.ones((2, 3), np.float32))[1]
    spec = ShareSpec.like("v1", real)
    chunks = [bytes(c) for c in real.share_chunks]
    meta = bytes(real.meta)
    rejected(wire.decode_share, share_message("v1", meta + pb_field(2, 1), chunks), spec,
             SENDER, match="wrong complex flag")
    rejected(wire.decode_share, share_message("v1", meta + pb_field(9, 1), chunks), spec,
             SENDER, match="unexpected field 9")
    rejected(wire.decode_share, share_message("v1", meta + pb_field(3, 2), chunks), spec,
             SENDER, match="repeats field 3")


# ----- framing: truncated, oversized, extra bytes, forged chunks ------------------------------
def test_truncated_oversized_and_padded_messages_are_rejected():
    real = shares_of(np.ones((2, 3), np.float32))[1]
    spec = ShareSpec.like("v1", real)
    message = wire.encode_share("v1", real)
    for broken in (b"", message[:3], message[:10], message[:-1], message[:-40]):
        rejected(wire.decode_share, broken, spec, SENDER)
    rejected(wire.decode_share, message + b"\0", spec, SENDER, match="do not add up")
    rejected(wire.decode_share, struct.pack(">I", wire.MAX_HEADER_BYTES + 1) + message, spec,
             SENDER, match="not a typed message")
    rejected(wire.decode_share, struct.pack(">I", 50) + b"{}", spec, SENDER)
    # A header nested deeply enough to exhaust the JSON parser's recursion.
    deep = b"[" * 50_000
    rejected(wire.decode_share, struct.pack(">I", len(deep)) + deep, spec, SENDER,
             match="unreadable message header")
    rejected(wire.decode_share, wire.pack({"kind": "share", "name": "v1", "meta": True,
                                           "chunks": [1]}, b"xx"), spec, SENDER)


def test_forged_chunks_are_rejected_before_spu_copies_them():
    real = shares_of(np.ones((2, 3), np.float32))[1]
    spec = ShareSpec.like("v1", real)
    meta, n = bytes(real.meta), spec.content_bytes
    content = b"\1" * n
    # Honest framing in two contiguous chunks is accepted.
    two = [chunk_proto(n, 0, content[:40]), chunk_proto(n, 40, content[40:])]
    wire.decode_share(share_message("v1", meta, two), spec, SENDER)
    cases = {
        "more content than the value": [chunk_proto(n + 8, 0, content + b"\2" * 8)],
        "less content": [chunk_proto(n, 0, content[:-8])],
        "a chunk past the end": [chunk_proto(n, 8, content)],
        "overlapping chunks": [chunk_proto(n, 0, content[:40]), chunk_proto(n, 32, content[32:])],
        "a lying total size": [chunk_proto(2 * n, 0, content)],
        "an unknown chunk field": [chunk_proto(n, 0, content) + pb_field(7, 1)],
        "no chunks": [],
    }
    for case, chunks in cases.items():
        with pytest.raises(WireError, match=f"party {SENDER} sent"):
            wire.decode_share(share_message("v1", meta, chunks), spec, SENDER)


# ----- wrong name or kind ----------------------------------------------------------------------
def test_a_message_with_the_wrong_name_or_kind_is_rejected():
    real = shares_of(np.ones((2, 3), np.float32))[1]
    spec = ShareSpec.like("v1", real)
    rejected(wire.decode_share, wire.encode_share("v2", real), spec, SENDER,
             match="where the share of 'v1' was expected")
    rejected(wire.decode_share, wire.encode_json("v1", [1, 2]), spec, SENDER,
             match="'json' 'v1' where the share")
    rejected(wire.decode_json, wire.encode_share("decision", real), "decision", SENDER)
    rejected(wire.decode_json, wire.encode_json("cost", 1), "decision", SENDER,
             match="where the message 'decision' was expected")
    body = b'{"a": 1}'
    rejected(wire.decode_json, wire.pack({"kind": "json", "name": "decision", "size": 99}, body),
             "decision", SENDER)
    rejected(wire.from_json_text, wire.json_text("other", 1), "done", SENDER)
    rejected(wire.from_json_text, json.dumps([1]), "done", SENDER)
    rejected(wire.from_json_text, "[" * 50_000, "done", SENDER)
