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

"nodes" maps each party id to the host:port of its SPU link (brpc) endpoint. Node ids are
1-64 characters from letters, digits and `. _ : -` (they name log files, the link and the
certificate CN). Relative certificate paths are resolved against the config file's directory.
Every check runs in `load_node_config`, before any process or socket is started, and each
message says what to fix: types (numbers are JSON numbers, ids are integers), ranges, the
job's bounds (context, the policy's check_prompt at job.seq_len naming the smallest budget
that serves it, memory: `check_job_bounds`) and the TLS identity rule below. A launcher
that overrides job fields loads with `check_job=False` and checks the job it will run
(`NodeConfig.with_job`); every party checks it again at the announced prompt length.

TLS identity rule (mutual TLS with identity). brpc, and yacl's link options above it, check a
peer's certificate only against the CA (`verify.ca_file_path`, `verify_depth`): any certificate
the CA signed is accepted for any node. Each party therefore also checks who it is talking to:
the certificate a node presents must

  1. chain to `link.tls.ca`;
  2. have a subject CN exactly equal to the node id (e.g. CN=node:1);
  3. have a subjectAltName entry for the host of the node's address in "nodes" (an
     `IP Address` entry equal to an IP host, a `DNS` entry equal, case-insensitively, to a
     host name; no wildcards).

