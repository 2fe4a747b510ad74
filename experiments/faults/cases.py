"""The fault cases, as data: one entry per bad input or fault, grouped by kind (wire, config,
parties, launcher, front door, CLI). `all_cases()` is the list the runner
(experiments/fault_cases.py) and the tests enumerate."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import time
from typing import Callable

from experiments.faults.forge import (SEND_PICKLE, SEND_WRONG_SHAPE, forge_frame,
                                     front_answers_hello, pb_field, sending)
from experiments.faults.harness import (SKIP_OWN_CERT_CHECK, issue_cert, log_text, make_ca,
                                       make_certs, node_config, tag, tls_section,
                                       wait_for_log)
from experiments.faults.kinds import (CliCase, ConfigCase, FrontCase, FrontScenarioCase,
                                     LauncherSignalCase, PartiesCase, WireCase)


def front_cases() -> list:
    run_key = b"test.3pc.run:P2P-1:0->1"
    big = 60 << 20

    def wrong_san(address, spec, folder):
        issue_cert(folder / "certs", "node_0_wrong_san", "node:0", san="IP:10.9.9.9")
        return sending(forge_frame(0, run_key), tls_cert="node_0_wrong_san")(address, spec,
                                                                               folder)

    def sixty_mib_messages(address, spec, folder):
        import socket
        sock = socket.create_connection(address, timeout=10)
        for i in range(6):
            key = f"test.3pc.run:P2P-{100 + i}:0->1".encode()
            try:
                sock.sendall(forge_frame(0, key, b"y" * 1024, message_length=big))
            except OSError:
                break
        return sock

    unread = [forge_frame(0, f"test.3pc.run:P2P-{i}:0->1".encode(), b"u" * 1024, seq=i)
              for i in range(1, 14)]

    python_front = [
        FrontCase("front: chunk declaring 2^40 bytes", "a well-formed chunked Push from 'rank 0' "
                  "declaring a total length of 2^40 (std::bad_alloc in the worker before)",
                  sending(forge_frame(0, run_key, message_length=1 << 40)),
                  ("declaring 1,099,511,627,776 bytes, over the cap",)),
        FrontCase("front: chunk offset 2^62", "a chunk at offset 2^62 of an 8-byte message "
                  "('invalid chunk info' abort in yacl before)",
                  sending(forge_frame(0, run_key, message_length=8, chunk_offset=1 << 62)),
                  ("at offset 4,611,686,018,427,387,904", "does not fit its message of 8")),
        FrontCase("front: chunk info given twice", "an empty chunk whose chunk info comes in "
                  "two parts, 8 bytes and then the offset alone: protobuf merges them into a "
                  "chunk of an 8-byte message, so a front that read the last part alone would "
                  "pass what yacl reads differently",
                  sending(forge_frame(0, run_key, b"", message_length=8,
                                      push_extra=pb_field(5, pb_field(2, 0)))),
                  ("protobuf field 5 appears twice in one message",)),
        FrontCase("front: a second request in the meta", "a Push request followed, in the same "
                  "brpc meta, by a second request naming another service, which protobuf "
                  "merges into the first",
                  sending(forge_frame(0, run_key, meta_extra=pb_field(1, pb_field(
                      1, b"brpc.builtin.FlagsService")))),
                  ("a brpc meta with a second request",)),
        FrontCase("front: a stream in the meta", "a Push request whose brpc meta also asks "
                  "to open a stream (stream_settings, field 8)",
                  sending(forge_frame(0, run_key, meta_extra=pb_field(8, pb_field(1, 7)))),
                  ("a brpc meta with field 8",)),
        FrontCase("front: frame of 2^31 bytes", "a brpc header declaring a 2 GiB body",
                  sending(forge_frame(0, run_key, body_size=(1 << 31))),
                  ("a frame of 2,147,483,648 bytes",)),
        FrontCase("front: own rank", "a Push claiming to come from the receiving party's own rank",
                  sending(forge_frame(1, b"test.3pc.run:P2P-1:1->1")),
                  ("sender rank 1, which is not a peer",)),
        FrontCase("front: key of another link", "a Push under a key of another run's link",
                  sending(forge_frame(0, b"other.run:P2P-1:0->1")),
                  ("not a key of this run's link",)),
        FrontCase("front: rank switch mid-connection", "a first frame as rank 0, then one as "
                  "rank 2 on the same connection",
                  sending(forge_frame(0, run_key), forge_frame(2, b"test.3pc.run:P2P-1:2->1")),
                  ("claiming sender rank 2 on a connection of rank 0",),
                  legit_bytes=len(forge_frame(0, run_key))),
        FrontCase("front: 6 x 60 MiB messages", "six chunked messages of 60 MiB each under keys "
                  "the program never reads (RSS 300 -> 785 MB before)", sixty_mib_messages,
                  ("declaring 62,914,560 bytes, over the cap of 1,048,576",)),
        FrontCase("front: unnumbered message", "a Push under this link's key without yacl's "
                  "sequence number (kept unread for the whole run before)",
                  sending(forge_frame(0, run_key, seq=0)), ("without a sequence number",)),
        FrontCase("front: HTTP request", "an HTTP GET to the link port",
                  sending(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
                  ("neither brpc nor the hello",)),
        FrontCase("front: TLS spoofed rank", "node:0's valid certificate, a Push claiming rank 2",
                  sending(forge_frame(2, b"test.3pc.run:P2P-1:2->1"), tls_cert="node_0"),
                  ("node:0", "claiming sender rank 2 on a connection of rank 0"), tls=True),
        FrontCase("front: TLS unread messages", "node:0's valid certificate, 13 complete "
                  "messages of 1 KiB under this link's keys that the party never reads (each "
                  "within the caps; held in the worker's memory for the run before)",
                  sending(*unread, tls_cert="node_0"),
                  ("node:0", "13 messages (13,312 bytes) that this party has not read",
                   "over the 12 a peer may have unread"),
                  tls=True, legit_bytes=sum(len(f) for f in unread[:12])),
        FrontCase("front: TLS right CN, wrong SAN", "a CA-signed certificate with CN=node:0 and "
                  "SAN IP:10.9.9.9 (brpc accepted it before)", wrong_san,
                  ("refused a TLS client", "no subjectAltName for node:0's host"), tls=True),
    ]
    # The plain-TCP cases again against the front in C that front.py runs in its place.
    return python_front + [dataclasses.replace(case, name="fast " + case.name, fast=True)
                           for case in python_front if not case.tls]


# ----- the front door: slow and flooding peers, ledgers, its local sockets ----------------------

def _line(front, event: dict) -> str:
    who = f"{event['node']} ({event['address']})" if event.get("node") else event["address"]
    return f"[party {front.spec.party}] front: {event['kind']} from {who}: {event['why']}"


def _wait_closed(sock, timeout: float) -> float | None:
    """Seconds until the peer closes `sock` (None: still open after `timeout`)."""
    start = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic() - start


def _trickle(first: bytes, period: float):
    """A connection that sends `first`, then one byte of a frame header every `period`
    seconds; passes when the front closes it within its deadline, saying so."""
    def scenario(front):
        import socket
        import threading
        deadline = front.spec.frame_deadline_s
        sock = socket.create_connection(("127.0.0.1", front.spec.listen_port))
        sock.sendall(first)
        stop = threading.Event()

        def drip():
            rest = forge_frame(0, b"test.3pc.run:P2P-2:0->1")[len(first) % 4:]
            for byte in rest:
                if stop.wait(period):
                    return
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return
        threading.Thread(target=drip, daemon=True).start()
        took = _wait_closed(sock, deadline + period + 10)
        stop.set()
        sock.close()
        time.sleep(0.3)
        events = [e for e in front.events() if "closed a" in e["kind"]]
        line = _line(front, events[-1]) if events else ""
        ok = took is not None and took <= deadline + 1.5 and bool(events) and (
            f"within {deadline:g} s" in line)
        return ok, line, "" if took is None else f"closed after {took:.1f} s"
    return scenario


def _slow_second_frame(front):
    """A whole first frame, then the next one a byte at a time: closed at the deadline of the
    second frame, the first relayed."""
    import socket
    deadline = front.spec.frame_deadline_s
    good = forge_frame(0, b"test.3pc.run:P2P-1:0->1", seq=1)
    sock = socket.create_connection(("127.0.0.1", front.spec.listen_port))
    sock.sendall(good)
    time.sleep(0.5)
    nxt = forge_frame(0, b"test.3pc.run:P2P-2:0->1", seq=2)
    start = time.monotonic()
    for byte in nxt[:20]:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            break
        if time.monotonic() - start > deadline + 2:
            break
        time.sleep(deadline / 8)
    took = _wait_closed(sock, deadline + 5)
    sock.close()
    time.sleep(0.3)
    events = [e for e in front.events() if e["kind"] == "closed a slow connection"]
    line = _line(front, events[-1]) if events else ""
    ok = (bool(events) and b"".join(front.received) == good
          and f"a frame not whole within {deadline:g} s of its first byte" in line)
    return ok, line, "first frame relayed" if b"".join(front.received) == good else \
        "the first frame did not reach brpc"


def _flood(front):
    """260 connections that say b"PRPC" and nothing more, then a peer with a whole frame and
    a probe's hello: the peer's frame reaches brpc; every flooding connection is closed, and
    the front's events count them for the source address."""
    import socket
    from runtime.distributed.blame import flood_message
    spec = front.spec
    flood = []
    for _ in range(260):
        s = socket.create_connection(("127.0.0.1", spec.listen_port))
        s.sendall(b"PRPC")
        flood.append(s)
    good = forge_frame(0, b"test.3pc.run:P2P-1:0->1", seq=1)
    peer = socket.create_connection(("127.0.0.1", spec.listen_port))
    peer.sendall(good)
    limit = time.monotonic() + 5
    while b"".join(front.received) != good and time.monotonic() < limit:
        time.sleep(0.02)
    relayed = b"".join(front.received) == good
    hello = front_answers_hello(spec, None)
    time.sleep(spec.frame_deadline_s + 2)      # the rest closed at their deadline, counted
    still_open = sum(_wait_closed(s, 0.01) is None for s in flood)
    for s in flood:
        s.close()
    peer.close()
    message = flood_message(pathlib.Path(spec.events_path)) or ""
    ok = (relayed and hello and not still_open
          and message.startswith("127.0.0.1 held 260 connections without a hello"))
    note = ", ".join(x for x in ("the peer's frame relayed" if relayed else "the peer's frame "
                                 "NOT relayed", "hello answered" if hello else "hello NOT "
                                 "answered", f"{still_open} flooding connections open")
                     if x)
    return ok, message, note


