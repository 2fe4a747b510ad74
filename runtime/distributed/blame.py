"""Who failed, and the watchdog that asks from start-up on. The link alone cannot tell who
failed: in a ring protocol every live party is blocked on a neighbour, so the first receive
timeout often points at a live peer that is itself waiting on the dead one. `blame` names
the party from the peer a link error points at, a probe of every peer (is its link endpoint
up, and is it the peer's front: its hello answer and, under TLS, its certificate by the
identity rule) and what this party's front dropped (its events); the Watchdog ends the
party at once, naming the peer, for faults it can see while the run goes on.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import socket
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from runtime.distributed.certs import identity_mismatch, tls_context
from runtime.distributed.config import NodeConfig
from runtime.distributed.frames import (HELLO_MAGIC, HELLO_NONCE_BYTES, check_hello_reply,
                                        hello_request)
from runtime.distributed.party_front import hello_key
from runtime.distributed.process import EXIT_PEER, PartyFailure, exit_now
from runtime.distributed.rules import FORGED


# ----- probes of the peers ------------------------------------------------------------------

# Probe states. Up: ALIVE. Down: REFUSED (nothing listens), SILENT (no answer). TLS faults:
# TLS_REFUSED (the peer aborted the handshake: it does not accept this party's certificate, or
# does not speak TLS), UNTRUSTED (the peer's certificate does not chain to link.tls.ca),
# IMPOSTOR (a CA-signed certificate for another node, by the identity rule in config.py).
# FOREIGN: something answers on the peer's port, but not the hello of this config's front.
ALIVE, REFUSED, SILENT, FOREIGN = "alive", "refused", "silent", "foreign"
TLS_REFUSED, UNTRUSTED, IMPOSTOR = "tls-refused", "untrusted", "impostor"
DOWN = (REFUSED, SILENT)
TLS_FAULTS = (TLS_REFUSED, UNTRUSTED, IMPOSTOR)


@dataclasses.dataclass(frozen=True)
class Probe:
    """One probe of a peer's link endpoint: its state and, for TLS faults, why."""

    state: str
    detail: str = ""


def probe(config: NodeConfig, party_id: str, peer: str, timeout_s: float = 2.0) -> Probe:
    """Is `peer`'s link endpoint up, and is it `peer`'s front?

    Connects to the endpoint; under TLS completes a handshake with this party's own
    certificate and the config's CA and checks the peer's certificate by the identity rule
    (certs.identity_mismatch); then sends the fronts' hello (a fresh nonce) and checks the
    answer is `peer`'s (frames.check_hello_reply, keyed by the config's hash). Anything else
    that answers (a web server, another program, another config's party) is FOREIGN."""
    host, _, port = config.address(peer).rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except ConnectionRefusedError:
        return Probe(REFUSED)
    except OSError:
        return Probe(SILENT)
    stage = "connect"
    try:
        if config.link.tls is not None:
            stage = "handshake"
            tls = config.link.tls
            sock = tls_context(tls.ca, tls.certs[party_id].cert,
                               tls.certs[party_id].key).wrap_socket(sock)
            why = identity_mismatch(sock.getpeercert(), peer, host)
            if why:
                return Probe(IMPOSTOR, why)
            stage = "first read"
        nonce = os.urandom(HELLO_NONCE_BYTES)
        sock.sendall(hello_request(nonce))
        reply = b""
        want = len(HELLO_MAGIC) + 32
        while len(reply) < want:
            got = sock.recv(want - len(reply))
            if not got:
                break
            reply += got
        if check_hello_reply(reply, hello_key(config), nonce, peer):
            return Probe(ALIVE)
        if not reply and stage == "first read":
            return _closed_after_handshake()
        if not reply:
            return Probe(REFUSED)     # closed without a word: going away
        return Probe(FOREIGN, f"it answered the project's hello with {reply[:24]!r}")
    except ssl.SSLCertVerificationError as err:
        return Probe(UNTRUSTED, f"its certificate does not verify against link.tls.ca="
                                f"{config.link.tls.ca} ({err.verify_message})")
    except ssl.SSLError as err:
        # TLS 1.3: a server that rejects the client's certificate says so after the client's
        # side of the handshake, at the first read.
        return Probe(TLS_REFUSED, f"it aborted the TLS {stage} ({err.reason or err}): it does "
                                  "not accept this party's certificate (another CA?), does not "
                                  "speak TLS, or stopped during the handshake")
    except ConnectionError:
        return _closed_after_handshake() if stage == "first read" else Probe(REFUSED)
    except OSError:
        return Probe(SILENT)
    finally:
        sock.close()


