"""One party of a secure run: link up, compile, share, generate step by step, account.

Every party runs `run_party(config, party_id)` (usually through its entry point, party_main).
Sequence, identical on every host (lockstep):
  1. brpc link to every other party (mutual TLS when the config gives certificates), then
     every peer's identity is checked (its certificate must name its node id and host, see
     config.py) before anything is sent;
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
Nothing received from a peer is deserialized into objects (`wire`: typed, checked messages);
a malformed message ends the run naming its sender. From start-up on (blame.Watchdog): a
peer that does not come up within `link.connect_timeout_s` of this party starting its link,
fails the TLS handshake or presents another node's certificate, or (once up) is dead, hung
or unreachable for `link.peer_timeout_s`, ends this party with a message naming it; link
errors are explained by probing every peer (`blame`).
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import time

import numpy as np

from runtime.distributed import costs, job as job_lib, wire
from runtime.distributed.blame import Watchdog, explain_link_error, verify_peers
from runtime.distributed.bounds import check_job_bounds
from runtime.distributed.config import NodeConfig, NodeConfigError, is_loopback
from runtime.distributed.party_front import (FRONT_STEP, LINK_ID, FrontHandle, message_cap_bytes,
                                             start_front)
from runtime.distributed.process import (PRIVATE_DIR_ENV, PartyFailure, log, node_tag,
                                         own_private_dir)

LINGER_S = 1.0


# ----- the link (SPU's brpc link behind the front; errors name the failing peer) -------------

def link_desc(config: NodeConfig, party_id: str, link_id: str, recv_timeout_s: float,
              front: FrontHandle | None = None):
    """spu.link.Desc for this config.

    With this party's `front` (the default path, see front.py): brpc listens on a Unix socket
    in the party's private directory (`unix:PATH`, mode 0700: no TCP port of brpc's), behind
    the front; it connects to each peer's front (under TLS, or to remote peers in plain TCP,
    through the front's Unix socket for that peer in the same directory, which serves this
    process only, does the TLS and checks the peer's identity), so brpc itself never listens
    on TCP. Without a front (tests of the bare link only): every party at its public address,
    TLS options from the config.

    brpc keeps retrying the connection to a peer for connect_retry_times x
    connect_retry_interval_ms; raised here to outlast link.connect_timeout_s, so that the
    Watchdog (which names the peer) decides when a peer is late, not brpc."""
    from spu import link
    desc = link.Desc()
    desc.id = f"{config.id}.{link_id}"
    for pid, address in config.parties:
        if front is not None and pid == party_id:
            address = f"unix:{front.backend}"
        elif front is not None and pid in front.outbound:
            address = f"unix:{front.outbound[pid]}"
        desc.add_party(pid, address)
    opts = config.link
    desc.recv_timeout_ms = int(recv_timeout_s * 1000)
    interval_ms = opts.connect_retry_interval_ms
    # Each failed attempt also waits up to 12 s (yacl's cyclic 2-12 s HTTP timeout) when the
    # peer's port is open but silent; counting only the interval keeps this an upper bound.
    needed = math.ceil((opts.connect_timeout_s + 30) * 1000 / interval_ms)
    desc.connect_retry_times = max(opts.connect_retry_times, needed)
    desc.connect_retry_interval_ms = interval_ms
    desc.http_timeout_ms = opts.http_timeout_ms
    if opts.tls is not None and front is None:
        mine = opts.tls.certs[party_id]
        desc.enable_ssl = True
        # Both directions: servers verify clients and clients verify servers (mutual TLS, CA
        # only: brpc has no per-peer identity check; `probe` checks identities).
        for side in (desc.server_ssl_opts, desc.client_ssl_opts):
            side.cert.certificate_path = mine.cert
            side.cert.private_key_path = mine.key
            side.verify.ca_file_path = opts.tls.ca
            side.verify.verify_depth = opts.tls.verify_depth
    return desc


class Channel:
    """Byte messages between parties over the brpc link; errors name the failing peer."""

    def __init__(self, config: NodeConfig, party_id: str, ctx,
                 events_path: pathlib.Path | None = None):
        self.config, self.party_id, self.ctx = config, party_id, ctx
        self.rank = config.rank(party_id)
        self.events_path = events_path

    def _guard(self, stage: str, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as err:
            raise explain_link_error(self.config, self.party_id, stage, err,
                                     self.events_path) from None

    def send(self, peer: str, payload: bytes, stage: str) -> None:
        self._guard(stage, self.ctx.send, self.config.rank(peer), payload)

    def recv(self, peer: str, stage: str) -> bytes:
        return self._guard(stage, self.ctx.recv, self.config.rank(peer))

    def all_gather(self, payload: str, stage: str) -> list[str]:
        got = self._guard(stage, self.ctx.all_gather, payload)
        return [g.decode() if isinstance(g, bytes) else g for g in got]


def connect(config: NodeConfig, party_id: str, front: FrontHandle | None = None) -> Channel:
    """The brpc link to every peer, behind this party's `front` (blocks until all are
    connected; the Watchdog bounds the wait by link.connect_timeout_s)."""
    from spu import link
    try:
        ctx = link.create_brpc(link_desc(config, party_id, LINK_ID, config.link.recv_timeout_s,
                                         front), config.rank(party_id))
    except RuntimeError as err:
        raise explain_link_error(config, party_id, "link setup", err,
                                 front and front.events_path) from None
    return Channel(config, party_id, ctx, front and front.events_path)


# ----- the run ------------------------------------------------------------------------------

def setup_spu_log(path: pathlib.Path) -> None:
    """Route this process's SPU log (per-op profile, link totals) to `path`."""
    import spu.libspu as libspu
    opts = libspu.logging.LogOptions()
    opts.enable_console_logger = False
    opts.system_log_path = str(path)
    libspu.logging.setup_logging(opts)