def _ledgers(front):
    """As rank 0, one connection leaves 64 tiny messages unfinished; the real rank 0's
    chunked message on another connection still passes whole; once the first closes, a third
    connection has a budget of its own."""
    import socket
    spec = front.spec
    seq = iter(range(1, 1000))

    def tiny(n):
        return b"".join(forge_frame(0, b"test.3pc.run:P2P-%d:0->1" % j, b"", message_length=1,
                                    seq=j) for j in (next(seq) for _ in range(n)))
    j = next(seq)
    whole = (forge_frame(0, b"test.3pc.run:P2P-%d:0->1" % j, b"a" * 5, message_length=10,
                         seq=j)
             + forge_frame(0, b"test.3pc.run:P2P-%d:0->1" % j, b"b" * 5, message_length=10,
                           chunk_offset=5, seq=j))
    sent = b""
    squatter = socket.create_connection(("127.0.0.1", spec.listen_port))
    frames = tiny(64)
    squatter.sendall(frames)
    sent += frames
    time.sleep(0.3)
    real = socket.create_connection(("127.0.0.1", spec.listen_port))
    real.sendall(whole)
    sent += whole
    time.sleep(0.3)
    squatter.close()
    time.sleep(0.3)
    later = socket.create_connection(("127.0.0.1", spec.listen_port))
    frames = tiny(64)
    later.sendall(frames)
    sent += frames
    limit = time.monotonic() + 5
    while sum(map(len, front.received)) < len(sent) and time.monotonic() < limit:
        time.sleep(0.02)
    real.close()
    later.close()
    dropped = [e for e in front.events() if e["kind"].startswith("dropped")]
    got = sum(map(len, front.received))
    ok = not dropped and got == len(sent)
    return ok, _line(front, dropped[0]) if dropped else "(no frame dropped)", \
        f"{got:,} of {len(sent):,} bytes reached brpc"