def _closed_after_handshake() -> Probe:
    # TLS 1.3: the client's side of the handshake completes before the server has checked
    # the client's certificate; a front that refuses it closes the connection.
    return Probe(TLS_REFUSED, "it closed the connection at the end of the TLS handshake: it "
                              "does not accept this party's certificate (another CA?)")


def probe_peers(config: NodeConfig, party_id: str) -> dict[str, Probe]:
    """Probe every other party at once -> {party: Probe}."""
    peers = [p for p in config.party_ids if p != party_id]
    with ThreadPoolExecutor(len(peers)) as pool:
        return dict(zip(peers, pool.map(lambda p: probe(config, party_id, p), peers)))


_DOWN_WORDS = {REFUSED: "is down (its link endpoint refuses connections)",
               SILENT: "does not respond (hung, stopped or cut off)"}


def _summary(states: dict[str, Probe]) -> str:
    return ", ".join(f"{p} {s.state}" for p, s in states.items())


def tls_fault_message(config: NodeConfig, peer: str, result: Probe) -> str:
    """The error for a TLS fault of `peer`; names the peer (and under IMPOSTOR both names)."""
    address = config.address(peer)
    if result.state == IMPOSTOR:
        return (f"party {peer} at {address} is not who the config says: {result.detail}; "
                "refusing to exchange anything with it (each node's certificate must have "
                "CN = its node id and a subjectAltName for its host)")
    if result.state == UNTRUSTED:
        return f"party {peer} at {address} failed the TLS handshake: {result.detail}"
    return f"party {peer} at {address} refused the TLS handshake: {result.detail}"


def foreign_message(config: NodeConfig, peer: str, result: Probe) -> str:
    """The error for a FOREIGN probe of `peer`: its port answers, but not as its front."""
    host, _, port = config.address(peer).rpartition(":")
    return (f"party {peer} never came up: port {port} on host {host} answers but is not "
            f"{peer} ({result.detail}); another program holds that port, or nodes[{peer!r}] "
            "names the wrong address")


# ----- blame ---------------------------------------------------------------------------------

def front_events(path: pathlib.Path | None, since: int = 0) -> tuple[list[dict], int]:
    """The front's JSON event lines after byte offset `since` -> (events, new offset)."""
    if path is None:
        return [], since
    try:
        with open(path, "rb") as f:
            f.seek(since)
            data = f.read()
    except OSError:
        return [], since
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].splitlines():
        try:
            event = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, since + end


def failing_peer(config: NodeConfig, my_rank: int, err: BaseException) -> str | None:
    """The party an SPU/yacl link error points at (`rank=N`, or the other end of `a->b`)."""
    text = str(err)
    m = re.search(r"rank=(\d+)", text) or re.search(r"key=connect_(\d+)", text)
    if m:
        rank = int(m.group(1))
    else:
        m = re.search(r"(\d+)->(\d+)", text)
        if not m:
            return None
        src, dst = int(m.group(1)), int(m.group(2))
        rank = src if dst == my_rank else dst
    return config.party_ids[rank] if 0 <= rank < config.world_size else None