def spu_log_path(output_dir: str | os.PathLike, party_id: str) -> pathlib.Path:
    return pathlib.Path(output_dir) / f"spu_{node_tag(party_id)}.log"


def write_atomically(path: pathlib.Path, write) -> None:
    """write(tmp_path), then rename over `path` (readers never see a partial file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def run_party(config: NodeConfig, party_id: str, output_dir: str | os.PathLike,
              prompt_file: str | None = None, front_program: str | None = None) -> dict | None:
    """Run this party's side of the job. Returns the summary record on the prompt owner (its
    per-step records go to `output_dir/results.jsonl`, tokens to `output_dir/outputs.npz`),
    None elsewhere. Raises PartyFailure naming the peer when another party fails.
    `front_program`: benchmarks only (party_front.start_front's `program`)."""
    from runtime.distributed.node_backend import NodeBackend, ProgramMismatch
    from runtime.mpc.backends import CLIENT
    from runtime.mpc.secure import SecureSession

    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = spu_log_path(out, party_id)
    setup_spu_log(log_path)
    is_model, is_client = party_id == config.model_owner, party_id == config.prompt_owner
    job = config.job
    if prompt_file is not None and not is_client:
        raise ValueError(f"--prompt_file is the prompt owner's ({config.prompt_owner}) input")
    if prompt_file is not None and job.prefill == "clear":
        raise ValueError("job.prefill=\"clear\" makes the prompt public (the model owner "
                         "prefills it in plaintext); a --prompt_file is private input: use "
                         "job.prompt_ids or the random prompt, or job.prefill=\"secure\"")
    # The front door first: a busy own port is an operator's error (AddressInUse, exit 2),
    # found before anything slow.
    # brpc's and the front's Unix sockets: in the directory the supervisor made (it removes
    # it after this process), else in one of this process's own.
    private_dir = os.environ.pop(PRIVATE_DIR_ENV, None) or own_private_dir(party_id)
    front = start_front(config, party_id, out, private_dir, program=front_program)
    # From the first second: TLS faults of any peer end this party at once; peers get
    # link.connect_timeout_s from begin_link() to come up (Watchdog).
    watchdog = Watchdog(config, party_id, events_path=front.events_path).start()
    warn_if_insecure(config, party_id)
    parent = os.getppid()
    model, policy = job_lib.build(job)
    t_start = time.perf_counter()
    # Private inputs first: a bad one fails here, before any peer waits on this party.
    params = job_lib.load_weights(job) if is_model else job_lib.weight_shapes(job)
    # A clear prefill's prompt is public: every party draws it (job_lib.load_prompt).
    prompt_ids, stop_ids = (job_lib.load_prompt(job, prompt_file)
                            if is_client or job.prefill == "clear" else (None, ()))

    watchdog.stage = "link setup"
    log(party_id, f"linking to {[p for p in config.party_ids if p != party_id]} "
                  f"(link.connect_timeout_s={config.link.connect_timeout_s:g} s)")
    watchdog.begin_link()
    chan = connect(config, party_id, front)
    verify_peers(config, party_id)   # nothing is sent before every peer proved who it is
    log(party_id, f"link up ({config.world_size} parties, "
                  f"{'TLS, peer identities checked' if config.link.tls else 'plain TCP'})")
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
        front.set_cap(message_cap_bytes(config, prompt_len=T))
        log(party_id, f"weights shared in {t_weights - t_start:.1f} s; prompt of {T} tokens")

        last = [front.stats()]

        def on_step(step, token):
            stage(f"{step.phase} at position {step.position}")
            now = front.stats()
            if now and last[0]:
                # What this party's front relayed during the step (one JSON line per step).
                log(party_id, FRONT_STEP + json.dumps({
                    "phase": step.phase, "position": step.position,
                    "frames": now["frames"] - last[0]["frames"],
                    "bytes": now["bytes"] - last[0]["bytes"],
                    "cpu_s": round(now["cpu_s"] - last[0]["cpu_s"], 4),
                    "max_message_so_far": now.get("max_message"),
                    "most_unread_so_far": now.get("most_unread")}))
            last[0] = now
            if is_client:
                log(party_id, f"token {token} ({step.phase}, {step.wall_s:.2f} s)")
        stage("compilation")
        result = session.generate(prompt_ids, job.max_new_tokens, prompt_len=T,
                                  stop_ids=stop_ids, on_step=on_step,
                                  reveal_logits=job.reveal_logits, prefill=job.prefill)
        stage("confirming success")
        # Results are reported only once every party has finished its side.
        if not all(backend.exchange("done", True)):
            raise PartyFailure(None, "a party did not confirm the end of the run")
    except wire.WireError as err:
        raise PartyFailure(err.party, f"{err} [during {watchdog.stage}]") from None
    except ProgramMismatch as err:
        raise PartyFailure(None, f"{err} [during {watchdog.stage}]") from None
    except RuntimeError as err:
        if isinstance(err, PartyFailure):
            raise
        raise explain_link_error(config, party_id, watchdog.stage, err,
                                 front.events_path) from None
    watchdog.stop()
    if os.getppid() != parent:
        # The supervisor (or launcher) that started this party is gone: nobody is left to
        # report success to, so nothing is written.
        raise PartyFailure(None, "this party's supervisor ended during the run; not writing "
                                 "results")
    record = None
    if is_client:
        records = costs.generation_records(
            result, backend="spu_nodes", policy=job.policy, budget=job.budget,
            model=job.model, num_layers=job.num_layers, protocol=config.protocol,
            parties=config.world_size, prompt_len=T, weights_s=round(t_weights - t_start, 3),
            node_config=config.id, tls=config.link.tls is not None, prefill=job.prefill,
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
    # then the caller exits the process (party_main uses exit_now).
    time.sleep(LINGER_S)
    return record


def check_prompt_length(config: NodeConfig, model, prompt_len) -> None:
    """Every party checks the announced (public) prompt length against the model, the job and
    the memory bound (bounds.check_job_bounds with the announced length)."""
    job = config.job
    if not isinstance(prompt_len, int) or isinstance(prompt_len, bool) or prompt_len < 1:
        raise PartyFailure(config.prompt_owner, f"party {config.prompt_owner} announced a "
                                                f"prompt length of {prompt_len!r}")
    if prompt_len + job.max_new_tokens > model.cfg.max_position:
        raise PartyFailure(config.prompt_owner, f"a prompt of {prompt_len} tokens + "
                           f"{job.max_new_tokens} new tokens exceeds the model's context of "
                           f"{model.cfg.max_position}")
    try:
        check_job_bounds(config, prompt_len=prompt_len)
    except NodeConfigError as err:
        raise PartyFailure(config.prompt_owner, f"party {config.prompt_owner} announced a "
                                                f"prompt of {prompt_len} tokens: {err}") from None


def warn_if_insecure(config: NodeConfig, party_id: str) -> None:
    """Print a warning when the config allows plain TCP to non-loopback peers."""
    remote = [pid for pid, address in config.parties
              if not is_loopback(address.rpartition(":")[0])]
    if config.link.tls is None and remote:
        log(party_id, f"warning: link.insecure=true: shares, tokens and results travel as plain "
                      f"TCP to {remote}, readable and forgeable on the network; add link.tls")