def _outbound_from_another_process(front):
    """Under TLS, a process other than the party's worker connects to the front's outbound
    socket for node:0 and writes a Push: refused before a byte is read, nothing leaves."""
    import subprocess
    import sys
    from runtime.distributed.front_state import outbound_socket
    path = outbound_socket(front.spec.private_dir, "node:0")
    frame = forge_frame(1, b"test.3pc.run:P2P-1:1->0", seq=1)
    code = ("import socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "s.sendall(bytes.fromhex(sys.argv[2])); time.sleep(0.5)\n")
    done = subprocess.run([sys.executable, "-c", code, path, frame.hex()], capture_output=True,
                          timeout=30)
    time.sleep(0.5)
    refused = [e for e in front.events() if e["kind"] == "refused a local connection"]
    line = _line(front, refused[-1]) if refused else ""
    ok = (bool(refused) and "serves this party's worker" in line and not front.received
          and oct(os.stat(front.spec.private_dir).st_mode & 0o777) == "0o700")
    return ok, line, (f"the writer exited {done.returncode}; {len(front.received)} reads "
                      "reached brpc")


def front_scenario_cases() -> list:
    quick = {"frame_deadline_s": 2.0}
    plain = [
        FrontScenarioCase("front: PRPC and nothing more", "a connection sends b'PRPC' and "
                          "nothing more (stayed open for good before)",
                          "closed at its hello's deadline (2 s here), saying so",
                          _trickle(b"PRPC", 60.0), spec_overrides=quick),
        FrontScenarioCase("front: one byte every 8 s", "a connection sends b'P', then one "
                          "byte of a frame every 8 s (each read restarted the clock before)",
                          "closed within the frame deadline (10 s) of its start",
                          _trickle(b"P", 8.0)),
        FrontScenarioCase("front: slow second frame", "a whole frame, then the next one byte "
                          "every 0.25 s", "the first relayed; closed at the second's deadline "
                          "(2 s here), saying so", _slow_second_frame, spec_overrides=quick),
        FrontScenarioCase("front: 260 connections saying PRPC", "260 connections send b'PRPC' "
                          "and stay; then a peer sends a whole frame and a probe says hello "
                          "(256 took every slot of the front in C before)",
                          "the peer's frame reaches brpc, the hello is answered; every flooding "
                          "connection closed and counted: '127.0.0.1 held 260 connections "
                          "without a hello'", _flood, spec_overrides=quick),
        FrontScenarioCase("front: 64 unfinished messages as rank 0", "one connection claiming "
                          "rank 0 leaves 64 one-byte chunked messages unfinished, another "
                          "claiming rank 0 sends a two-chunk message, then the first closes "
                          "and a third leaves 64 more (the real peer's message was dropped "
                          "and blamed on it before)",
                          "nothing dropped: each connection has its own budget, cleared when "
                          "it closes", _ledgers),
    ]
    return plain + [dataclasses.replace(c, name="fast " + c.name, fast=True) for c in plain] + [
        FrontScenarioCase("front: TLS outbound socket from another process", "under TLS, a "
                          "process other than the party's worker connects to the front's "
                          "outbound socket for node:0 and writes a Push (a local TCP port "
                          "that relayed anyone's bytes with the party's certificate before)",
                          "refused before a byte is read, naming the process; nothing "
                          "relayed; the socket's directory has mode 0700",
                          _outbound_from_another_process, tls=True),
    ]


# ----- the list ---------------------------------------------------------------------------------

def wire_cases() -> list:
    """Forged peer messages (in process)."""
    import pickle

    import numpy as np
    import spu

    from runtime.distributed import wire

    def io(protocol="ABY3"):
        cfg = spu.RuntimeConfig(protocol=getattr(spu.ProtocolKind, protocol),
                                field=spu.FieldType.FM64)
        return spu.Io({"ABY3": 3, "SEMI2K": 2}[protocol], cfg)

    def share(x, protocol="ABY3", vis=spu.Visibility.VIS_SECRET):
        kw = {"owner_rank": 0} if vis == spu.Visibility.VIS_SECRET else {}
        return io(protocol).make_shares(np.asarray(x), vis, **kw)[1]

    expect = wire.ShareSpec.like("v1", share(np.ones((2, 3), np.float32)))

    def decoding(message):
        return lambda folder: ((lambda: wire.decode_share(message, expect, "node:0")), None)

    class _Command:
        def __init__(self, command):
            self.command = command

        def __reduce__(self):
            return (os.system, (self.command,))

    def pickled(folder):
        marker = folder / "pwned"
        message = pickle.dumps(_Command(f"touch {marker}"))      # bytes only, never loaded
        return (lambda: wire.decode_share(message, expect, "node:0")), marker

    good = wire.encode_share("v1", share(np.ones((2, 3), np.float32)))
    deep = b"[" * 50_000
    import struct
    return [
        WireCase("wire: pickle (os.system)", "a share message that is a pickle whose "
                 "__reduce__ calls os.system('touch MARKER')", pickled),
        WireCase("wire: pickled SPU share", "pickle.dumps(libspu.Share) as the message",
                 decoding(pickle.dumps(share(np.ones((2, 3), np.float32))))),
        WireCase("wire: wrong dtype", "an int32 share where a float32 one is expected",
                 decoding(wire.encode_share("v1", share(np.ones((2, 3), np.int32))))),
        WireCase("wire: wrong shape", "a (3, 2) share where (2, 3) is expected",
                 decoding(wire.encode_share("v1", share(np.ones((3, 2), np.float32))))),
        WireCase("wire: public value", "a public value where a secret share is expected",
                 decoding(wire.encode_share("v1", share(np.ones((2, 3), np.float32),
                                                        vis=spu.Visibility.VIS_PUBLIC)))),
        WireCase("wire: other protocol", "a SEMI2K share where an ABY3 share is expected",
                 decoding(wire.encode_share("v1", share(np.ones((2, 3), np.float32),
                                                        "SEMI2K")))),
        WireCase("wire: truncated", "the share message minus its last byte",
                 decoding(good[:-1])),
        WireCase("wire: extra bytes", "the share message plus one byte", decoding(good + b"\0")),
        WireCase("wire: oversized header", "a header length of 1 MiB",
                 decoding(struct.pack(">I", 1 << 20) + good)),
        WireCase("wire: nested header", "a 50,000-deep JSON header (parser recursion)",
                 decoding(struct.pack(">I", len(deep)) + deep)),
        WireCase("wire: wrong name", "the share of 'v2' where 'v1' is expected",
                 decoding(wire.encode_share("v2", share(np.ones((2, 3), np.float32))))),
        WireCase("wire: wrong kind", "a JSON message where a share is expected",
                 decoding(wire.encode_json("v1", [1, 2, 3]))),
    ]


def _spu(raw: dict) -> dict:
    return raw["devices"]["SPU"]["config"]


def tls_files(folder: pathlib.Path, parties, *, shared_imposter=False, swap=None,
               other_ca_for=None) -> dict:
    """Certificates under folder/certs and the link.tls section that uses them."""
    certs = folder / "certs"
    make_certs(certs, list(parties))
    files = {p: tag(p) for p in parties}
    if shared_imposter:
        issue_cert(certs, "imposter", "imposter", san="IP:10.9.9.9")
        files = {p: "imposter" for p in parties}
    if swap:
        files[swap[0]] = tag(swap[1])
    if other_ca_for:
        make_ca(certs, "ca2")
        issue_cert(certs, "other_ca", other_ca_for, ca="ca2")
        files[other_ca_for] = "other_ca"
    return tls_section(files)


def config_cases() -> list:
    def link(**kw):
        return lambda raw, folder: _spu(raw)["link"].update(kw)

    def job(**kw):
        return lambda raw, folder: raw["job"].update(kw)

    def rename(raw, folder):
        raw["nodes"]["a/b"] = raw["nodes"].pop("node:2")
        _spu(raw)["node_ids"][2] = "a/b"

    def remote(raw, folder):
        raw["nodes"]["node:2"] = "10.0.0.3:61320"

    def all_one_cert(raw, folder):
        _spu(raw)["link"]["tls"] = tls_files(folder, raw["nodes"], shared_imposter=True)

    def owner_with_node2_cert(raw, folder):
        _spu(raw)["link"]["tls"] = tls_files(folder, raw["nodes"], swap=("node:1", "node:2"))

    def node2_at(address):
        def mutate(raw, folder):
            raw["nodes"]["node:2"] = address(raw)
        return mutate

    def same_port_as_node0(raw):
        return "localhost:" + raw["nodes"]["node:0"].rpartition(":")[2]

    def expired_cert(raw, folder):
        _spu(raw)["link"]["tls"] = tls_files(folder, raw["nodes"])
        issue_cert(folder / "certs", "node_0", "node:0", days=-1)

    def other_ca_cert(raw, folder):
        _spu(raw)["link"]["tls"] = tls_files(folder, raw["nodes"], other_ca_for="node:2")

    def swapped_key(raw, folder):
        _spu(raw)["link"]["tls"] = tls_files(folder, raw["nodes"])
        _spu(raw)["link"]["tls"]["certs"]["node:0"]["key"] = "certs/node_1.key"

    def extra_node(raw, folder):
        raw["nodes"]["node:3"] = "127.0.0.1:1"

    def cert_path(path):
        def mutate(raw, folder):
            _spu(raw)["link"]["tls"] = tls_files(folder, raw["nodes"])
            _spu(raw)["link"]["tls"]["certs"]["node:1"]["cert"] = path
        return mutate

    def repeat_node1(text):
        # {"node:0": ..., "node:1": A, "node:2": ...} -> a second "node:1" key in "nodes"
        start = text.index('"node:1": "127.0.0.1:')
        entry = text[start:text.index('"', start + len('"node:1": "')) + 1]
        return text.replace(entry, f'{entry}, {entry.replace("node:1", "node:1", 1)}', 1)

    held: list = []

    def hold_port_of(party):
        def mutate(raw, folder):
            import socket
            sock = socket.socket()
            sock.bind(("127.0.0.1", int(raw["nodes"][party].rpartition(":")[2])))
            sock.listen()
            held.append(sock)        # held until the process ends
        return mutate

    return [
        ConfigCase("config: own port busy", "another process listens on node:0's port (gave "
                   "'brpc server failed start', exit 3)", hold_port_of("node:0"),
                   ("address in use: node:0's link port 127.0.0.1:",), party="node:0",
                   expected="exit 2 at once: address in use, naming the port"),
        ConfigCase("config: own port busy (launcher)", "another process listens on node:2's port; "
                   "--party=all", hold_port_of("node:2"),
                   ("address in use: node:2's link port 127.0.0.1:",),
                   expected="exit 2 before any party starts: address in use"),
        ConfigCase("config: IPv6 literal", "node:2 at [::1]:P (the probe passed the brackets to "
                   "socket.create_connection: a healthy peer was reported hung)",
                   node2_at(lambda raw: "[::1]:" + raw["nodes"]["node:2"].rpartition(":")[2]),
                   ("nodes['node:2']='[::1]:", "IPv6 address: not supported")),
        ConfigCase("config: full-width port", "node:2's port in full-width digits "
                   "('\uff16\uff12\uff14\uff11\uff12'.isdigit() is true)",
                   node2_at(lambda raw: "127.0.0.1:\uff16\uff12\uff14\uff11\uff12"),
                   ("ASCII digits 0-9",)),
        ConfigCase("config: connect_timeout_s 1e12", "link.connect_timeout_s = 1e12 (a pybind "
                   "TypeError traceback from the retry count)", link(connect_timeout_s=1e12),
                   ("link.connect_timeout_s=1e+12 is beyond", "use at most 604800")),
        ConfigCase("config: repeated node id", 'the key "node:1" twice in "nodes" (the last '
                   "won, silently)", lambda raw, folder: None,
                   ("the key 'node:1' appears twice",), rewrite=repeat_node1),
        ConfigCase("config: same port via localhost", "node:2 at localhost:P where node:0 is at "
                   "127.0.0.1:P", node2_at(same_port_as_node0),
                   ("nodes 'node:0' and 'node:2' both use port",)),
        ConfigCase("config: negative shaping delay", 'link.shape = {"delay_ms": -1}',
                   link(shape={"delay_ms": -1}), ("link.shape.delay_ms=-1 must be",)),
        ConfigCase("config: negative shaping rate", 'link.shape = {"rate_mb_s": -40}',
                   link(shape={"rate_mb_s": -40}), ("link.shape.rate_mb_s=-40 must be",)),
        ConfigCase("config: expired certificate", "node:0's CA-signed certificate expired "
                   "yesterday (caught only at run time)", expired_cert,
                   ("link.tls.certs['node:0'].cert=", "expired on")),
        ConfigCase("config: node id a/b", "node id 'a/b' (crashed the launcher, which left "
                   "parties holding ports)", rename, ("node id 'a/b' is not allowed",)),
        ConfigCase("config: string peer_timeout_s", 'link.peer_timeout_s = "10"',
                   link(peer_timeout_s="10"), ("link.peer_timeout_s='10' must be a number",)),
        ConfigCase("config: non-integer retries", "link.connect_retry_times = 1.5",
                   link(connect_retry_times=1.5), ("link.connect_retry_times=1.5 must be an "
                                                   "integer",)),
        ConfigCase("config: string prompt_ids", 'job.prompt_ids = ["1", "2", ...] (32 strings)',
                   job(prompt_ids=[str(i) for i in range(32)]),
                   ("job.prompt_ids must be a list of integer token ids",)),
        ConfigCase("config: seq_len 1e9", "job.seq_len = 1000000000 (grew past 6 GB)",
                   job(seq_len=10**9), ("exceeds llama-tiny's context of 4096",)),
        ConfigCase("config: max_new_tokens 1e6", "job.max_new_tokens = 1000000 (ran until the "
                   "job timeout)", job(max_new_tokens=10**6), ("exceeds llama-tiny's context",)),
        ConfigCase("config: memory estimate", "llama2-d1024 (all 32 layers), seq_len 4000, "
                   "ABY3, 3 parties on this machine",
                   job(model="llama2-d1024", num_layers=None, seq_len=4000, policy="full",
                       policy_options={}),
                   ("per party", "over the limit")),
        ConfigCase("config: --job override", "--job='{\"timeout_s\": \"60\"}' to the launcher",
                   lambda raw, folder: None, ("job.timeout_s='60' must be a number",),
                   extra_args=('--job={"timeout_s": "60"}',)),
        ConfigCase("config: plain TCP off loopback", "node:2 at 10.0.0.3, no link.tls, no "
                   "insecure (ran as plain TCP without a warning)", remote,
                   ('add "insecure": true', "not on loopback"), party="node:0"),
        ConfigCase("config: one cert for all (launcher)", "one certificate (CN=imposter, SAN "
                   "IP:10.9.9.9) for all three nodes", all_one_cert,
                   ("node 'node:0'", "CN='imposter'")),
        ConfigCase("config: owner has node:2's cert", "the prompt owner node:1 configured with "
                   "node:2's certificate", owner_with_node2_cert,
                   ("node 'node:1'", "CN='node:2'")),
        ConfigCase("config: certificate from another CA", "node:2's certificate (CN and SAN "
                   "right) signed by a second CA, not link.tls.ca (failed only at run time)",
                   other_ca_cert, ("link.tls.certs['node:2'].cert=", "is not signed by "
                                   "link.tls.ca=")),
        ConfigCase("config: key of another certificate", "node:0's key is node:1's (passed "
                   "load, failed at run time)", swapped_key,
                   ("link.tls.certs['node:0'].key=", "is not the private key of")),
        ConfigCase("config: node missing from node_ids", "a fourth node in 'nodes' that "
                   "devices.SPU.config.node_ids does not list (silently ignored)", extra_node,
                   ("nodes names 'node:3', which devices.SPU.config.node_ids does not list",)),
        ConfigCase("config: cert path is a directory", "link.tls.certs['node:1'].cert names a "
                   "directory (reported as 'does not exist')", cert_path("certs"),
                   ("link.tls.certs['node:1'].cert='certs' is a directory",)),
        ConfigCase("config: cert path is /dev/zero", "link.tls.certs['node:1'].cert = /dev/zero "
                   "(reported as 'does not exist')", cert_path("/dev/zero"),
                   ("link.tls.certs['node:1'].cert='/dev/zero' is a character device",)),
    ]


def write_config(folder: pathlib.Path, raw: dict, name: str = "nodes.json") -> pathlib.Path:
    path = folder / name
    path.write_text(json.dumps(raw))
    return path


def party_cases() -> list:
    parties3 = ["node:0", "node:1", "node:2"]

    def tls_plan(**tls_kw):
        """Every party reads a config whose certs follow tls_kw; all run patched to skip their
        own certificate check (a party controls its own code)."""
        def setup(ctx, folder):
            raw = node_config(3, "ABY3", ctx.ports(3), connect_timeout_s=20)
            _spu(raw)["link"]["tls"] = tls_files(folder, parties3, **tls_kw)
            path = write_config(folder, raw)
            return {p: (path, SKIP_OWN_CERT_CHECK) for p in parties3}
        return setup

    def swapped_owner(ctx, folder):
        raw = node_config(3, "ABY3", ctx.ports(3), connect_timeout_s=20)
        _spu(raw)["link"]["tls"] = tls_files(folder, parties3)
        honest = write_config(folder, raw)
        _spu(raw)["link"]["tls"]["certs"]["node:1"] = dict(
            _spu(raw)["link"]["tls"]["certs"]["node:2"])
        hostile = write_config(folder, raw, "nodes_node1.json")
        return {"node:0": (honest, None), "node:1": (hostile, SKIP_OWN_CERT_CHECK),
                "node:2": (honest, None)}

    def plain(n=3, start=None, prelude=None, **link):
        def setup(ctx, folder):
            raw = node_config(n, "ABY3" if n == 3 else "SEMI2K", ctx.ports(n), **link)
            path = write_config(folder, raw)
            ids = [f"node:{i}" for i in range(n)]
            return {p: (path, (prelude or {}).get(p)) for p in (start or ids)}
        return setup

    def kill(party, sig=signal.SIGKILL):
        def fault(procs):
            os.killpg(procs[party].pid, sig)
        return fault

    def no_marker(folder):
        marker = pathlib.Path("/tmp/mpcache_fault_case_pwned")
        return f"{marker} was created" if marker.exists() else ""

    marker = "/tmp/mpcache_fault_case_pwned"
    if os.path.exists(marker):
        os.remove(marker)

    def insecure_remote(ctx, folder):
        ports = ctx.ports(2)
        raw = node_config(2, "SEMI2K", ports, connect_timeout_s=5, insecure=True)
        raw["nodes"]["node:1"] = f"10.255.255.1:{ports[1]}"
        return {"node:0": (write_config(folder, raw), None)}

    def other_policy(ctx, folder):
        raw = node_config(3, "ABY3", ctx.ports(3))
        honest = write_config(folder, raw)
        raw["job"].update(policy="full", policy_options={})
        other = write_config(folder, raw, "nodes_node2.json")
        return {"node:0": (honest, None), "node:1": (honest, None), "node:2": (other, None)}

    def stopped_by_sigterm(folder):
        text = log_text(folder / "out", "node:2")
        return "" if "error: stopped by SIGTERM" in text else "node:2 did not report SIGTERM"

    def warned(folder):
        text = log_text(folder / "out", "node:0")
        return "" if "warning: link.insecure=true" in text else "no warning printed"

    http_servers: list = []

    def web_server_on_node2(ctx, folder):
        import http.server
        import threading
        ports = ctx.ports(3)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", ports[2]),
                                                 http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        http_servers.append(server)
        raw = node_config(3, "ABY3", ports, connect_timeout_s=8)
        path = write_config(folder, raw)
        return {"node:0": (path, None), "node:1": (path, None)}

    def stop_web_server(folder):
        while http_servers:
            http_servers.pop().shutdown()
        return ""

    def forged_frames_mid_run(procs):
        import socket
        config = json.loads(pathlib.Path(mid_run_config[0]).read_text())
        port = int(config["nodes"]["node:1"].rpartition(":")[2])
        link_id = config["id"] + ".run"
        for frame in (forge_frame(0, f"{link_id}:P2P-1:0->1".encode(), message_length=1 << 40),
                      forge_frame(0, f"{link_id}:P2P-1:0->1".encode(), message_length=8,
                                  chunk_offset=1 << 62)):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(frame)
                try:
                    sock.recv(10)
                except OSError:
                    pass

    mid_run_config: list = []

    def plain_recording(ctx, folder):
        plan = plain(job={"max_new_tokens": 4})(ctx, folder)
        mid_run_config[:] = [str(next(iter(plan.values()))[0])]
        return plan

    def front_dropped(folder):
        text = log_text(folder / "out", "node:1")
        n = text.count("front: dropped a frame")
        return "" if n >= 2 else f"node:1's front logged {n} dropped frames"

    # ----- the side door, floods and local writers (parties started one by one) -------------

    later: dict = {}        # the case's config, output folder and what its fault found

    def two_first(tls=False, **job):
        """node:0 and node:1 now; node:2 from the fault (`start_node2`)."""
        def setup(ctx, folder):
            raw = node_config(3, "ABY3", ctx.ports(3), job={"max_new_tokens": 4, **job},
                              connect_timeout_s=60)
            if tls:
                _spu(raw)["link"]["tls"] = tls_files(folder, parties3)
            path = write_config(folder, raw)
            later.clear()
            later.update(path=path, out=folder / "out", raw=raw)
            return {"node:0": (path, None), "node:1": (path, None)}
        return setup

    def start_node2(procs):
        from experiments.faults.harness import start_party
        procs["node:2"] = start_party(later["path"], "node:2", later["out"])

    def push_2_40_to_every_port(procs):
        """What any process here can do: find every TCP port the processes of node:0 and
        node:1 listen on (/proc), push each a chunk declaring 2^40 bytes; then node:2."""
        import socket
        from experiments.faults.harness import listening_tcp_ports, unix_sockets
        time.sleep(3)       # brpc listens (and waits for node:2) once linking began
        link_id = later["raw"]["id"] + ".run"
        found = {}
        for party in ("node:0", "node:1"):
            ports = listening_tcp_ports(procs[party].pid)
            found[party] = {"tcp": ports, "unix": unix_sockets(procs[party].pid)}
            rank = int(party[-1])
            for host, port in ports:
                frame = forge_frame(2, f"{link_id}:P2P-1:2->{rank}".encode(),
                                    message_length=1 << 40)
                try:
                    with socket.create_connection(("127.0.0.1" if host in ("0.0.0.0", "::")
                                                   else host, port), timeout=5) as sock:
                        sock.sendall(frame)
                        _wait_closed(sock, 5)
                except OSError:
                    pass
        later["found"] = found
        start_node2(procs)

    def only_public_ports(folder):
        public = {p: ("127.0.0.1", int(later["raw"]["nodes"][p].rpartition(":")[2]))
                  for p in ("node:0", "node:1")}
        found = later.get("found", {})
        (folder / "found.json").write_text(json.dumps(found, indent=1))
        wrong = {p: f["tcp"] for p, f in found.items() if f["tcp"] != [public[p]]}
        drops = sum(log_text(folder / "out", p).count("front: dropped a frame")
                    for p in ("node:0", "node:1"))
        results = (folder / "out" / "results.jsonl").exists()
        return "; ".join(x for x in (
            f"listening TCP ports other than the public one: {wrong}" if wrong else "",
            "" if drops >= 2 else f"{drops} dropped frames logged (expected 2)",
            "" if results else "no results.jsonl") if x)

    def first_event(folder, party, kind) -> str:
        from runtime.distributed.blame import front_events
        from runtime.distributed.party_front import front_events_path
        events = [e for e in front_events(front_events_path(folder / "out", party))[0]
                  if e["kind"].startswith(kind)]
        if not events:
            return f"(no {kind!r} event at {party})"
        e = events[0]
        who = f"{e['node']} ({e['address']})" if e.get("node") else e["address"]
        return f"[party {party}] front: {e['kind']} from {who}: {e['why']}"

    def ports_summary(folder):
        found = later.get("found", {})
        tcp = ", ".join(f"{p} {h}:{n}" for p, f in found.items() for h, n in f["tcp"])
        drop = first_event(folder, "node:0", "dropped").split(": ", 2)[-1]
        return (f"every party exits 0; TCP listeners: {tcp} (the public ports; brpc on "
                f"Unix sockets); node:0's front dropped: {drop}")

    flood_sockets: list = []

    def flood_node0(procs):
        """260 connections that say PRPC and nothing more to node:0's port, then node:2."""
        import socket
        port = int(later["raw"]["nodes"]["node:0"].rpartition(":")[2])
        for _ in range(260):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"PRPC")
            flood_sockets.append(sock)
        start_node2(procs)

    def flood_named(folder):
        from runtime.distributed.blame import flood_message
        from runtime.distributed.party_front import front_events_path
        while flood_sockets:
            flood_sockets.pop().close()
        message = flood_message(front_events_path(folder / "out", "node:0")) or ""
        results = (folder / "out" / "results.jsonl").exists()
        # The front counts a flooding connection when it closes it (at its frame deadline); a
        # run that ends sooner leaves the rest uncounted, so the count varies with the run's
        # length: what must hold is that the flooding address is the one named.
        named = re.match(r"127\.0\.0\.1 held (\d+) connections without a hello", message)
        return "; ".join(x for x in (
            "" if named and 0 < int(named.group(1)) <= 260
            else f"node:0's front said {message!r}", "" if results else "no results.jsonl")
            if x)

    def write_to_every_local_socket(procs):
        """Under TLS, once linked: a local process writes a Push claiming rank 0 to every
        socket of node:0's front (its TCP port and the Unix sockets it serves)."""
        import socket
        from experiments.faults.harness import listening_tcp_ports, unix_sockets
        link_id = later["raw"]["id"] + ".run"
        frame = forge_frame(0, f"{link_id}:P2P-7:0->1".encode(), b"forged", seq=7)
        tried = []
        for path in unix_sockets(procs["node:0"].pid):
            if "/to_" not in path:
                continue        # brpc's own socket: see docs/design.md (same user)
            try:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.settimeout(5)
                    sock.connect(path)
                    sock.sendall(frame)
                    _wait_closed(sock, 5)
                tried.append(path)
            except OSError:
                tried.append(f"{path} (refused)")
        for host, port in listening_tcp_ports(procs["node:0"].pid):
            try:
                with socket.create_connection((host, port), timeout=5) as sock:
                    sock.sendall(frame)
                    _wait_closed(sock, 5)
                tried.append(f"{host}:{port}")
            except OSError:
                pass
        later["tried"] = tried

    def flood_summary(folder):
        from runtime.distributed.blame import flood_message
        from runtime.distributed.party_front import front_events_path
        return (f"every party exits 0; node:0's front: "
                f"{flood_message(front_events_path(folder / 'out', 'node:0'))}")

    def writers_summary(folder):
        return (f"every party exits 0, no peer dropped a frame. "
                f"{first_event(folder, 'node:0', 'refused a local connection')}")

    def nothing_left_with_node0s_name(folder):
        from runtime.distributed.blame import front_events
        from runtime.distributed.party_front import front_events_path
        out = folder / "out"
        refused = [e for e in front_events(front_events_path(out, "node:0"))[0]
                   if e["kind"] == "refused a local connection"]
        dropped = [e for p in ("node:1", "node:2")
                   for e in front_events(front_events_path(out, p))[0]
                   if e["kind"].startswith("dropped")]
        tried = later.get("tried", [])
        return "; ".join(x for x in (
            "" if len([t for t in tried if "/to_" in t]) == 2 else f"tried {tried}",
            "" if len(refused) >= 2 else f"node:0's front refused {len(refused)} local writers",
            f"a peer dropped {dropped[0]['why']}" if dropped else "",
            "" if (out / "results.jsonl").exists() else "no results.jsonl") if x)

    def forge_a_real_key(procs):
        """Once linked, a local process sends node:1 one Push claiming rank 0 under the run's
        real link id, with a message number the real node:0 has not reached yet."""
        import socket
        link_id = later["raw"]["id"] + ".run"
        port = int(later["raw"]["nodes"]["node:1"].rpartition(":")[2])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(forge_frame(0, f"{link_id}:P2P-60:0->1".encode(), b"forged!!", seq=60))
            time.sleep(0.3)

    def all_three(ctx, folder):
        plan = two_first()(ctx, folder)
        return {**plan, "node:2": (later["path"], None)}

    side_door = [
        PartiesCase("side door: every TCP port from /proc", "node:0 and node:1 started; a "
                    "local process finds every TCP port their process trees listen on "
                    "(/proc/net/tcp, /proc/PID/fd) and pushes each a chunk declaring 2^40 "
                    "bytes; then node:2 starts (brpc's own port was one of them: its worker "
                    "aborted, std::bad_alloc, before)",
                    "only the two public ports listen; both fronts drop the chunk; the run "
                    "completes (every party exits 0, results written)", two_first(),
                    parties3, (), fault=push_2_40_to_every_port, fault_after="] linking to",
                    judge_exit=0, check=only_public_ports, timeout_s=240,
                    summary=ports_summary),
        PartiesCase("flood: 260 connections before node:2 starts", "node:0 and node:1 "
                    "started; 260 connections send node:0's port b'PRPC' and nothing more; "
                    "then node:2 starts (the run died, node:0 and node:1 blaming each other, "
                    "before)", "the run completes (every party exits 0); node:0's front "
                    "names the flood: '127.0.0.1 held N connections without a hello' (N: those closed "
                    "at their deadline before the run ended, up to 260)",
                    two_first(), parties3, (), fault=flood_node0, fault_after="] linking to",
                    judge_exit=0, check=flood_named, timeout_s=240, summary=flood_summary),
        PartiesCase("tls: local writers to the front's sockets", "under TLS, once linked, a "
                    "local process writes a Push claiming rank 0 to every socket of node:0's "
                    "front: its public port and its outbound sockets (the outbound ports "
                    "relayed anyone's bytes with node:0's certificate before)",
                    "the outbound sockets refuse the writer (not node:0's worker), the public "
                    "port wants a certificate; no peer gets a byte of it; the run completes",
                    two_first(tls=True), parties3, (), fault=lambda procs: (
                        start_node2(procs), wait_for_log(later["out"], parties3, "] link up",
                                                         180, procs),
                        write_to_every_local_socket(procs)),
                    fault_after="] linking to", judge_exit=0,
                    check=nothing_left_with_node0s_name, timeout_s=240,
                    summary=writers_summary),
        PartiesCase("forge: a Push under the run's link key", "once linked, a local process "
                    "sends node:1 one well-formed Push claiming rank 0 under this run's link "
                    "id with message number 60 (yacl then dropped node:0's real message 60 as "
                    "a duplicate: every party timed out after recv_timeout_s, blaming a peer)",
                    "node:1's front sees message 60 of rank 0 come again under another key and "
                    "node:1 stops at once, naming the forgery and no party; the others exit 3",
                    all_three, parties3, ("dropped a forged message", "two connections claim "
                                          "rank 0"), fault=forge_a_real_key,
                    fault_after="] link up", say_in="any", timeout_s=120),
    ]

    return side_door + [
        PartiesCase("blame: a web server on node:2's port", "an HTTP server listens on node:2's "
                    "port; node:0 and node:1 started, connect_timeout_s=8 (waited 95 s with "
                    "connect_timeout_s=8 and blamed a healthy party before)",
                    "node:0 and node:1 exit 3 within connect_timeout_s: port P on host H "
                    "answers but is not node:2", web_server_on_node2, ("node:0", "node:1"),
                    ("answers but is not node:2", "party node:2 never came up"),
                    check=stop_web_server),
        PartiesCase("front: forged frames mid-run", "once linked, a local process sends node:1 "
                    "(the prompt owner) a chunk declaring 2^40 bytes and one at offset 2^62 "
                    "(each aborted the worker before)",
                    "the front drops them, naming the connection; the run completes (every "
                    "party exits 0)", plain_recording, ("node:0", "node:1", "node:2"), (),
                    fault=forged_frames_mid_run, fault_after="] link up", judge_exit=0,
                    check=front_dropped),
        PartiesCase("tls: one cert for all (patched)", "one CA-signed certificate (CN=imposter, "
                    "SAN IP:10.9.9.9) for all three nodes; every party's own check skipped",
                    "every party exits 3; those that saw a peer name it, the expected node and "
                    "CN='imposter' (the others see the first ones gone)",
                    tls_plan(shared_imposter=True), ("node:0", "node:1", "node:2"),
                    ("is not who the config says", "CN='imposter'", "where node 'node:"),
                    say_in="any", clock="start"),
        PartiesCase("tls: owner presents node:2's cert", "the prompt owner node:1 presents "
                    "node:2's (valid, CA-signed) certificate; its own check skipped",
                    "node:0 and node:2 exit 3 naming node:1 and CN='node:2'", swapped_owner,
                    ("node:0", "node:2"), ("party node:1 ", "CN='node:2'", "node 'node:1'"),
                    clock="start"),
        PartiesCase("tls: certificate from another CA", "node:2's certificate is signed by "
                    "another CA", "node:0 and node:1 exit 3: node:2 failed the TLS handshake",
                    tls_plan(other_ca_for="node:2"), ("node:0", "node:1"),
                    ("party node:2 ", "TLS handshake"), clock="start"),
        PartiesCase("insecure: plain TCP off loopback", 'node:1 at 10.255.255.1 (unroutable), '
                    '"insecure": true; only node:0 started',
                    "warning printed; node:0 exits 3: node:1 never came up within "
                    "connect_timeout_s=5", insecure_remote, ("node:0",),
                    ("party node:1 never came up within link.connect_timeout_s=5 s",),
                    check=warned),
        PartiesCase("fault: party never started", "3 parties, node:2 never started, "
                    "connect_timeout_s=5", "node:0 and node:1 exit 3 naming node:2 within "
                    "connect_timeout_s", plain(start=["node:0", "node:1"], connect_timeout_s=5),
                    ("node:0", "node:1"),
                    ("party node:2 never came up within link.connect_timeout_s=5 s",)),
        PartiesCase("fault: killed before link-up", "node:2 SIGKILLed 1 s after it was started "
                    "(during start-up), connect_timeout_s=5",
                    "node:0 and node:1 exit 3 naming node:2 within connect_timeout_s",
                    plain(connect_timeout_s=5), ("node:0", "node:1"),
                    ("party node:2 never came up",),
                    fault=lambda procs: (time.sleep(1.0), kill("node:2")(procs))),
        PartiesCase("fault: killed after link-up", "node:2 SIGKILLed once every party is "
                    "linked, peer_timeout_s=3", "node:0 and node:1 exit 3 naming node:2",
                    plain(peer_timeout_s=3), ("node:0", "node:1"), ("party node:2 ",),
                    fault=kill("node:2"), fault_after="] link up"),
        PartiesCase("fault: hung after link-up", "node:2 SIGSTOPped once every party is linked, "
                    "peer_timeout_s=3", "node:0 and node:1 exit 3 naming node:2",
                    plain(peer_timeout_s=3), ("node:0", "node:1"), ("party node:2 ",),
                    fault=kill("node:2", signal.SIGSTOP), fault_after="] link up"),
        PartiesCase("fault: SIGTERM to one party", "SIGTERM to node:2's supervisor once every "
                    "party is linked, peer_timeout_s=3", "node:2 kills its worker and exits 143 "
                    "saying so; node:0 and node:1 exit 3 naming node:2", plain(peer_timeout_s=3),
                    ("node:0", "node:1"), ("party node:2 ",),
                    fault=lambda procs: procs["node:2"].send_signal(signal.SIGTERM),
                    fault_after="] link up", check=stopped_by_sigterm),
        PartiesCase("fault: different job on one party", "node:2's config runs policy 'full', "
                    "the others 'mpcache_exact'", "every party exits 3: the compiled programs' "
                    "SHA-256 differ (parties named)", other_policy, ("node:0", "node:1", "node:2"),
                    ("compiled a different",)),
        PartiesCase("wire: model owner sends a pickle", "node:0 (patched) sends a pickle that "
                    f"would run `touch {marker}` instead of its first weight share",
                    "node:1 and node:2 exit 3 naming node:0; no marker file",
                    plain(prelude={"node:0": SEND_PICKLE.format(marker=marker)}),
                    ("node:1", "node:2"), ("party node:0 sent", "weight sharing"),
                    check=no_marker),
        PartiesCase("wire: model owner sends a wrong shape", "node:0 (patched) sends its first "
                    "weight share with an extra dimension", "node:1 and node:2 exit 3 naming "
                    "node:0", plain(prelude={"node:0": SEND_WRONG_SHAPE}), ("node:1", "node:2"),
                    ("party node:0 sent", "shape")),
    ]