def front_offences(config: NodeConfig, events_path: pathlib.Path | None,
                   authenticated_only: bool) -> list[dict]:
    """The front's dropped frames / refused connections attributed to a peer node (under TLS
    the node is the client certificate's; in plain TCP the rank a frame claimed)."""
    events, _ = front_events(events_path)
    if authenticated_only and config.link.tls is None:
        return []
    # Dropped frames only: a refused server or client certificate is named by the probes'
    # identity check (tls_fault_message), with both names.
    return [e for e in events if e.get("node") in config.party_ids
            and str(e.get("kind", "")).startswith("dropped")]


def flood_message(events_path: pathlib.Path | None) -> str | None:
    """'127.0.0.1 held 260 connections without a hello ...' for the source address whose
    connections this party's front closed without a hello the most (their events count them),
    None if there were none."""
    events, _ = front_events(events_path)
    held: dict[str, int] = {}
    why: dict[str, str] = {}
    for e in events:
        if e.get("kind") == "closed a connection without a hello":
            source = str(e.get("source") or str(e.get("address", "?")).rpartition(":")[0])
            count = e.get("connections", 1)
            count = count if isinstance(count, int) else 1
            held[source] = held.get(source, 0) + count
            if count == 1:
                why[source] = str(e.get("why", ""))
    if not held:
        return None
    source, n = max(held.items(), key=lambda kv: kv[1])
    return (f"{source} held {n} connection{'s' if n != 1 else ''} without a hello at this "
            f"party's front, which closed them (the last: {why.get(source, '?')})")


def anonymous_drops(events_path: pathlib.Path | None) -> list[dict]:
    """Frames this party's front dropped without naming the connection's node (the fault
    was another connection's: its `why` names it)."""
    events, _ = front_events(events_path)
    return [e for e in events if e.get("node") is None
            and str(e.get("kind", "")).startswith("dropped")]


def forged_messages(events_path: pathlib.Path | None) -> list[dict]:
    """The front's events of a message number that came twice under different keys (two
    senders claim one rank; yacl kept the first)."""
    return [e for e in front_events(events_path)[0] if e.get("kind") == FORGED]


def forged_message(event: dict) -> str:
    return (f"this party's front dropped a forged message from {event['address']}: "
            f"{event['why']}; the peer's messages can no longer be told from a forger's, so "
            "this party stops (in plain TCP any process on this machine can claim a rank: "
            "use link.tls)")


def offence_message(config: NodeConfig, event: dict) -> str:
    how = ("" if config.link.tls is not None
           else " (plain TCP: the rank it claimed, not proven)")
    return (f"party {event['node']}{how} sent bytes this party's front refused: "
            f"{event['why']}; the front {event['kind']} ({event['address']})")


