"""One party of a secure run: link up, receive the program, share inputs, run, reveal, account.

Every party runs `run_party(config, party_id)` (usually via `python -m experiments.party`).
Sequence, identical on every host:
  1. brpc link to every other party (mutual TLS when the config gives certificates);
  2. the MODEL_OWNER compiles the job's program with SPU and sends the serialized executable
     to every party; all parties compare its SHA-256 (all run the same program);
  3. the MODEL_OWNER secret-shares the weights, the PROMPT_OWNER the prompt, one message per
     peer (weights never leave the model owner in the clear);
  4. every party runs the executable on its shares;
  5. output shares go to the PROMPT_OWNER only, who reconstructs the generated tokens;
  6. parties exchange their own profiled cost (from their own SPU log); the PROMPT_OWNER
     writes the aggregated record.
A peer that is dead, hung or unreachable ends this party within `link.peer_timeout_s` with a
message naming it (Watchdog); link errors are explained by probing every peer (`blame`).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
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

def run_party(config: NodeConfig, party_id: str, output_dir: str | os.PathLike) -> dict | None:
    """Run this party's side of the job. Returns the aggregated cost record on the prompt
    owner (also written to `output_dir/results.jsonl`, tokens in `output_dir/outputs.npz`),
    None elsewhere. Raises PartyFailure naming the peer when another party fails."""
    import spu
    from mpcache_jax.mpc.backends import SECRET, make_backend

    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = spu_log_path(out, party_id)
    setup_spu_log(log_path)
    rank, world = config.rank(party_id), config.world_size
    is_model, is_client = party_id == config.model_owner, party_id == config.prompt_owner
    job = config.job
    program = job_lib.build_program(job)
    t_start = time.perf_counter()

    # 2. program: compiled by the model owner (it holds the weights' shapes and values), before
    # the link is up so that peers wait in connection retries rather than in a receive.
    if is_model:
        params = job_lib.load_weights(job)
        backend = make_backend("spu_sim", config.mpc, profile=False)
        prompt_shape = np.zeros(job.seq_len, np.int32)
        compiled = backend.compile(program, (params, prompt_shape), (SECRET, SECRET))
        blob = compiled.executable.SerializeToString()
        log(party_id, f"compiled the program in {time.perf_counter() - t_start:.1f} s")

    if is_client:  # a bad private input fails here, before any peer waits on this party
        prompt = job_lib.load_prompt(job, program.model.cfg.vocab_size)

    chan = connect(config, party_id)
    watchdog = Watchdog(config, party_id).start()
    log(party_id, f"link up ({world} parties, {'TLS' if config.link.tls else 'plain TCP'})")
    watchdog.stage = "program distribution"
    if is_model:
        for peer in config.party_ids:
            if peer != party_id:
                chan.send(peer, blob, "sending the compiled program")
    else:
        blob = chan.recv(config.model_owner, "receiving the compiled program")
    digests = chan.all_gather(hashlib.sha256(blob).hexdigest(), "program check")
    if len(set(digests)) != 1:
        raise PartyFailure(None, "parties received different programs: "
                                 f"{[d[:12] for d in digests]}")
    executable = spu.Executable()
    executable.ParseFromString(blob)
    t_program = time.perf_counter()
    log(party_id, f"program {digests[0][:12]} ({len(blob)} bytes)")

    watchdog.stage = "input sharing"
    # 3. inputs: weights leaves (model owner) then the prompt (prompt owner).
    runtime_cfg = config.mpc.runtime_config(profile=True)
    io = spu.Io(world, runtime_cfg)
    runtime = spu.Runtime(chan.ctx, runtime_cfg)
    n_inputs = len(executable.input_names)
    owners = [config.model_owner] * (n_inputs - 1) + [config.prompt_owner]
    my_values = []
    if is_model:
        import jax
        my_values = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
        if len(my_values) != n_inputs - 1:
            raise PartyFailure(None, f"the program takes {n_inputs - 1} weight arrays, the model "
                                     f"owner has {len(my_values)}")
    if is_client:
        my_values = [prompt]
    my_names = [n for n, o in zip(executable.input_names, owners) if o == party_id]
    if my_values:
        per_peer = [[] for _ in range(world)]
        for value in my_values:
            shares = io.make_shares(value, spu.Visibility.VIS_SECRET, owner_rank=rank)
            for r in range(world):
                per_peer[r].append(shares[r])
        for peer in config.party_ids:
            if peer != party_id:
                chan.send(peer, pickle.dumps(per_peer[config.rank(peer)]), "sending input shares")
        for name, share in zip(my_names, per_peer[rank]):
            runtime.set_var(name, share)
    for owner in (config.model_owner, config.prompt_owner):
        if owner == party_id:
            continue
        shares = pickle.loads(chan.recv(owner, f"receiving {owner}'s input shares"))
        names = [n for n, o in zip(executable.input_names, owners) if o == owner]
        if len(shares) != len(names):
            raise PartyFailure(owner, f"party {owner} sent {len(shares)} input shares, the "
                                      f"program expects {len(names)}")
        for name, share in zip(names, shares):
            runtime.set_var(name, share)
    t_inputs = time.perf_counter()
    log(party_id, "inputs shared; running")

    # 4. the secure program.
    watchdog.stage = "the secure run"
    log_offset = log_path.stat().st_size if log_path.exists() else 0
    t0 = time.perf_counter()
    try:
        runtime.run(executable)
    except RuntimeError as err:
        raise explain_link_error(config, party_id, "the secure run", err) from None
    run_s = time.perf_counter() - t0
    log(party_id, f"secure run done in {run_s:.3f} s")

    # 5. reveal to the prompt owner only.
    watchdog.stage = "output reveal"
    my_out = [runtime.get_var(name) for name in executable.output_names]
    revealed = None
    if is_client:
        gathered = {party_id: my_out}
        for peer in config.party_ids:
            if peer != party_id:
                gathered[peer] = pickle.loads(chan.recv(peer, "receiving output shares"))
        revealed = [io.reconstruct([gathered[p][i] for p in config.party_ids])
                    for i in range(len(my_out))]
    else:
        chan.send(config.prompt_owner, pickle.dumps(my_out), "sending output shares")

    # 6. costs: each party's own profile, gathered everywhere, recorded by the prompt owner.
    mine = costs.party_cost(log_path, log_offset, party_id, rank, run_s, world,
                            setup_s={"link_and_program": t_program - t_start,
                                     "input_sharing": t_inputs - t_program})
    gathered_costs = [json.loads(b) for b in chan.all_gather(json.dumps(mine),
                                                             "exchanging costs")]
    record = None
    if is_client:
        tokens = np.asarray(revealed[0]).astype(np.int64)
        arrays = {"tokens": tokens}
        if job.reveal_logits:
            arrays["logits"] = np.asarray(revealed[1])
        np.savez(out / "outputs.npz", **arrays)
        record = costs.node_record(config, gathered_costs, tokens.tolist())
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        log(party_id, f"tokens {tokens.tolist()}; record appended to {out / 'results.jsonl'}")
    watchdog.stop()
    # No stop_link: its shutdown messages race with peers that have already left, and a
    # failed send makes yacl end the process. Linger so in-flight acknowledgements complete,
    # then the caller exits the process (experiments.party uses os._exit).
    time.sleep(LINGER_S)
    return record