def launcher_cases() -> list:
    return [
        LauncherSignalCase("launcher: SIGTERM", signal.SIGTERM, "SIGTERM to `experiments.party "
                           "--party=all` once every party is linked (16-token job)",
                           "launcher exits 143; no party process; no results.jsonl/outputs.npz"),
        LauncherSignalCase("launcher: SIGKILL (crash)", signal.SIGKILL, "SIGKILL to the "
                           "launcher once every party is linked", "no party process (they die "
                           "with it); no results.jsonl/outputs.npz"),
    ]


def _write(name: str, text: str) -> Callable[[pathlib.Path], None]:
    return lambda folder: (folder / name).write_text(text)


def cli_cases() -> list:
    acc = ("--experiment=accuracy", "--model=smollm2-135m", "--num_layers=1", "--lengths=200",
           "--num_samples=1", "--policies=full", "--max_new_tokens=2")
    lb = (*acc, "--task=longbench_jsonl", "--metric=contains")
    return [
        CliCase("cli: generate ignores --task", "--experiment=generate --policies=full "
                "--task=passkey (was ignored, yet recorded)",
                ("--experiment=generate", "--policies=full", "--task=passkey"),
                ("--task is not used by --experiment=generate",)),
        CliCase("cli: generate with --policies=foo", "--experiment=generate --policies=foo "
                "(was ignored: plaintext full ran)", ("--experiment=generate", "--policies=foo"),
                ("unknown policy 'foo'",)),
        CliCase("cli: generate with two policies", "--experiment=generate --policies=full,mpcache",
                ("--experiment=generate", "--policies=full,mpcache"),
                ("runs one policy: give --policies",)),
        CliCase("cli: accuracy ignores --backend", "--experiment=accuracy --backend=xla",
                (*acc, "--backend=xla"), ("--backend is not used by --experiment=accuracy",)),
        CliCase("cli: protocol vs node config", "--backend=spu_nodes with the 2-party SEMI2K "
                "config and --protocol=ABY3 (ran SEMI2K)",
                ("--experiment=generate", "--backend=spu_nodes", "--policies=full",
                 "--node_config=experiments/nodes/2pc_semi2k.json", "--protocol=ABY3"),
                ("--protocol=ABY3 conflicts with", "which runs SEMI2K")),
        CliCase("cli: mpc_cost with an unknown policy", "--policies=full,foo (failed after "
                "costing full, leaving partial rows)",
                ("--experiment=mpc_cost", "--model=llama-tiny", "--policies=full,foo"),
                ("unknown policy 'foo'",)),
        CliCase("cli: --resume with another --seed", "a finished record made with --seed=0, "
                "then --resume --seed=1 (relabelled the old outputs)",
                (*acc, "--task=passkey", "--resume", "--seed=1", "--output_dir={dir}/old"),
                ("--resume", "--seed (0 then, 1 now)"),
                prepare=_resume_folder),
        CliCase("cli: empty LongBench file", "--data_path to an empty file (ZeroDivisionError "
                "in plotting)", (*lb, "--data_path={dir}/empty.jsonl"), ("empty.jsonl", "no samples"),
                prepare=_write("empty.jsonl", "")),
        CliCase("cli: malformed LongBench line", "line 2 of the JSONL is cut short (reported "
                "without the file and with the wrong line)",
                (*lb, "--num_samples=3", "--data_path={dir}/bad.jsonl"),
                ("bad.jsonl:2:", "not a JSON object"),
                prepare=_write("bad.jsonl", '{"context": "a", "input": "b", "answers": ["c"]}\n'
                               '{"context": "a", "input": \n')),
        CliCase("cli: --output_dir is a file", "--output_dir pointing at a file (raised after "
                "the whole run)", (*acc, "--task=passkey", "--output_dir={dir}/afile"),
                ("is a file, not a directory",), prepare=_write("afile", "x")),
        CliCase("cli: unknown model", "--model=llama-9000",
                ("--experiment=generate", "--policies=full", "--model=llama-9000"),
                ("unknown model 'llama-9000'",)),
    ]


def _resume_folder(folder: pathlib.Path) -> None:
    """An output folder holding one record made with --seed=0 (and its run_config.json)."""
    from experiments.common import config_hash
    old = folder / "old"
    old.mkdir()
    settings = {"seed": 0}
    digest = config_hash(settings)
    (old / "samples.jsonl").write_text(json.dumps(
        {"task": "passkey", "sample_id": "passkey-0", "policy": "full", "budget": 1.0,
         "config_hash": digest}) + "\n")
    (old / "run_config.json").write_text(json.dumps(settings))
    (old / "results.jsonl").write_text('{"previous": true}\n')


def all_cases() -> list:
    """Every case, fast ones first."""
    return (wire_cases() + front_cases() + front_scenario_cases() + config_cases() + cli_cases()
            + party_cases() + launcher_cases())