def blame(config: NodeConfig, party_id: str, suspect: str | None,
          events_path: pathlib.Path | None = None) -> tuple[str | None, str]:
    """The failed party and why, from the peer a link error points at and a probe of all
    peers: a peer that is gone, silent or fails TLS is the cause even when the error points
    elsewhere (a live peer that stopped sending was itself waiting on the failed one)."""
    states = probe_peers(config, party_id)
    tls_bad = [p for p in config.party_ids if states.get(p, Probe(ALIVE)).state in TLS_FAULTS]
    if tls_bad:
        culprit = suspect if suspect in tls_bad else tls_bad[0]
        return culprit, (f"{tls_fault_message(config, culprit, states[culprit])} "
                         f"[probe: {_summary(states)}]")
    foreign = [p for p in config.party_ids if states.get(p, Probe(ALIVE)).state == FOREIGN]
    if foreign:
        culprit = suspect if suspect in foreign else foreign[0]
        return culprit, (f"{foreign_message(config, culprit, states[culprit])} "
                         f"[probe: {_summary(states)}]")
    offences = front_offences(config, events_path, authenticated_only=False)
    if offences:
        last = offences[-1]
        return last["node"], f"{offence_message(config, last)} [probe: {_summary(states)}]"
    # Not a peer's doing: a message forged under a peer's rank, connections that never said
    # hello, frames dropped because of what another connection holds. No peer is named.
    forged = forged_messages(events_path)
    if forged:
        return None, f"{forged_message(forged[0])} [probe: {_summary(states)}]"
    flood = flood_message(events_path)
    if flood:
        return None, f"{flood}; the link failed meanwhile [probe: {_summary(states)}]"
    drops = anonymous_drops(events_path)
    if drops:
        return None, (f"this party's front dropped a frame from {drops[-1]['address']}: "
                      f"{drops[-1]['why']} [probe: {_summary(states)}]")
    down = [p for p in config.party_ids if states.get(p, Probe(ALIVE)).state in DOWN]
    if down:
        culprit = suspect if suspect in down else down[0]
        return culprit, (f"party {culprit} {_DOWN_WORDS[states[culprit].state]} "
                         f"[probe: {_summary(states)}]")
    if suspect is None:
        return None, f"every peer answers a probe [{_summary(states)}]"
    return suspect, (f"party {suspect} sent nothing for link.recv_timeout_s="
                     f"{config.link.recv_timeout_s:g} s or dropped the connection, yet its "
                     f"endpoint answers [probe: {_summary(states)}]")


def explain_link_error(config: NodeConfig, party_id: str, stage: str,
                       err: BaseException, events_path: pathlib.Path | None = None
                       ) -> PartyFailure:
    """A PartyFailure naming the party a link error is due to (see `blame`)."""
    peer = failing_peer(config, config.rank(party_id), err)
    first = str(err).strip().splitlines()
    detail = " ".join(line.strip() for line in first[:2])[:300]
    culprit, why = blame(config, party_id, peer, events_path)
    if stage == "link setup" and culprit is not None and culprit == peer and "answers" in why:
        why = (f"party {peer} could not be reached at {config.address(peer)} within "
               f"link.recv_timeout_s={config.link.recv_timeout_s:g} s: is it running, is "
               "the port open, do the TLS certificates match?")
    return PartyFailure(culprit, f"{why} [during {stage}; {detail}]")


def verify_peers(config: NodeConfig, party_id: str) -> None:
    """Every peer's endpoint answers and (under TLS) proves to be the node the config names;
    raises PartyFailure naming the first that does not. Called after link-up and before the
    first share is sent."""
    states = probe_peers(config, party_id)
    for peer, result in states.items():
        if result.state in TLS_FAULTS:
            raise PartyFailure(peer, f"{tls_fault_message(config, peer, result)} "
                                     f"[during link setup; probe: {_summary(states)}]")
    for peer, result in states.items():
        if result.state == FOREIGN:
            raise PartyFailure(peer, f"{foreign_message(config, peer, result)} "
                                     f"[during link setup; probe: {_summary(states)}]")
        if result.state != ALIVE:
            raise PartyFailure(peer, f"party {peer} {_DOWN_WORDS[result.state]} right after "
                                     f"link-up [probe: {_summary(states)}]")


