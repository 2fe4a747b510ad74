"""The front's rules for a peer's frames (frames.py reads them). A frame is dropped and its
connection closed, with an event naming the peer, when: its body exceeds `max_frame_bytes`
(yacl's chunks: the link's http_max_payload_size, 1 MiB); a declared message length exceeds
`max_message_bytes` (party_front.message_cap_bytes); a chunk does not fit its message or
restates another length; the sender rank is not the connection's node (under TLS: its
certificate; in plain TCP: its first frame), or is this party, or the key's `src->dst` is
not `bound rank -> this party`; the unfinished chunked messages the connection started would
hold more than `max_buffered_bytes` or number more than MAX_UNFINISHED_MESSAGES (its own
budget, cleared when it closes: UnfinishedBook), or those of all connections together, with
what closed ones left unfinished (the worker still holds their buffers), (peers + 1) times
that (the event then names the connection that holds the most); with an outbound side, the
peer would have more than `max_unread_messages` complete messages this party has not read
(PeerLedger). A message number of a rank under a second key: FORGED (Front.note_seq).
Standard library only.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys

from runtime.distributed.frames import FrameError, Push, parse_frame, sequence_number

# The most chunked messages one peer may have unfinished at once. An honest peer has a few
# (yacl's throttle window holds at most 10 messages in flight); without a bound a peer could
# declare millions of one-byte messages within max_buffered_bytes.
MAX_UNFINISHED_MESSAGES = 64
# The sequence numbers of the messages each peer rank delivered, in a table of this many slots
# (slot = seq mod SEEN_SLOTS): a number that comes back under another key is a second sender
# for that rank (yacl keeps the message that came first and drops the other as a duplicate).
SEEN_SLOTS = 4096
FORGED = "dropped a forged message and closed the connection"


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

