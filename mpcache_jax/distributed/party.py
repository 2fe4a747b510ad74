"""One party of a secure run: link up, compile, share, generate step by step, account.

Every party runs `run_party(config, party_id)` (usually via `python -m experiments.party`).
Sequence, identical on every host (lockstep):
  1. brpc link to every other party (mutual TLS when the config gives certificates);
  2. every party compiles the job's prefill and decode-step programs itself from the public
     job and the parties compare their SHA-256 (a party never runs a program it did not
     compile; `NodeBackend.compile` also refuses a program that reveals a secret mid-way);
  3. the MODEL_OWNER secret-shares the weights once, one typed message per peer and weight;
  4. the PROMPT_OWNER announces the prompt length (public) and shares its prompt; prefill
     (with the policy's static eviction) runs, then one decode program per new token: the KV
     cache stays secret-shared in every party's runtime between steps, each sampled token is
     revealed to the prompt owner only (who streams it and feeds it back as a secret one-hot)
     and the prompt owner decides, publicly, when to stop;
  5. every step's profiled cost is exchanged (public); after every party confirmed success,
     the PROMPT_OWNER writes results.jsonl and outputs.npz (atomically).
Nothing received from a peer is deserialized into objects (`wire`: typed, checked messages).
A peer that is dead, hung or unreachable ends this party within `link.peer_timeout_s` with a
message naming it (Watchdog); link errors are explained by probing every peer (`blame`).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import time

import numpy as np

from mpcache_jax.distributed.config import NodeConfig
from mpcache_jax.distributed import costs, job as job_lib

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG, EXIT_PEER = 0, 1, 2, 3
LINGER_S = 1.0


class PartyFailure(RuntimeError):
    """Another party died, hung, could not be reached or misbehaved; `party` names it."""

    def __init__(self, party: str | None, message: str):
        super().__init__(message)
        self.party = party


def log(party_id: str, message: str) -> None:
    print(f"[party {party_id}] {message}", file=sys.stderr, flush=True)


# ----- link ---------------------------------------------------------------------------------

def link_desc(config: NodeConfig, party_id: str, link_id: str, recv_timeout_s: float):
    # link_id names the link (brpc message keys); one link per run.
    """spu.link.Desc for this config; TLS options from the config (own cert, shared CA)."""
    from spu import link
    desc = link.Desc()
    desc.id = f"{config.id}.{link_id}"
    for pid, address in config.parties:
        desc.add_party(pid, address)
    opts = config.link
    desc.recv_timeout_ms = int(recv_timeout_s * 1000)
    desc.connect_retry_times = opts.connect_retry_times
    desc.connect_retry_interval_ms = opts.connect_retry_interval_ms
    desc.http_timeout_ms = opts.http_timeout_ms
    if opts.tls is not None:
        mine = opts.tls.certs[party_id]
        desc.enable_ssl = True
        # Both directions: servers verify clients and clients verify servers (mutual TLS).
        for side in (desc.server_ssl_opts, desc.client_ssl_opts):
            side.cert.certificate_path = mine.cert
            side.cert.private_key_path = mine.key
            side.verify.ca_file_path = opts.tls.ca
            side.verify.verify_depth = opts.tls.verify_depth
    return desc


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


def probe(config: NodeConfig, party_id: str, peer: str, timeout_s: float = 2.0) -> str:
    """'alive', 'refused' or 'silent': does `peer`'s link endpoint answer an HTTP request?

    Any answer (even brpc's "method not found") proves the peer's process is running; a
    refused connection means it is gone; silence means it is stopped or cut off."""
    import socket
    import ssl
    host, _, port = config.address(peer).rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"
    try:
        tls = config.link.tls
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.load_verify_locations(tls.ca)
            mine = tls.certs[party_id]
            ctx.load_cert_chain(mine.cert, mine.key)
            sock = ctx.wrap_socket(sock)
        sock.sendall(f"GET /probe HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        return "alive" if sock.recv(16) else "refused"
    except (ConnectionError, ssl.SSLError):
        return "refused"
    except OSError:
        return "silent"
    finally:
        sock.close()


def probe_peers(config: NodeConfig, party_id: str) -> dict[str, str]:
    """Probe every other party at once -> {party: 'alive' | 'refused' | 'silent'}."""
    from concurrent.futures import ThreadPoolExecutor
    peers = [p for p in config.party_ids if p != party_id]
    with ThreadPoolExecutor(len(peers)) as pool:
        return dict(zip(peers, pool.map(lambda p: probe(config, party_id, p), peers)))


def blame(config: NodeConfig, party_id: str, suspect: str | None) -> tuple[str | None, str]:
    """The failed party and why, from the peer a link error points at and a probe of all
    peers: a peer that is gone or silent is the cause even when the error points elsewhere
    (a live peer that stopped sending was itself waiting on the failed one)."""
    states = probe_peers(config, party_id)
    down = [p for p in config.party_ids if states.get(p) in ("refused", "silent")]
    summary = ", ".join(f"{p} {s}" for p, s in states.items())
    if down:
        words = {"refused": "is down (its link endpoint refuses connections)",
                 "silent": "does not respond (hung, stopped or cut off)"}
        culprit = suspect if suspect in down else down[0]
        return culprit, f"party {culprit} {words[states[culprit]]} [probe: {summary}]"
    if suspect is None:
        return None, f"every peer answers a probe [{summary}]"
    return suspect, (f"party {suspect} sent nothing for link.recv_timeout_s="
                     f"{config.link.recv_timeout_s:g} s or dropped the connection, yet its "
                     f"endpoint answers [probe: {summary}]")


def explain_link_error(config: NodeConfig, party_id: str, stage: str,
                       err: BaseException) -> PartyFailure:
    peer = failing_peer(config, config.rank(party_id), err)
    first = str(err).strip().splitlines()
    detail = " ".join(line.strip() for line in first[:2])[:300]
    culprit, why = blame(config, party_id, peer)
    if stage == "link setup" and culprit is not None and culprit == peer and "answers" in why:
        why = (f"party {peer} could not be reached at {config.address(peer)} within "
               f"link.recv_timeout_s={config.link.recv_timeout_s:g} s: is it running, is "
               "the port open, do the TLS certificates match?")
    return PartyFailure(culprit, f"{why} [during {stage}; {detail}]")


class Channel:
    """Byte messages between parties over the brpc link; errors name the failing peer."""

    def __init__(self, config: NodeConfig, party_id: str, ctx):
        self.config, self.party_id, self.ctx = config, party_id, ctx
        self.rank = config.rank(party_id)

    def _guard(self, stage: str, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as err:
            raise explain_link_error(self.config, self.party_id, stage, err) from None

    def send(self, peer: str, payload: bytes, stage: str) -> None:
        self._guard(stage, self.ctx.send, self.config.rank(peer), payload)

    def recv(self, peer: str, stage: str) -> bytes:
        return self._guard(stage, self.ctx.recv, self.config.rank(peer))

    def all_gather(self, payload: str, stage: str) -> list[str]:
        got = self._guard(stage, self.ctx.all_gather, payload)
        return [g.decode() if isinstance(g, bytes) else g for g in got]


def connect(config: NodeConfig, party_id: str) -> Channel:
    from spu import link
    try:
        ctx = link.create_brpc(link_desc(config, party_id, "run", config.link.recv_timeout_s),
                               config.rank(party_id))
    except RuntimeError as err:
        raise explain_link_error(config, party_id, "link setup", err) from None
    return Channel(config, party_id, ctx)


class Watchdog:
    """Probes every peer once a second from a daemon thread; a peer that stays down (refused
    or silent) for `link.peer_timeout_s` ends this party at once with a message naming it.

    The link alone cannot tell who failed: in a ring protocol every live party is blocked on
    a neighbour, so the first receive timeout often points at a live peer that is itself
    waiting on the dead one. A probe answered by a blocked-but-alive peer clears it."""

    def __init__(self, config: NodeConfig, party_id: str, interval_s: float = 1.0):
        import threading
        self.config, self.party_id, self.interval_s = config, party_id, interval_s
        self.stage = "start-up"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        down_since: dict[str, float] = {}
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            states = probe_peers(self.config, self.party_id)
            for peer, state in states.items():
                if state == "alive":
                    down_since.pop(peer, None)
                    continue
                down_since.setdefault(peer, now)
                if now - down_since[peer] >= self.config.link.peer_timeout_s and not self._stop.is_set():
                    words = {"refused": "is down (its link endpoint refuses connections)",
                             "silent": "does not respond (hung, stopped or cut off)"}[state]
                    summary = ", ".join(f"{p} {s}" for p, s in states.items())
                    print(f"[party {self.party_id}] error: party {peer} {words} for "
                          f"{self.config.link.peer_timeout_s:g} s [probe: {summary}; during "
                          f"{self.stage}]", file=sys.stderr, flush=True)
                    os._exit(EXIT_PEER)  # the link threads may be blocked: leave at once


# ----- logging / profile --------------------------------------------------------------------

def setup_spu_log(path: pathlib.Path) -> None:
    """Route this process's SPU log (per-op profile, link totals) to `path`."""
    import spu.libspu as libspu
    opts = libspu.logging.LogOptions()
    opts.enable_console_logger = False
    opts.system_log_path = str(path)
    libspu.logging.setup_logging(opts)


def spu_log_path(output_dir: str | os.PathLike, party_id: str) -> pathlib.Path:
    return pathlib.Path(output_dir) / f"spu_{party_id.replace(':', '_')}.log"


# ----- the run ------------------------------------------------------------------------------

def write_atomically(path: pathlib.Path, write) -> None:
    """write(tmp_path), then rename over `path` (readers never see a partial file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def run_party(config: NodeConfig, party_id: str, output_dir: str | os.PathLike,
              prompt_file: str | None = None) -> dict | None:
    """Run this party's side of the job. Returns the summary record on the prompt owner (its
    per-step records go to `output_dir/results.jsonl`, tokens to `output_dir/outputs.npz`),
    None elsewhere. Raises PartyFailure naming the peer when another party fails."""
    from mpcache_jax.distributed.node_backend import NodeBackend
    from mpcache_jax.mpc.backends import CLIENT
    from mpcache_jax.mpc.secure import SecureSession

    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = spu_log_path(out, party_id)
    setup_spu_log(log_path)
    is_model, is_client = party_id == config.model_owner, party_id == config.prompt_owner
    job = config.job
    if prompt_file is not None and not is_client:
        raise ValueError(f"--prompt_file is the prompt owner's ({config.prompt_owner}) input")
    model, policy = job_lib.build(job)
    t_start = time.perf_counter()
    # Private inputs first: a bad one fails here, before any peer waits on this party.
    params = job_lib.load_weights(job) if is_model else job_lib.weight_shapes(job)
    prompt_ids, stop_ids = job_lib.load_prompt(job, prompt_file) if is_client else (None, ())

    chan = connect(config, party_id)
    watchdog = Watchdog(config, party_id).start()
    log(party_id, f"link up ({config.world_size} parties, "
                  f"{'TLS' if config.link.tls else 'plain TCP'})")
    backend = NodeBackend(config, party_id, chan, log_path)

    def stage(name):
        watchdog.stage = backend.stage = name
    try:
        stage("weight sharing")
        session = SecureSession(backend, model, params, policy)
        t_weights = time.perf_counter()
        stage("prompt length")
        T = backend.agree(len(prompt_ids) if is_client else None, owner=CLIENT)
        check_prompt_length(config, model, T)
        log(party_id, f"weights shared in {t_weights - t_start:.1f} s; prompt of {T} tokens")

        def on_step(step, token):
            stage(f"{step.phase} at position {step.position}")
            if is_client:
                log(party_id, f"token {token} ({step.phase}, {step.wall_s:.2f} s)")
        stage("compilation")
        result = session.generate(prompt_ids, job.max_new_tokens, prompt_len=T,
                                  stop_ids=stop_ids, on_step=on_step,
                                  reveal_logits=job.reveal_logits)
        stage("confirming success")
        # Results are reported only once every party has finished its side.
        if not all(backend.exchange("done", True)):
            raise PartyFailure(None, "a party did not confirm the end of the run")
    except RuntimeError as err:
        if isinstance(err, PartyFailure):
            raise
        raise explain_link_error(config, party_id, watchdog.stage, err) from None
    watchdog.stop()
    record = None
    if is_client:
        records = costs.generation_records(
            result, backend="spu_nodes", job=job, protocol=config.protocol,
            parties=config.world_size, prompt_len=T, weights_s=round(t_weights - t_start, 3),
            node_config=config.id, tls=config.link.tls is not None,
            runtime_config=config.mpc.runtime_json())
        record = records[-1]
        arrays = {"tokens": np.asarray(result.tokens, np.int64)}
        if result.logits is not None:
            arrays["logits"] = np.stack(result.logits)
        write_atomically(out / "outputs.npz", lambda p: np.savez(open(p, "wb"), **arrays))
        results = out / "results.jsonl"
        earlier = results.read_text() if results.exists() else ""
        write_atomically(results, lambda p: p.write_text(
            earlier + "".join(json.dumps(r) + "\n" for r in records)))
        log(party_id, f"tokens {result.tokens}; {len(records)} records in {results}")
    # No stop_link: its shutdown messages race with peers that have already left, and a
    # failed send makes yacl end the process. Linger so in-flight acknowledgements complete,
    # then the caller exits the process (experiments.party uses os._exit).
    time.sleep(LINGER_S)
    return record


def check_prompt_length(config: NodeConfig, model, prompt_len) -> None:
    """Every party checks the announced (public) prompt length against the model and the job."""
    job = config.job
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise PartyFailure(config.prompt_owner, f"party {config.prompt_owner} announced a "
                                                f"prompt length of {prompt_len!r}")
    if prompt_len + job.max_new_tokens > model.cfg.max_position:
        raise PartyFailure(config.prompt_owner, f"a prompt of {prompt_len} tokens + "
                           f"{job.max_new_tokens} new tokens exceeds the model's context of "
                           f"{model.cfg.max_position}")
