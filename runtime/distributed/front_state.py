"""A party's front as data: what it is told (FrontSpec, JSON on its command line), the
connections it counts (caps per source address and in all: a new one over a cap closes the
oldest of that scope without a hello, else it is refused; those closed without a hello are
logged per source, FLOOD_EVENTS_PER_S lines a second, so that blame can name a flood), the
rules it applies to each connection's frames (`Front.check_frames`: rules.py, and message
numbers seen under a second key, FORGED) and its events (a `[party X] front: ...` line on
stderr and a JSON line in `events_path` each). Standard library only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import sys
import time
from typing import Any

from runtime.distributed.frames import FrameError, Push, parse_frame
from runtime.distributed.rules import (CONNECT_KEY, CONTROL_KEYS, FORGED, SEEN_SLOTS, ConnLedger,
                                       PeerLedger, UnfinishedBook, check_push)

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


