"""Node configs: who the parties are, who owns what, how they talk, and what they run.

The JSON is shaped like SPU's `3pc.json` ("nodes" + "devices" with one SPU device and PYU
devices), plus a "job" section naming the public program:

    {
      "id": "mpcache.3pc.loopback",
      "nodes": {"node:0": "127.0.0.1:61320", "node:1": "127.0.0.1:61321", ...},
      "devices": {
        "SPU": {"kind": "SPU", "config": {
            "node_ids": ["node:0", "node:1", "node:2"],          # SPU rank = position here
            "runtime_config": {"protocol": "ABY3", "field": "FM64", ...},   # SPU RuntimeConfig JSON
            "link": {"peer_timeout_s": 30, "recv_timeout_s": 600, ...,
                     "tls": {"ca": "ca.crt", "certs": {"node:0": {"cert": "...", "key": "..."}}}}}},
        "MODEL_OWNER":  {"kind": "PYU", "config": {"node_id": "node:0"}},
        "PROMPT_OWNER": {"kind": "PYU", "config": {"node_id": "node:1"}}
      },
      "job": {"model": "llama-tiny", "policy": "mpcache", "budget": 0.5, "seq_len": 64, ...}
    }

"nodes" maps each party id to the host:port of its SPU link (brpc) endpoint. Relative
certificate paths are resolved against the config file's directory. Every check runs in
`load_node_config`, before any process or socket is started, and each message says what to fix.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

from mpcache_jax.mpc import config as mpc_config
from mpcache_jax.mpc.config import MPCConfig


class NodeConfigError(ValueError):
    """A node config is malformed; the message names the offending entry and what to change."""


@dataclasses.dataclass(frozen=True)
class PartyCerts:
    cert: str
    key: str


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """Mutual TLS: every party presents its own certificate and checks its peers' against `ca`."""

    ca: str
    certs: dict[str, PartyCerts]
    verify_depth: int = 1


@dataclasses.dataclass(frozen=True)
class LinkOptions:
    """brpc link settings and failure detection.

    `peer_timeout_s`: every party probes its peers' link endpoints once a second while the job
    runs; a peer that refuses or does not answer for this long (dead, hung, unreachable) makes
    the party fail with a message naming it. `recv_timeout_s`: the link's own limit on waiting
    for one message from a peer that is alive; it also bounds start-up (peers still starting)
    and must exceed the longest local step of any party (the model owner compiles the program,
    ~20 s for a 30-layer model)."""

    peer_timeout_s: float = 30.0
    recv_timeout_s: float = 600.0
    connect_retry_times: int = 10
    connect_retry_interval_ms: int = 1000
    http_timeout_ms: int = 20000
    tls: TLSConfig | None = None

    def __post_init__(self):
        for name in ("peer_timeout_s", "recv_timeout_s"):
            if getattr(self, name) <= 0:
                raise NodeConfigError(f"link.{name}={getattr(self, name)} must be > 0 seconds")
        if self.connect_retry_times < 0 or self.connect_retry_interval_ms <= 0:
            raise NodeConfigError("link.connect_retry_times must be >= 0 and "
                                  "link.connect_retry_interval_ms > 0")
        if self.http_timeout_ms <= 0:
            raise NodeConfigError(f"link.http_timeout_ms={self.http_timeout_ms} must be > 0")


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """The public program every party agrees to run: secure generation of `max_new_tokens`
    greedy tokens after a `seq_len`-token prompt with `policy` on `model`.

    The prompt is the prompt owner's private input: a file given to its party only
    (`--prompt_file`, wrapped in the chat template when `chat`), else `prompt_ids`, else
    `seq_len` random ids drawn with `prompt_seed`; its length is public. `seed` draws random
    weights for random-weight models. `reveal_logits` also opens the logits of each generated
    token to the prompt owner (tests; leaks more than tokens).
    """

    model: str = "llama-tiny"
    policy: str = "mpcache"
    budget: float | None = None
    policy_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    seq_len: int = 64
    max_new_tokens: int = 2
    num_layers: int | None = None
    seed: int = 0
    prompt_seed: int = 1
    prompt_ids: tuple[int, ...] | None = None
    chat: bool = True
    reveal_logits: bool = False
    timeout_s: float = 600.0

    def __post_init__(self):
        from models.registry import MODEL_NAMES
        from mpcache_jax.policies import POLICY_NAMES
        if self.model not in MODEL_NAMES:
            raise NodeConfigError(f"job.model={self.model!r} is unknown; use one of {MODEL_NAMES}")
        if self.policy not in POLICY_NAMES:
            raise NodeConfigError(f"job.policy={self.policy!r} is unknown; use one of {POLICY_NAMES}")
        if self.seq_len < 1 or self.max_new_tokens < 1:
            raise NodeConfigError("job.seq_len and job.max_new_tokens must be >= 1")
        if self.prompt_ids is not None and len(self.prompt_ids) != self.seq_len:
            raise NodeConfigError(f"job.prompt_ids has {len(self.prompt_ids)} ids but job.seq_len "
                                  f"is {self.seq_len}; make them agree")
        if self.timeout_s <= 0:
            raise NodeConfigError(f"job.timeout_s={self.timeout_s} must be > 0 seconds")


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """A validated node config. `parties` is in SPU rank order: (node id, "host:port")."""

    id: str
    parties: tuple[tuple[str, str], ...]
    mpc: MPCConfig
    model_owner: str
    prompt_owner: str
    link: LinkOptions
    job: JobSpec
    path: str | None = None

    @property
    def party_ids(self) -> tuple[str, ...]:
        return tuple(pid for pid, _ in self.parties)

    @property
    def world_size(self) -> int:
        return len(self.parties)

    @property
    def protocol(self) -> str:
        return self.mpc.protocol

    def rank(self, party_id: str) -> int:
        if party_id not in self.party_ids:
            raise NodeConfigError(f"party {party_id!r} is not in this node config; its parties "
                                  f"are {list(self.party_ids)}")
        return self.party_ids.index(party_id)

    def address(self, party_id: str) -> str:
        return self.parties[self.rank(party_id)][1]


    def with_job(self, **overrides) -> "NodeConfig":
        job = dataclasses.replace(self.job, **overrides) if overrides else self.job
        return dataclasses.replace(self, job=job)