class Watchdog:
    """Probes every peer once a second from a daemon thread, from this party's start-up to the
    end of the run, and ends the party (exit 3, one `error:` line naming the peer):

    - from start-up on (this party's front serves its endpoint), a TLS fault of a peer: another
      node's certificate, an untrusted certificate, a refused handshake. The party then keeps
      its endpoint up for TLS_LINGER_S before leaving, so the faulty peer can observe the
      refusal too and name this party, instead of finding it gone;
    - from `begin_link()` on, a peer not seen up within `link.connect_timeout_s` ("never came
      up");
    - a peer seen up that then stays down (refused or silent) for `link.peer_timeout_s`;
    - a peer whose port answers, but not the hello of its front (FOREIGN: another program on
      its port): reported at link.connect_timeout_s as "port P on host H answers but is not
      node:N" (never as a hang);
    - under TLS, a frame or connection this party's front refused from a peer whose
      certificate identified it (`front_events_path`): at once, naming that peer (in plain
      TCP a frame's rank is only a claim: such events are kept for `blame`, the run goes on).

    A probe answered by a blocked-but-alive peer clears it (see the module docstring)."""

    TLS_LINGER_S = 3.0

    def __init__(self, config: NodeConfig, party_id: str, interval_s: float = 1.0,
                 events_path: pathlib.Path | None = None):
        self.config, self.party_id, self.interval_s = config, party_id, interval_s
        self.events_path = events_path
        self.stage = "start-up"
        self.link_started: float | None = None
        self.seen_up: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def begin_link(self) -> None:
        """This party now waits for its peers: each has link.connect_timeout_s to come up."""
        self.link_started = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _fail(self, message: str, linger_s: float = 0.0) -> None:
        if self._stop.is_set():
            return
        print(f"[party {self.party_id}] error: {message}", file=sys.stderr, flush=True)
        if linger_s:
            time.sleep(linger_s)
        exit_now(EXIT_PEER)  # the link threads may be blocked: leave at once

    def _loop(self) -> None:
        down_since: dict[str, float] = {}
        link = self.config.link
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            states = probe_peers(self.config, self.party_id)
            linking = self.link_started is not None
            # A peer failing the identity rule is the cause even when this party's front has
            # already dropped frames from a connection using its (or another's) certificate.
            for peer, result in states.items():
                if result.state in TLS_FAULTS:
                    self._fail(f"{tls_fault_message(self.config, peer, result)} "
                               f"[probe: {_summary(states)}; during {self.stage}]",
                               linger_s=self.TLS_LINGER_S)
            forged = forged_messages(self.events_path)
            if forged:
                self._fail(f"{forged_message(forged[0])} [during {self.stage}]",
                           linger_s=self.TLS_LINGER_S)
            offences = front_offences(self.config, self.events_path, authenticated_only=True)
            if offences:
                self._fail(f"{offence_message(self.config, offences[0])} "
                           f"[during {self.stage}]", linger_s=self.TLS_LINGER_S)
            for peer, result in states.items():
                where = f"[probe: {_summary(states)}; during {self.stage}]"
                if result.state == FOREIGN and peer not in self.seen_up:
                    if linking and now - self.link_started >= link.connect_timeout_s:
                        self._fail(f"{foreign_message(self.config, peer, result)} (within "
                                   f"link.connect_timeout_s={link.connect_timeout_s:g} s) "
                                   f"{where}")
                    continue
                if result.state == FOREIGN:
                    result = Probe(REFUSED)
                if result.state == ALIVE:
                    self.seen_up.add(peer)
                    down_since.pop(peer, None)
                    continue
                if result.state in TLS_FAULTS:
                    # This party's front serves its endpoint from start-up on, so a peer that
                    # fails TLS is named at once (it can see this party's refusal too).
                    self._fail(f"{tls_fault_message(self.config, peer, result)} {where}",
                               linger_s=self.TLS_LINGER_S)
                    continue
                if peer not in self.seen_up:
                    waited = None if not linking else now - self.link_started
                    if waited is not None and waited >= link.connect_timeout_s:
                        how = ("refuses connections" if result.state == REFUSED
                               else "does not answer")
                        self._fail(f"party {peer} never came up within link.connect_timeout_s="
                                   f"{link.connect_timeout_s:g} s (its endpoint "
                                   f"{self.config.address(peer)} {how}: is it started, is the "
                                   "address right, is it still loading? raise "
                                   f"link.connect_timeout_s if it needs longer) {where}")
                    continue
                down_since.setdefault(peer, now)
                if now - down_since[peer] >= link.peer_timeout_s:
                    self._fail(f"party {peer} {_DOWN_WORDS[result.state]} for "
                               f"{link.peer_timeout_s:g} s {where}")