Checked twice: at config validation for every certificate file this process can read (its
own; every party's for the loopback launcher), and on the network, where each party opens its
own TLS connection (CA + its own certificate) to every peer's link endpoint before the first
share is sent (`blame.verify_peers`), and again on every liveness probe (`blame.probe`,
`identity_mismatch`): a peer whose certificate names another node ends the run with both
names. brpc's own server side would accept any CA-signed client certificate; it is
therefore never exposed: every party's endpoint is its front (front.py), which terminates
mutual TLS, requires a client certificate that names a peer node by this rule, binds the
connection to that node and refuses frames claiming another rank.

Plain TCP (no "tls") is allowed between loopback addresses only; a config with a non-loopback
host and no TLS is rejected unless `"insecure": true` is in the link section (then every
party prints a warning).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import pathlib
import re
from typing import Any

from runtime.distributed.bounds import check_job_bounds
from runtime.distributed.certs import (CertificateError, check_key_and_ca,
                                       check_own_certificate, check_validity, read_certificate)
from runtime.distributed.options import (JobSpec, LinkOptions, NodeConfigError, PartyCerts,
                                         TLSConfig, is_int)
from runtime.distributed.process import node_tag
from runtime.mpc import config as mpc_config
from runtime.mpc.config import MPCConfig


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
    # Things to tell the operator at load (a certificate that expires within 7 days).
    warnings: tuple[str, ...] = ()

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
        """This config with job keys replaced (validated, bounds checked; also without
        overrides, for a config loaded with check_job=False)."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(JobSpec)})
        if unknown:
            raise NodeConfigError(f"job has unknown key(s) {unknown}")
        config = dataclasses.replace(self, job=dataclasses.replace(self.job, **overrides))
        check_job_bounds(config)
        return config

    @property
    def parties_on_this_host(self) -> int:
        """Parties that run on one machine: all of them for a loopback config, else one."""
        loopback = sum(is_loopback(address.rpartition(":")[0]) for _, address in self.parties)
        return loopback if loopback == self.world_size else 1


# ----- parsing ------------------------------------------------------------------------------

def _need(mapping: dict, key: str, where: str, kind=None):
    if not isinstance(mapping, dict) or key not in mapping:
        raise NodeConfigError(f"{where} is missing {key!r}")
    value = mapping[key]
    if kind is not None and not isinstance(value, kind):
        raise NodeConfigError(f"{where}.{key} must be a {kind.__name__}, got {value!r}")
    return value


NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
LOOPBACK_NAMES = ("localhost",)


def check_node_ids(ids) -> None:
    """Node ids name files, the link and certificates: 1-64 of `A-Z a-z 0-9 . _ : -`,
    starting with a letter or digit, distinct also after ':' -> '_' (their file names)."""
    tags: dict[str, str] = {}
    for pid in ids:
        if not isinstance(pid, str) or not NODE_ID.fullmatch(pid):
            raise NodeConfigError(f"node id {pid!r} is not allowed: use 1-64 letters, digits and "
                                  "'.', '_', ':', '-', starting with a letter or digit (it "
                                  "names log files and must equal its certificate's CN), e.g. "
                                  "'node:0'")
        if node_tag(pid) in tags:
            raise NodeConfigError(f"node ids {tags[node_tag(pid)]!r} and {pid!r} would share the "
                                  f"log files {node_tag(pid)}; rename one")
        tags[node_tag(pid)] = pid


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or 'localhost'."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


ASCII_PORT = re.compile(r"[0-9]{1,5}")
HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?")


def _check_address(party: str, addr: Any) -> tuple[str, int]:
    """nodes[party] = "host:port" -> (host, port). The host is an IPv4 address or a DNS name
    (IPv6 literals are refused: SPU 0.9.5's brpc link and the probes take `host:port` only);
    the port is 1-65535 in ASCII digits (`str.isdigit` also accepts full-width digits)."""
    if not isinstance(addr, str):
        raise NodeConfigError(f"nodes[{party!r}]={addr!r} must be a string \"host:port\" "
                              "(e.g. \"127.0.0.1:61320\")")
    if addr.startswith("[") or addr.count(":") > 1:
        raise NodeConfigError(f"nodes[{party!r}]={addr!r} is an IPv6 address: not supported "
                              "(SPU 0.9.5's brpc link takes host:port only); use an IPv4 "
                              "address (e.g. 127.0.0.1 for ::1) or a host name")
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise NodeConfigError(f"nodes[{party!r}]={addr!r} is not host:port (e.g. 127.0.0.1:61320)")
    if not ASCII_PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise NodeConfigError(f"nodes[{party!r}]={addr!r}: the port {port!r} must be a number "
                              "from 1 to 65535 in ASCII digits 0-9 (e.g. 127.0.0.1:61320)")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        if not HOST_NAME.fullmatch(host) or len(host) > 253 or host.replace(".", "").isdigit():
            raise NodeConfigError(f"nodes[{party!r}]={addr!r}: the host {host!r} is neither an "
                                  "IPv4 address nor a host name (letters, digits, '-', '.')"
                                  ) from None
    return host, int(port)


def _same_endpoint_key(host: str, port: int) -> tuple[str, int]:
    """Hosts that name the same listening socket map to one key: every loopback spelling
    ('localhost', 127.0.0.1, 0.0.0.0, which binds them all) is one host; names compare
    case-insensitively."""
    lowered = host.lower().rstrip(".")
    return ("*" if lowered in ("localhost", "0.0.0.0") or is_loopback(lowered) else lowered,
            port)


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


def check_regular_file(full: pathlib.Path, given: str, where: str) -> None:
    """`where`=`given` (found at `full`) must be a regular file this process can read: not
    missing, not a directory, not a device, FIFO or socket (reading one could block or never
    end)."""
    import stat
    try:
        info = os.stat(full)
    except FileNotFoundError:
        raise NodeConfigError(f"{where}={given!r} does not exist (looked for {full}); give the "
                              "PEM file's path, absolute or relative to the node config"
                              ) from None
    except OSError as err:
        raise NodeConfigError(f"{where}={given!r} cannot be read ({err.strerror}; looked for "
                              f"{full})") from None
    if stat.S_ISDIR(info.st_mode):
        raise NodeConfigError(f"{where}={given!r} is a directory, not a PEM file (looked for "
                              f"{full}); give the file's path")
    if not stat.S_ISREG(info.st_mode):
        kind = ("a character device" if stat.S_ISCHR(info.st_mode) else "a block device"
                if stat.S_ISBLK(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a regular file")
        raise NodeConfigError(f"{where}={given!r} is {kind}, not a regular PEM file (looked "
                              f"for {full}); give the file's path")
    try:
        with open(full, "rb") as f:
            f.read(1)
    except OSError as err:
        raise NodeConfigError(f"{where}={given!r} cannot be read ({err.strerror}; looked for "
                              f"{full})") from None


def _parse_tls(tls: Any, base: pathlib.Path, hosts: dict[str, str],
               check_parties: tuple[str, ...], warnings: list[str] | None = None
               ) -> TLSConfig | None:
    """link.tls -> TLSConfig; the files of `check_parties` must exist, be within their
    validity dates (the CA's too) and name their node (CN) and host (SAN). Certificates that
    expire within 7 days add a line to `warnings`."""
    warnings = [] if warnings is None else warnings
    party_ids = tuple(hosts)
    if tls is None:
        return None
    if not isinstance(tls, dict):
        raise NodeConfigError('link.tls must be {"ca": PATH, "certs": {NODE: {"cert": PATH, "key": PATH}}}')

    def resolve(path: Any, where: str, must_exist: bool) -> str:
        if not isinstance(path, str) or not path:
            raise NodeConfigError(f"{where} must be a file path, got {path!r}")
        full = pathlib.Path(path) if os.path.isabs(path) else base / path
        if must_exist:
            check_regular_file(full, path, where)
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
        if not isinstance(entry, dict):
            raise NodeConfigError(f'link.tls.certs[{pid!r}] must be {{"cert": PATH, "key": PATH}}')
        check = pid in check_parties
        certs[pid] = PartyCerts(cert=resolve(_need(entry, "cert", f"link.tls.certs[{pid!r}]"),
                                             f"link.tls.certs[{pid!r}].cert", check),
                                key=resolve(_need(entry, "key", f"link.tls.certs[{pid!r}]"),
                                            f"link.tls.certs[{pid!r}].key", check))
    unknown = sorted(set(tls) - {"ca", "certs", "verify_depth"})
    if unknown:
        raise NodeConfigError(f"link.tls has unknown key(s) {unknown}; keys: ca, certs, "
                              "verify_depth")
    depth = tls.get("verify_depth", 1)
    if not is_int(depth) or depth < 1:
        raise NodeConfigError(f"link.tls.verify_depth={depth!r} must be an integer >= 1")
    ca = resolve(_need(tls, "ca", "link.tls"), "link.tls.ca", bool(check_parties))
    if check_parties:
        try:
            ca_cert = read_certificate(ca)
            warning = None if ca_cert is None else check_validity(ca_cert, ca, "link.tls.ca")
        except CertificateError as err:
            raise NodeConfigError(str(err)) from None
        if warning:
            warnings.append(warning)
    for pid in check_parties:
        where = f"link.tls.certs[{pid!r}]"
        try:
            warning = check_own_certificate(pid, hosts[pid], certs[pid].cert, f"{where}.cert")
            check_key_and_ca(certs[pid].cert, certs[pid].key, ca, f"{where}.cert",
                             f"{where}.key")
        except CertificateError as err:
            raise NodeConfigError(str(err)) from None
        if warning:
            warnings.append(warning)
    return TLSConfig(ca=ca, certs=certs, verify_depth=depth)


def parse_node_config(raw: dict, *, base_dir: str | os.PathLike = ".", party: str | None = None,
                      path: str | None = None, check_job: bool = True) -> NodeConfig:
    """Validate a node config dict. With `party`, only that party's local files (TLS key and
    certificate) must exist; without it (loopback launcher) every party's must.
    `check_job=False` leaves out the job's bounds (`check_job_bounds`: context, policy,
    memory) for a launcher that checks them after its overrides (`NodeConfig.with_job`)."""
    if not isinstance(raw, dict):
        raise NodeConfigError("a node config is a JSON object with 'nodes', 'devices' and 'job'")
    nodes = _need(raw, "nodes", "node config", dict)
    devices = _need(raw, "devices", "node config", dict)
    config_id = raw.get("id", "mpcache")
    if not isinstance(config_id, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}",
                                                          config_id):
        raise NodeConfigError(f"id={config_id!r} must be 1-128 letters, digits and '.', '_', "
                              "':', '-' (it names the link)")
    check_node_ids(nodes)
    seen: dict[tuple[str, int], str] = {}
    for pid, addr in nodes.items():
        host, port = _check_address(pid, addr)
        key = _same_endpoint_key(host, port)
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
        if not isinstance(pid, str) or pid not in nodes:
            raise NodeConfigError(f"devices.{spu_name}.config.node_ids names unknown party {pid!r}; "
                                  f"add it to 'nodes' or use one of {list(nodes)}")
    if len(set(node_ids)) != len(node_ids):
        raise NodeConfigError(f"devices.{spu_name}.config.node_ids lists a party twice: {node_ids}")
    extra = [pid for pid in nodes if pid not in node_ids]
    if extra:
        raise NodeConfigError(f"nodes names {extra[0]!r}, which devices.{spu_name}.config."
                              f"node_ids does not list (it would be ignored); add it to "
                              f"node_ids or remove it from nodes")
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

    if not isinstance(spu_cfg.get("link", {}), dict):
        raise NodeConfigError(f"devices.{spu_name}.config.link must be a JSON object, e.g. "
                              '{"peer_timeout_s": 30}')
    link_raw = dict(spu_cfg.get("link", {}))
    tls_raw = link_raw.pop("tls", None)
    link_fields = {f.name for f in dataclasses.fields(LinkOptions)} - {"tls"}
    unknown = sorted(set(link_raw) - link_fields)
    if unknown:
        raise NodeConfigError(f"link has unknown option(s) {unknown}; options: {sorted(link_fields)}")
    if link_raw.get("insecure") is True and tls_raw is not None:
        raise NodeConfigError('link.insecure=true and link.tls contradict each other: remove '
                              '"insecure" to use TLS, or "tls" to run over plain TCP')
    check = (party,) if party is not None else tuple(node_ids)
    hosts = {pid: _check_address(pid, nodes[pid])[0] for pid in node_ids}
    warnings: list[str] = []
    tls = _parse_tls(tls_raw, pathlib.Path(base_dir), hosts, check, warnings)
    link = LinkOptions(**link_raw, tls=tls)
    remote = sorted(pid for pid, host in hosts.items() if not is_loopback(host))
    if remote and tls is None and not link.insecure:
        raise NodeConfigError(
            f"nodes {[f'{pid} at {hosts[pid]}' for pid in remote]} are not on loopback and "
            "devices.SPU.config.link has no \"tls\" section: shares and tokens would cross the "
            "network as plain TCP. Add \"tls\": {\"ca\": ..., \"certs\": {...}} (see "
            "experiments/nodes/3pc_aby3_hosts_tls.json), or add \"insecure\": true to the link "
            "section to accept plain TCP")

    if not isinstance(raw.get("job", {}), dict):
        raise NodeConfigError('job must be a JSON object, e.g. {"model": "llama-tiny", '
                              '"policy": "mpcache", "seq_len": 64}')
    job_raw = dict(raw.get("job", {}))
    job_fields = {f.name for f in dataclasses.fields(JobSpec)}
    unknown = sorted(set(job_raw) - job_fields)
    if unknown:
        raise NodeConfigError(f"job has unknown key(s) {unknown}; keys: {sorted(job_fields)}")
    try:
        job = JobSpec(**job_raw)
    except TypeError as err:
        raise NodeConfigError(f"job: {err}") from None

    config = NodeConfig(id=config_id, parties=tuple((pid, nodes[pid]) for pid in node_ids),
                        mpc=runtime, model_owner=owners["MODEL_OWNER"],
                        prompt_owner=owners["PROMPT_OWNER"], link=link, job=job, path=path,
                        warnings=tuple(warnings))
    if check_job:
        check_job_bounds(config)
    return config


def load_node_config(path: str | os.PathLike, party: str | None = None,
                     check_job: bool = True) -> NodeConfig:
    """Read and validate a node config file (see the module docstring for the format;
    `check_job` as in parse_node_config)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise NodeConfigError(f"node config {str(path)!r} does not exist")
    try:
        raw = loads_strict(path.read_text())
    except json.JSONDecodeError as err:
        raise NodeConfigError(f"node config {str(path)!r} is not valid JSON: {err}") from None
    except DuplicateKeyError as err:
        raise NodeConfigError(f"node config {str(path)!r}: {err}") from None
    return parse_node_config(raw, base_dir=path.parent, party=party, path=str(path.resolve()),
                             check_job=check_job)


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice (json.loads would silently keep the last)."""


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKeyError(f"the key {key!r} appears twice in one JSON object (the "
                                    "last would silently win); keep one")
        seen[key] = value
    return seen


def loads_strict(text: str) -> Any:
    """json.loads that refuses an object with a repeated key (DuplicateKeyError)."""
    return json.loads(text, object_pairs_hook=_refuse_duplicates)