# ----- parsing ------------------------------------------------------------------------------

def _need(mapping: dict, key: str, where: str, kind=None):
    if not isinstance(mapping, dict) or key not in mapping:
        raise NodeConfigError(f"{where} is missing {key!r}")
    value = mapping[key]
    if kind is not None and not isinstance(value, kind):
        raise NodeConfigError(f"{where}.{key} must be a {kind.__name__}, got {value!r}")
    return value


def _check_address(party: str, addr: Any) -> tuple[str, int]:
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NodeConfigError(f"nodes[{party!r}]={addr!r} is not host:port (e.g. 127.0.0.1:61320)")
    return host, int(port)


def validate_runtime_config(runtime: Any, world_size: int) -> MPCConfig:
    """SPU RuntimeConfig JSON -> a validated MPCConfig for `world_size` parties (unknown key,
    unknown protocol or field, protocol vs party count, field too narrow for the fraction bits)."""
    if not isinstance(runtime, dict):
        raise NodeConfigError("devices.SPU.config.runtime_config must be a JSON object, e.g. "
                              '{"protocol": "ABY3", "field": "FM64"}')
    if "protocol" not in runtime:
        raise NodeConfigError('devices.SPU.config.runtime_config is missing "protocol" '
                              '(ABY3 for 3 parties, SEMI2K or CHEETAH for 2)')
    try:
        return mpc_config.from_json(dict(runtime), parties=world_size)
    except mpc_config.MPCConfigError as err:
        raise NodeConfigError(f"devices.SPU.config.runtime_config: {err} "
                              f"(node_ids lists {world_size} parties)") from None


def _parse_tls(tls: Any, base: pathlib.Path, party_ids: tuple[str, ...],
               check_parties: tuple[str, ...]) -> TLSConfig | None:
    if tls is None:
        return None
    if not isinstance(tls, dict):
        raise NodeConfigError('link.tls must be {"ca": PATH, "certs": {NODE: {"cert": PATH, "key": PATH}}}')

    def resolve(path: Any, where: str, must_exist: bool) -> str:
        if not isinstance(path, str) or not path:
            raise NodeConfigError(f"{where} must be a file path, got {path!r}")
        full = pathlib.Path(path) if os.path.isabs(path) else base / path
        if must_exist and not full.is_file():
            raise NodeConfigError(f"{where}={path!r} does not exist (looked for {full}); give the "
                                  "PEM file's path, absolute or relative to the node config")
        return str(full)

    certs_in = _need(tls, "certs", "link.tls", dict)
    unknown = sorted(set(certs_in) - set(party_ids))
    if unknown:
        raise NodeConfigError(f"link.tls.certs names unknown part(y/ies) {unknown}; "
                              f"the nodes are {list(party_ids)}")
    missing = sorted(set(check_parties) - set(certs_in))
    if missing:
        raise NodeConfigError(f"link.tls.certs has no certificate for {missing}: with TLS every "
                              'party needs {"cert": PATH, "key": PATH}')
    certs = {}
    for pid, entry in certs_in.items():
        check = pid in check_parties
        certs[pid] = PartyCerts(cert=resolve(_need(entry, "cert", f"link.tls.certs[{pid!r}]"),
                                             f"link.tls.certs[{pid!r}].cert", check),
                                key=resolve(_need(entry, "key", f"link.tls.certs[{pid!r}]"),
                                            f"link.tls.certs[{pid!r}].key", check))
    depth = tls.get("verify_depth", 1)
    if not isinstance(depth, int) or depth < 1:
        raise NodeConfigError(f"link.tls.verify_depth={depth!r} must be an integer >= 1")
    return TLSConfig(ca=resolve(_need(tls, "ca", "link.tls"), "link.tls.ca", bool(check_parties)),
                     certs=certs, verify_depth=depth)


