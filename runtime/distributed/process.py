"""A party's processes: how they end (exit statuses, PartyFailure), what binds each to the
process that started it, and the private directory that holds its Unix sockets. Standard
library only (the front imports it).
"""
from __future__ import annotations

import os
import signal
import sys

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG, EXIT_PEER = 0, 1, 2, 3
PARENT_ENV = "MPCACHE_DIE_WITH_PARENT"
# Set by the supervisor for its worker: the private directory it made (and removes after).
PRIVATE_DIR_ENV = "MPCACHE_PRIVATE_DIR"


class PartyFailure(RuntimeError):
    """Another party died, hung, could not be reached or misbehaved; `party` names it."""

    def __init__(self, party: str | None, message: str):
        super().__init__(message)
        self.party = party


def log(party_id: str, message: str) -> None:
    print(f"[party {party_id}] {message}", file=sys.stderr, flush=True)


def node_tag(party_id: str) -> str:
    """The node id as it appears in file names (party_<tag>.log, spu_<tag>.log)."""
    return party_id.replace(":", "_")


def child_env(env: dict | None = None) -> dict:
    """The environment for a child that must not outlive this process (see bind_to_parent)."""
    return {**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())}


def bind_to_parent(always: bool = False) -> None:
    """In a child started with child_env() (or `always`): die (SIGKILL) when the parent dies,
    even if the parent is killed outright, and leave at once if it is already gone. Linux
    only (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent and not always:
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != int(parent):
        os._exit(1)   # the parent died before prctl took effect


# ----- the party's private directory ---------------------------------------------------------

def make_private_dir(party_id: str) -> str:
    """A new directory that only this user may enter (mode 0700), for the party's Unix sockets
    (brpc's, the front's outbound ones); under $TMPDIR, or /tmp when that is too long for a
    socket's path (107 bytes, with room for a node id's socket name)."""
    import tempfile
    prefix = f"mpcache-{node_tag(party_id)[:16]}-"
    base = tempfile.gettempdir()
    if len(base) + len(prefix) + 8 + len("/to_.sock") + 64 > 107:
        base = "/tmp"
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def remove_private_dir(path: str | None) -> None:
    import shutil
    if path:
        shutil.rmtree(path, ignore_errors=True)


# The private directory this worker made itself (no supervisor made one): removed on exit.
_OWN_PRIVATE_DIR: list[str] = []


def own_private_dir(party_id: str) -> str:
    """A private directory of this worker's own (when no supervisor made one), removed when
    it exits (exit_now, atexit)."""
    import atexit
    path = make_private_dir(party_id)
    _OWN_PRIVATE_DIR.append(path)
    atexit.register(remove_private_dir, path)
    return path


def exit_now(code: int) -> None:
    """Leave the process at once (os._exit: the link's threads may be blocked), removing the
    private directory this worker made for itself (a supervisor removes the one it made)."""
    for path in _OWN_PRIVATE_DIR:
        remove_private_dir(path)
    os._exit(code)
