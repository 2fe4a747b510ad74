"""Multi-process / multi-host secure runs from SPU-style node configs.

config.py    the node config (options.py: link and job sections; bounds.py: the job's bounds;
             certs.py: the TLS identity rule); job.py: the job's public side, owners' inputs
party.py     one party's run and its brpc link (node_backend.py: its backend; wire.py: typed
             messages; blame.py: probes, who failed, the Watchdog; party_front.py: its front's
             spec and process; process.py: exits, private directory, parent binding)
party_main.py  a party's entry point; launch.py: every party as a local process
             (run_loopback); supervise.py: the supervisor; compare.py, costs.py: cost records
front.py     the front door, its own process (frames.py: frame grammar; rules.py;
             front_state.py: spec, caps, events; relay.py: outbound side; fast_front.py:
             which build of the front in C, fast_front.c, runs in its place)
Names below load their module on first use (the front's modules need no JAX).
"""
import importlib

_HOMES = {"JobSpec": "options", "LinkOptions": "options", "NodeConfigError": "options",
          "TLSConfig": "options", "NodeConfig": "config", "load_node_config": "config",
          "parse_node_config": "config", "JobFailed": "launch", "run_loopback": "launch",
          "PartyFailure": "process", "EXIT_OK": "process", "EXIT_FAILURE": "process",
          "EXIT_CONFIG": "process", "EXIT_PEER": "process", "run_party": "party"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
