"""Multi-process / multi-host secure runs from SPU-style node configs.

config.py        node config: JSON loader, validation; options.py (its sections), bounds.py
job.py           the job's public side (model, policy, weight shapes) and each owner's input
node_backend.py  one party behind the backend interface (compile and compare, typed sharing,
                 resident shares, reveal to the owner only, public decisions)
wire.py          typed messages between parties (no pickle), checked against expectations
party.py         one party's run and its brpc link (optional mutual TLS) behind its front;
                 party_front.py (the front's spec and process), blame.py (probes, who
                 failed, the Watchdog), process.py (exit statuses, PartyFailure, the private
                 directory, parent binding)
costs.py         per-party profiles as data; one record schema for spu_sim and spu_nodes
launch.py        loopback launcher: all parties as local processes (run_loopback), JobFailed
supervise.py     the party's supervisor process (explains a worker the link layer ended)
compare.py       simulated (spu_sim) vs multi-process cost of the same job
front.py         each party's front door (frames.py, rules.py, front_state.py, relay.py,
                 fast_front.py: the front in C)
"""
from runtime.distributed.config import (JobSpec, LinkOptions, NodeConfig, NodeConfigError,
                                        TLSConfig, load_node_config, parse_node_config)
from runtime.distributed.launch import JobFailed, run_loopback
from runtime.distributed.party import run_party
from runtime.distributed.process import (EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_PEER,
                                         PartyFailure)

__all__ = ["JobSpec", "LinkOptions", "NodeConfig", "NodeConfigError", "TLSConfig",
           "load_node_config", "parse_node_config", "JobFailed", "run_loopback", "PartyFailure",
           "run_party", "EXIT_OK", "EXIT_FAILURE", "EXIT_CONFIG", "EXIT_PEER"]
