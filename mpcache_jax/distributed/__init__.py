"""Multi-process / multi-host secure runs from SPU-style node configs.

config.py  node config dataclasses, JSON loader, validation (NodeConfigError)
job.py     the public program (secure greedy generation) and each owner's private input
party.py   one party: brpc link (optional mutual TLS), program distribution, sharing, run,
           reveal to the prompt owner, per-party cost; PartyFailure names a failing peer
costs.py   per-party profile -> the simulation benchmarks' JSONL record schema
launch.py  loopback launcher: all parties as local processes (run_loopback), JobFailed
supervise.py  the party's supervisor process (explains a worker the link layer ended)
compare.py simulated (spu_sim) vs multi-process cost of the same job
"""
from mpcache_jax.distributed.config import (JobSpec, LinkOptions, NodeConfig, NodeConfigError,
                                            TLSConfig, load_node_config, parse_node_config)
from mpcache_jax.distributed.launch import JobFailed, run_loopback
from mpcache_jax.distributed.party import (EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_PEER,
                                           PartyFailure, run_party)

__all__ = ["JobSpec", "LinkOptions", "NodeConfig", "NodeConfigError", "TLSConfig",
           "load_node_config", "parse_node_config", "JobFailed", "run_loopback", "PartyFailure",
           "run_party", "EXIT_OK", "EXIT_FAILURE", "EXIT_CONFIG", "EXIT_PEER"]