def parse_node_config(raw: dict, *, base_dir: str | os.PathLike = ".", party: str | None = None,
                      path: str | None = None) -> NodeConfig:
    """Validate a node config dict. With `party`, only that party's local files (TLS key and
    certificate) must exist; without it (loopback launcher) every party's must."""
    if not isinstance(raw, dict):
        raise NodeConfigError("a node config is a JSON object with 'nodes', 'devices' and 'job'")
    nodes = _need(raw, "nodes", "node config", dict)
    devices = _need(raw, "devices", "node config", dict)
    seen: dict[tuple[str, int], str] = {}
    for pid, addr in nodes.items():
        host, port = _check_address(pid, addr)
        key = ("*" if host in ("127.0.0.1", "localhost", "0.0.0.0") else host, port)
        if key in seen:
            raise NodeConfigError(f"nodes {seen[key]!r} and {pid!r} both use port {port} on "
                                  f"{host}; give each party its own port")
        seen[key] = pid

    spu_devices = [name for name, dev in devices.items()
                   if isinstance(dev, dict) and dev.get("kind") == "SPU"]
    if len(spu_devices) != 1:
        raise NodeConfigError(f"devices must hold exactly one device of kind 'SPU', found "
                              f"{len(spu_devices)}")
    spu_name = spu_devices[0]
    spu_cfg = _need(devices[spu_name], "config", f"devices.{spu_name}", dict)
    node_ids = _need(spu_cfg, "node_ids", f"devices.{spu_name}.config", list)
    for pid in node_ids:
        if pid not in nodes:
            raise NodeConfigError(f"devices.{spu_name}.config.node_ids names unknown party {pid!r}; "
                                  f"add it to 'nodes' or use one of {list(nodes)}")
    if len(set(node_ids)) != len(node_ids):
        raise NodeConfigError(f"devices.{spu_name}.config.node_ids lists a party twice: {node_ids}")
    runtime = validate_runtime_config(_need(spu_cfg, "runtime_config",
                                            f"devices.{spu_name}.config"), len(node_ids))
    if party is not None and party not in node_ids:
        raise NodeConfigError(f"--party={party!r} is not one of the SPU parties {node_ids}")

    owners = {}
    for role in ("MODEL_OWNER", "PROMPT_OWNER"):
        if role not in devices:
            raise NodeConfigError(f"devices.{role} is missing: add "
                                  f'"{role}": {{"kind": "PYU", "config": {{"node_id": "<one of '
                                  f'{node_ids}>"}}}}')
        owner = _need(_need(devices[role], "config", f"devices.{role}", dict), "node_id",
                      f"devices.{role}.config")
        if owner not in node_ids:
            raise NodeConfigError(f"devices.{role}.config.node_id={owner!r} is not an SPU party; "
                                  f"use one of {node_ids}")
        owners[role] = owner
    if owners["MODEL_OWNER"] == owners["PROMPT_OWNER"]:
        raise NodeConfigError("MODEL_OWNER and PROMPT_OWNER are the same node "
                              f"{owners['MODEL_OWNER']!r}: that party would see both the weights and "
                              "the prompt; give them different nodes")

    link_raw = dict(spu_cfg.get("link", {}))
    tls_raw = link_raw.pop("tls", None)
    link_fields = {f.name for f in dataclasses.fields(LinkOptions)} - {"tls"}
    unknown = sorted(set(link_raw) - link_fields)
    if unknown:
        raise NodeConfigError(f"link has unknown option(s) {unknown}; options: {sorted(link_fields)}")
    check = (party,) if party is not None else tuple(node_ids)
    tls = _parse_tls(tls_raw, pathlib.Path(base_dir), tuple(node_ids), check)
    link = LinkOptions(**link_raw, tls=tls)

    job_raw = dict(raw.get("job", {}))
    job_fields = {f.name for f in dataclasses.fields(JobSpec)}
    unknown = sorted(set(job_raw) - job_fields)
    if unknown:
        raise NodeConfigError(f"job has unknown key(s) {unknown}; keys: {sorted(job_fields)}")
    if job_raw.get("prompt_ids") is not None:
        job_raw["prompt_ids"] = tuple(int(t) for t in job_raw["prompt_ids"])
    try:
        job = JobSpec(**job_raw)
    except TypeError as err:
        raise NodeConfigError(f"job: {err}") from None

    return NodeConfig(id=str(raw.get("id", "mpcache")),
                      parties=tuple((pid, nodes[pid]) for pid in node_ids),
                      mpc=runtime, model_owner=owners["MODEL_OWNER"],
                      prompt_owner=owners["PROMPT_OWNER"], link=link, job=job, path=path)


def load_node_config(path: str | os.PathLike, party: str | None = None) -> NodeConfig:
    """Read and validate a node config file (see the module docstring for the format)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise NodeConfigError(f"node config {str(path)!r} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise NodeConfigError(f"node config {str(path)!r} is not valid JSON: {err}") from None
    return parse_node_config(raw, base_dir=path.parent, party=party, path=str(path.resolve()))
