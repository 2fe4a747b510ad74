"""Which front in C (fast_front.c) a party's front runs in its place, if any: in plain TCP
without an outbound side or shaping (every party on loopback), a build of this checkout's
fast_front.c, which scripts/setup.sh makes beside the venv's python (scripts/build_fast_front.py:
the binary and, beside it, a .sha256 naming the source it was built from). The runtime only
finds that build and checks its hash; MPCACHE_FAST_FRONT=off keeps front.py, =PATH names
another build. Standard library only.
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
import pathlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.distributed.front_state import FrontSpec

FAST_FRONT_SOURCE = pathlib.Path(__file__).with_name("fast_front.c")
# Where scripts/setup.sh builds it (beside the venv's python), and the variable that picks
# another build ("off": always front.py).
FAST_FRONT_NAME = "mpcache-fast-front"
FAST_FRONT_ENV = "MPCACHE_FAST_FRONT"


def fast_front_source_hash() -> str:
    return hashlib.sha256(FAST_FRONT_SOURCE.read_bytes()).hexdigest()


def installed_fast_front() -> pathlib.Path:
    """Where scripts/setup.sh builds the front in C: beside this venv's python."""
    return pathlib.Path(sys.prefix) / "bin" / FAST_FRONT_NAME


def built_from_hash(binary: pathlib.Path) -> str | None:
    """The source hash `binary` was built from (its .sha256 beside it), None if unknown."""
    try:
        return pathlib.Path(f"{binary}.sha256").read_text().strip()
    except OSError:
        return None


def fast_front_binary(spec: FrontSpec) -> pathlib.Path | None:
    """The C front to run in this process's place for `spec`, or None: only in plain TCP
    with no outbound side and no shaping on an IP address, and only a build of this
    checkout's fast_front.c (its .sha256 beside it); MPCACHE_FAST_FRONT names another build
    or is "off"."""
    choice = os.environ.get(FAST_FRONT_ENV, "")
    if choice == "off" or spec.tls is not None or spec.relay_outbound or spec.delay_s > 0 \
            or spec.rate_bytes_s:
        return None
    try:
        ipaddress.ip_address(spec.listen_host)
    except ValueError:
        return None
    binary = pathlib.Path(choice) if choice else installed_fast_front()
    built_from = built_from_hash(binary)
    if built_from is None:
        if choice:
            print(f"[party {spec.party}] front: {FAST_FRONT_ENV}={choice} has no .sha256 beside "
                  "it (build it with scripts/build_fast_front.py); running front.py",
                  file=sys.stderr, flush=True)
        return None
    if built_from != fast_front_source_hash():
        print(f"[party {spec.party}] front: {binary} was built from another fast_front.c; "
              "running front.py (rebuild: bash scripts/setup.sh)", file=sys.stderr, flush=True)
        return None
    return binary


def fast_front_args(spec: FrontSpec) -> list[str]:
    """The C front's arguments after LISTEN_FD (fast_front.c's usage)."""
    peers = [str(x) for node, p in spec.peers.items() for x in (node, int(p["rank"]))]
    return [spec.backend_path, spec.party, str(spec.rank), spec.link_id, spec.hello_key,
            str(spec.max_frame_bytes), str(spec.max_message_bytes),
            str(spec.max_buffered_bytes), spec.events_path,
            str(round(spec.frame_deadline_s * 1000)), str(spec.max_connections),
            str(spec.max_per_source)] + peers


