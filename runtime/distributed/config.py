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
share is sent (`party.verify_peers`), and again on every liveness probe (`party.probe`,
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
import math
import os
import pathlib
import re
from typing import Any

import jax

from mpcache_jax.policies import POLICY_NAMES, make_policy
from models import registry
from models.config import ConfigError
from models.model import Model
from models.registry import MODEL_NAMES
from runtime.distributed.certs import (CertificateError, check_key_and_ca,
                                       check_own_certificate, check_validity, read_certificate)
from runtime.mpc import config as mpc_config
from runtime.mpc.config import MPCConfig


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


# The longest timeout any link or job field may name: 7 days. The link takes milliseconds
# and retry counts as 32-bit integers (uint32 / brpc's int32 ms), which 7 days in ms fits.
MAX_TIMEOUT_S = 7 * 24 * 3600


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(obj, types: dict[str, tuple[str, Any]], where: str) -> None:
    """Each field of `obj` named in `types` must pass its check: {name: (what, predicate)}."""
    for name, (what, ok) in types.items():
        value = getattr(obj, name)
        if not ok(value):
            hint = " (write it without quotes)" if isinstance(value, str) else ""
            raise NodeConfigError(f"{where}.{name}={value!r} must be {what}{hint}")


@dataclasses.dataclass(frozen=True)
class ShapeSpec:
    """Traffic shaping by the parties' fronts: every frame a party receives is held for
    `delay_ms` (one-way delay) after it has passed a per-connection rate of `rate_mb_s`
    (10^6 bytes per second; None = no rate limit)."""

    delay_ms: float = 0.0
    rate_mb_s: float | None = None


# link.shape profiles: the paper's LAN (3016 mbit = 377 MB/s, 0.3 ms) and WAN (40 MB/s, 80 ms).
SHAPE_PROFILES = {"lan": ShapeSpec(0.3, 377.0), "wan": ShapeSpec(80.0, 40.0)}
MAX_SHAPE_DELAY_MS = 60_000.0


def parse_shape(shape: Any) -> ShapeSpec | None:
    """link.shape: null, "lan", "wan" or {"delay_ms": MS, "rate_mb_s": MB_PER_S | null}."""
    if shape is None or isinstance(shape, ShapeSpec):
        return shape
    if isinstance(shape, str):
        if shape not in SHAPE_PROFILES:
            raise NodeConfigError(f"link.shape={shape!r} is unknown; use \"lan\" (377 MB/s, "
                                  "0.3 ms), \"wan\" (40 MB/s, 80 ms) or {\"delay_ms\": MS, "
                                  "\"rate_mb_s\": MB_PER_S}")
        return SHAPE_PROFILES[shape]
    if not isinstance(shape, dict):
        raise NodeConfigError(f"link.shape={shape!r} must be \"lan\", \"wan\" or "
                              "{\"delay_ms\": MS, \"rate_mb_s\": MB_PER_S}")
    unknown = sorted(set(shape) - {"delay_ms", "rate_mb_s"})
    if unknown:
        raise NodeConfigError(f"link.shape has unknown key(s) {unknown}; keys: delay_ms, "
                              "rate_mb_s")
    delay, rate = shape.get("delay_ms", 0.0), shape.get("rate_mb_s")
    if not _is_number(delay) or not 0 <= delay <= MAX_SHAPE_DELAY_MS:
        raise NodeConfigError(f"link.shape.delay_ms={delay!r} must be a number of milliseconds "
                              f"from 0 to {MAX_SHAPE_DELAY_MS:g} (one-way delay)")
    if rate is not None and (not _is_number(rate) or not 0 < rate <= 1e6):
        raise NodeConfigError(f"link.shape.rate_mb_s={rate!r} must be a rate in MB/s above 0 "
                              "(at most 1e6), or null for no rate limit")
    return ShapeSpec(float(delay), None if rate is None else float(rate))


@dataclasses.dataclass(frozen=True)
class LinkOptions:
    """brpc link settings and failure detection.

    `connect_timeout_s` (<= 60 s by default): from the moment a party starts its link, every
    peer must come up (its endpoint answers, with the right certificate under TLS) within this
    long, else the party fails naming the peer that never came up. `peer_timeout_s`: every
    party probes its peers' link endpoints once a second; a peer seen up that then refuses or
    does not answer for this long (dead, hung, unreachable) makes the party fail naming it.
    `recv_timeout_s`: the link's own limit on waiting for one message from a peer that is
    alive; it must exceed the longest local step of any party (compilation, ~20 s for a
    30-layer model). `connect_retry_times` x `connect_retry_interval_ms`: brpc's own connect
    retries (raised, when shorter, to outlast connect_timeout_s, which decides).
    `insecure`: allow plain TCP to non-loopback hosts (prints a warning). `shape`: traffic
    shaping by the fronts (`parse_shape`: "lan", "wan" or {"delay_ms", "rate_mb_s"})."""

    peer_timeout_s: float = 30.0
    recv_timeout_s: float = 600.0
    connect_timeout_s: float = 60.0
    connect_retry_times: int = 10
    connect_retry_interval_ms: int = 1000
    http_timeout_ms: int = 20000
    insecure: bool = False
    shape: Any = None
    tls: TLSConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", parse_shape(self.shape))
        seconds = ("a number of seconds", _is_number)
        integer = ("an integer", _is_int)
        _check_types(self, {"peer_timeout_s": seconds, "recv_timeout_s": seconds,
                            "connect_timeout_s": seconds, "connect_retry_times": integer,
                            "connect_retry_interval_ms": integer, "http_timeout_ms": integer,
                            "insecure": ("true or false", lambda v: isinstance(v, bool))},
                     "link")
        for name in ("peer_timeout_s", "recv_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if value <= 0:
                raise NodeConfigError(f"link.{name}={value} must be > 0 seconds")
            if value > MAX_TIMEOUT_S:
                raise NodeConfigError(f"link.{name}={value:g} is beyond the longest timeout the "
                                      f"link accepts, {MAX_TIMEOUT_S} s (7 days: its "
                                      "milliseconds and retry counts are 32-bit); use at most "
                                      f"{MAX_TIMEOUT_S}")
        if self.connect_retry_times < 0 or self.connect_retry_interval_ms <= 0:
            raise NodeConfigError("link.connect_retry_times must be >= 0 and "
                                  "link.connect_retry_interval_ms > 0")
        for name in ("connect_retry_times", "connect_retry_interval_ms", "http_timeout_ms"):
            value = getattr(self, name)
            if value > MAX_TIMEOUT_S * 1000:
                raise NodeConfigError(f"link.{name}={value} is beyond the bound the link "
                                      f"accepts ({MAX_TIMEOUT_S * 1000}, 32-bit and 7 days in "
                                      f"ms); use at most {MAX_TIMEOUT_S * 1000}")
        if self.http_timeout_ms <= 0:
            raise NodeConfigError(f"link.http_timeout_ms={self.http_timeout_ms} must be > 0")
        if self.insecure and self.tls is not None:
            raise NodeConfigError('link.insecure=true and link.tls contradict each other: remove '
                                  '"insecure" to use TLS, or "tls" to run over plain TCP')


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """The public program every party agrees to run: secure generation of `max_new_tokens`
    greedy tokens after a `seq_len`-token prompt with `policy` on `model`.

    The prompt is the prompt owner's private input: a file given to its party only
    (`--prompt_file`, wrapped in the chat template when `chat`), else `prompt_ids`, else
    `seq_len` random ids drawn with `prompt_seed`; its length is public. `seed` draws random
    weights for random-weight models. `reveal_logits` also opens the logits of each generated
    token to the prompt owner (tests; leaks more than tokens). `memory_limit_gb`: the most one
    party may need by `estimate_party_memory` (default: 80% of this machine's memory divided
    among the parties that run on it). `prefill`: "secure" (the private run), or "clear" for
    decode-step benchmarks that neither keep the prompt private nor need a secure prefill's
    memory: the prompt is public (`prompt_ids` or the random one; a prompt file is refused),
    the model owner prefills it in plaintext and secret-shares the cache, and the decode steps
    run securely as always (their cost does not depend on the values).
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
    memory_limit_gb: float | None = None
    prefill: str = "secure"

    def __post_init__(self):
        integer = ("an integer", _is_int)
        optional = lambda ok: (lambda v: v is None or ok(v))  # noqa: E731
        _check_types(self, {
            "model": ("a string", lambda v: isinstance(v, str)),
            "policy": ("a string", lambda v: isinstance(v, str)),
            "budget": ("a number or null", optional(_is_number)),
            "policy_options": ("an object", lambda v: isinstance(v, dict)),
            "seq_len": integer, "max_new_tokens": integer,
            "num_layers": ("an integer or null", optional(_is_int)),
            "seed": integer, "prompt_seed": integer,
            "chat": ("true or false", lambda v: isinstance(v, bool)),
            "reveal_logits": ("true or false", lambda v: isinstance(v, bool)),
            "timeout_s": ("a number of seconds", _is_number),
            "memory_limit_gb": ("a number of GB or null", optional(_is_number)),
            "prefill": ("a string", lambda v: isinstance(v, str)),
        }, "job")
        from runtime.mpc.secure import PREFILL_MODES
        if self.prefill not in PREFILL_MODES:
            raise NodeConfigError(f"job.prefill={self.prefill!r} is unknown; use \"secure\" "
                                  "(private) or \"clear\" (decode benchmarks, public prompt)")
        if self.prompt_ids is not None:
            if not isinstance(self.prompt_ids, (list, tuple)):
                raise NodeConfigError(f"job.prompt_ids must be a list of integer token ids, got "
                                      f"{self.prompt_ids!r}; e.g. [1, 2, 3]")
            bad = [t for t in self.prompt_ids if not _is_int(t)]
            if bad:
                raise NodeConfigError(f"job.prompt_ids must be a list of integer token ids, got "
                                      f"{bad[0]!r} in it; write ids as JSON numbers, e.g. "
                                      "[1, 2, 3]")
            object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
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
        if self.timeout_s > MAX_TIMEOUT_S:
            raise NodeConfigError(f"job.timeout_s={self.timeout_s:g} is beyond {MAX_TIMEOUT_S} s "
                                  "(7 days); use at most that")
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise NodeConfigError(f"job.memory_limit_gb={self.memory_limit_gb} must be > 0")


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


def node_tag(party_id: str) -> str:
    """The node id as it appears in file names (party_<tag>.log, spu_<tag>.log)."""
    return party_id.replace(":", "_")


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
    if not _is_int(depth) or depth < 1:
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


# ----- job bounds ------------------------------------------------------------------------------

# Bytes of one field element, and field elements one party holds per secret value.
FIELD_BYTES = {"FM32": 4, "FM64": 8, "FM128": 16}
SHARES_PER_PARTY = {"ABY3": 2, "SEMI2K": 1, "CHEETAH": 1}
# Python + JAX + SPU + compiled programs of one party process, before any data.
RUNTIME_BASE_BYTES = 1 << 30
# Temporaries of the largest prefill operation, in multiples of its output.
TEMPORARY_FACTOR = 4


def estimate_party_memory(job: JobSpec, mpc: MPCConfig, prompt_len: int | None = None
                          ) -> tuple[int, str]:
    """Peak memory one party needs for `job`, estimated -> (bytes, the formula with numbers).

        bytes = 1 GiB + b * (P + 2*T*V + 2*L*Hkv*d*(T+N) + 4*max(H*T*(T+N), T*F))
        job.prefill="clear": 1 GiB + b * (P + 2*L*Hkv*d*(T+N) + 4*max(H*(T+N), F))
                             + 4 B * (P + T*V + 4*max(H*T*(T+N), T*F))

    b: bytes of one party's share of one element (field bytes x shares per party: ABY3 2,
    SEMI2K/CHEETAH 1); P: weights (secret-shared once, resident all session); T*V: the
    prompt's secret one-hot rows [T, V] (x2: the prompt owner also holds the shares it sends);
    2*L*Hkv*d*(T+N): the KV cache of L layers (resident between steps); H*T*(T+N): one layer's
    prefill attention scores, T*F its MLP activations, x4 for an operation's temporaries;
    1 GiB: the Python/JAX/SPU process. T = seq_len (or the announced prompt length), N =
    max_new_tokens. With a clear prefill the secure part is the decode step (one query row)
    and the prefill runs in float32 plaintext (the last term). An order-of-magnitude bound
    meant to refuse impossible jobs before they start, not a measurement."""
    cfg = registry.get_config(job.model, num_layers=job.num_layers)
    params = sum(int(math.prod(leaf.shape))
                 for leaf in jax.tree_util.tree_leaves(Model(cfg).param_shapes()))
    T = job.seq_len if prompt_len is None else prompt_len
    N = job.max_new_tokens
    b = FIELD_BYTES.get(mpc.field, 8) * SHARES_PER_PARTY.get(mpc.protocol, 2)
    cache = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (T + N)
    prefill_largest = max(cfg.num_heads * T * (T + N), T * cfg.intermediate_size)
    if job.prefill == "clear":
        largest = max(cfg.num_heads * (T + N), cfg.intermediate_size)
        clear = params + T * cfg.vocab_size + TEMPORARY_FACTOR * prefill_largest
        total = RUNTIME_BASE_BYTES + b * (params + cache + TEMPORARY_FACTOR * largest) + 4 * clear
        return total, (f"1 GiB + {b} B x (P {params:,} + KV cache {cache:,} + 4 x {largest:,}) "
                       f"+ 4 B x (clear prefill {clear:,}) with T={T}, N={N}")
    elements = params + 2 * T * cfg.vocab_size + cache + TEMPORARY_FACTOR * prefill_largest
    total = RUNTIME_BASE_BYTES + b * elements
    formula = (f"1 GiB + {b} B x (P {params:,} + 2*T*V {2 * T * cfg.vocab_size:,} + KV cache "
               f"{cache:,} + 4 x {prefill_largest:,}) with T={T}, N={N}")
    return total, formula


def memory_limit_bytes(config: NodeConfig) -> tuple[int, str]:
    """(the most one party may need, where the limit comes from)."""
    if config.job.memory_limit_gb is not None:
        return int(config.job.memory_limit_gb * 2**30), "job.memory_limit_gb"
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 16 << 30
    n = config.parties_on_this_host
    return int(0.8 * physical / n), (f"80% of this machine's {physical / 2**30:.1f} GiB shared "
                                     f"by {n} part{'y' if n == 1 else 'ies'}")


def frozen(value):
    """JSON lists -> tuples, so policy options stay hashable (policies are static jit args)."""
    return tuple(frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


_JOB_BUDGET = object()


def make_job_policy(job: JobSpec, budget: Any = _JOB_BUDGET):
    """The job's configured policy (with `budget` in place of job.budget when given)."""
    options = {k: frozen(v) for k, v in job.policy_options.items()}
    return make_policy(job.policy, job.budget if budget is _JOB_BUDGET else budget, **options)


def _serves(job: JobSpec, budget, prompt_len: int) -> bool:
    try:
        policy = make_job_policy(job, budget)
        check = getattr(policy, "check_prompt", None)
        if check is not None:
            check(prompt_len)
    except (TypeError, ValueError, LookupError, AttributeError):
        return False
    return True


def budget_text(budget) -> str:
    return f"{budget:g}" if isinstance(budget, float) else str(budget)


def ratio_for(tokens: int, prompt_len: int) -> float:
    """The shortest (then smallest) decimal ratio of the prompt that budgets exactly `tokens`
    of a `prompt_len`-token prompt (`primitives.budget_tokens`)."""
    from mpcache_jax.primitives import budget_tokens
    for digits in range(1, 16):
        step = 10.0 ** -digits
        value = round((math.floor((tokens - 1) / prompt_len / step) + 1) * step, digits)
        if 0 < value <= 1 and budget_tokens(value, prompt_len) == tokens:
            return value
    return tokens / prompt_len


def smallest_budget(job: JobSpec, prompt_len: int, ratio: bool) -> tuple[Any, int] | None:
    """The smallest budget with which the job's policy serves a `prompt_len`-token prompt (its
    own check_prompt) -> (budget, tokens it keeps), or None when even the whole prompt does
    not. `ratio`: as a ratio of the prompt (`ratio_for`), else a token count. A binary search
    over the token count: a policy that serves a budget serves every larger one (the
    registry's policies all do; tests/test_node_job.py checks it against a scan)."""
    def value(k: int):
        return ratio_for(k, prompt_len) if ratio else k

    if not _serves(job, value(prompt_len), prompt_len):
        return None
    low, high = 1, prompt_len          # invariant: value(high) serves
    while low < high:
        mid = (low + high) // 2
        if _serves(job, value(mid), prompt_len):
            high = mid
        else:
            low = mid + 1
    return value(high), high


def check_policy_serves(job: JobSpec, prompt_len: int) -> None:
    """The job's policy must build with its budget and options and serve a `prompt_len`-token
    prompt (its check_prompt, the check the parties' programs run); the error names the
    smallest budget that would."""
    try:
        policy = make_job_policy(job)
    except (TypeError, ValueError, LookupError, AttributeError) as err:
        raise NodeConfigError(f"job.policy={job.policy!r} with job.budget={job.budget!r} and "
                              f"job.policy_options={job.policy_options}: {err}") from None
    check = getattr(policy, "check_prompt", None)
    if check is None:
        return
    try:
        check(prompt_len)
    except ValueError as err:
        ratio = job.budget is None or isinstance(job.budget, float)
        fit = smallest_budget(job, prompt_len, ratio)
        given = (f"job.budget={budget_text(job.budget)}" if job.budget is not None else
                 f"job.budget (unset: {job.policy}'s default {getattr(policy, 'budget', None)})")
        options = f" and job.policy_options={job.policy_options}" if job.policy_options else ""
        if fit is None:
            raise NodeConfigError(
                f"{given}: {err}; no budget lets job.policy={job.policy!r}{options} serve "
                f"the job's prompt (job.seq_len={prompt_len}): use a longer prompt or another "
                "policy") from None
        count = (f"; or job.budget={fit[1]}, a token count" if isinstance(fit[0], float)
                 and fit[1] > 1 else "")
        raise NodeConfigError(
            f"{given}: {err}; the smallest budget that serves the job's {prompt_len}-token "
            f"prompt is job.budget={budget_text(fit[0])} ({fit[1]} tokens{count})") from None


def check_job_bounds(config: NodeConfig, prompt_len: int | None = None) -> None:
    """The job must fit the model (prompt + new tokens <= the model's context), its policy must
    build and serve the prompt's length (`check_policy_serves`: the policy's own check_prompt,
    as the parties' programs run it), and one party's estimated memory must stay under the
    limit (`memory_limit_bytes`). The prompt's length: `prompt_len` when announced, else
    job.seq_len."""
    job = config.job
    try:
        cfg = registry.get_config(job.model, num_layers=job.num_layers)
    except ConfigError as err:
        raise NodeConfigError(f"job.num_layers: {err}") from None
    T = job.seq_len if prompt_len is None else prompt_len
    if T + job.max_new_tokens > cfg.max_position:
        raise NodeConfigError(
            f"job.seq_len={T} + job.max_new_tokens={job.max_new_tokens} = "
            f"{T + job.max_new_tokens} exceeds {job.model}'s context of {cfg.max_position} "
            f"tokens; make them add up to at most {cfg.max_position}")
    check_policy_serves(job, T)
    need, formula = estimate_party_memory(job, config.mpc, prompt_len)
    limit, source = memory_limit_bytes(config)
    if need > limit:
        raise NodeConfigError(
            f"the job needs about {need / 2**30:.1f} GiB per party ({formula}), over the limit "
            f"of {limit / 2**30:.1f} GiB ({source}); shorten job.seq_len / job.max_new_tokens, "
            "use fewer job.num_layers, or raise job.memory_limit_gb if the machine has the memory")


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
