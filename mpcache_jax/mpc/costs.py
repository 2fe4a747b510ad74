"""Cost accounting for secure runs: SPU profiling-log parsing, phase attribution, network model.

SPU 0.9.5 has no Python API for link statistics. With `enable_pphlo_profile` and
`enable_hal_profile` the runtime of party 0 logs, per run, one line per executed op kind,

    - pphlo.dot, executed 3 times, duration 0.01s, send bytes 160 recv bytes 160, send actions 3, recv actions 3

grouped in sections ("HLO profiling", "HAL profiling", "MPC profiling"), and a closing
`Link details: total send bytes B, recv bytes R, send actions S, recv actions A`.
`parse_profile_log` turns one run's lines into a `RunCost`. Messages are SPU's send actions of
party 0; SPU reports no round count, so a message is our proxy for one round trip (each party
sends to its neighbours once per round in ABY3 / SEMI2K).
"""
from __future__ import annotations

import dataclasses
import os
import re
import time

_OP_LINE = re.compile(
    r"- (?P<op>.+?), executed (?P<count>\d+) times, duration (?P<dur>[0-9.eE+-]+)s, "
    r"send bytes (?P<sb>\d+) recv bytes (?P<rb>\d+), send actions (?P<sa>\d+), "
    r"recv actions (?P<ra>\d+)")
_SECTION = re.compile(r"(?P<name>HLO|HAL|MPC) profiling: total time")
_LINK = re.compile(r"Link details: total send bytes (?P<sb>\d+), recv bytes (?P<rb>\d+), "
                   r"send actions (?P<sa>\d+), recv actions (?P<ra>\d+)")
_RUN = re.compile(r"\[Profiling\] SPU execution (?P<name>\S+) completed.*execution took "
                  r"(?P<dur>[0-9.eE+-]+)s")


@dataclasses.dataclass(frozen=True)
class OpCost:
    count: int
    seconds: float
    send_bytes: int
    recv_bytes: int
    send_actions: int
    recv_actions: int


@dataclasses.dataclass
class RunCost:
    """One SPU execution as seen by party 0. `ops[section][op] -> OpCost` with section in
    HLO (pphlo ops), HAL, MPC; link totals; `name` of the executable."""

    name: str = ""
    exec_s: float = 0.0
    ops: dict = dataclasses.field(default_factory=dict)
    send_bytes: int = 0
    recv_bytes: int = 0
    send_actions: int = 0
    recv_actions: int = 0

    @property
    def comm_bytes(self) -> int:
        """Bytes through party 0's links (sent + received)."""
        return self.send_bytes + self.recv_bytes

    def __add__(self, other: "RunCost") -> "RunCost":
        ops = {}
        for src in (self.ops, other.ops):
            for section, table in src.items():
                dst = ops.setdefault(section, {})
                for op, c in table.items():
                    d = dst.get(op)
                    dst[op] = c if d is None else OpCost(
                        d.count + c.count, d.seconds + c.seconds, d.send_bytes + c.send_bytes,
                        d.recv_bytes + c.recv_bytes, d.send_actions + c.send_actions,
                        d.recv_actions + c.recv_actions)
        return RunCost(self.name or other.name, self.exec_s + other.exec_s, ops,
                       self.send_bytes + other.send_bytes, self.recv_bytes + other.recv_bytes,
                       self.send_actions + other.send_actions,
                       self.recv_actions + other.recv_actions)


def read_last_profile(log_path: str | os.PathLike, offset: int = 0, timeout_s: float = 10.0
                      ) -> RunCost:
    """The last SPU run profiled in `log_path` after byte `offset`. spdlog writes from the
    runtime's thread, so wait (up to `timeout_s`) until the run's closing link line is there."""
    deadline = time.time() + timeout_s
    while True:
        text = ""
        if os.path.exists(log_path):
            with open(log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
        runs = parse_profile_log(text)
        if runs and "Link details" in text.split("[Profiling] SPU execution")[-1]:
            return runs[-1]
        if time.time() > deadline:
            raise RuntimeError(f"no SPU profile of the run in {log_path} (after byte {offset}): "
                               "was enable_pphlo_profile switched off?")
        time.sleep(0.05)


def parse_profile_log(text: str) -> list[RunCost]:
    """Every SPU execution profiled in `text` (a log written by party 0), in order."""
    runs: list[RunCost] = []
    current: RunCost | None = None
    section = None
    for line in text.splitlines():
        m = _RUN.search(line)
        if m:
            current = RunCost(name=m["name"], exec_s=float(m["dur"]))
            runs.append(current)
            section = None
            continue
        if current is None:
            continue
        m = _SECTION.search(line)
        if m:
            section = m["name"]
            current.ops.setdefault(section, {})
            continue
        m = _OP_LINE.search(line)
        if m and section:
            current.ops[section][m["op"]] = OpCost(
                int(m["count"]), float(m["dur"]), int(m["sb"]), int(m["rb"]), int(m["sa"]),
                int(m["ra"]))
            continue
        m = _LINK.search(line)
        if m:
            current.send_bytes, current.recv_bytes = int(m["sb"]), int(m["rb"])
            current.send_actions, current.recv_actions = int(m["sa"]), int(m["ra"])
    return runs


# ----- phases ----------------------------------------------------------------------------------
# SPU profiles per op kind, not per source location, so the breakdown is by op class. What each
# class holds in a decode step of this project's programs:
#   matmul        projections, MLP, q.K and p.V, cluster scoring and one-hot gathers
#   exp           attention softmax and the sigmoid inside SiLU (exact activations)
#   divide        the softmax normalisation;  reciprocal: the sigmoid of SiLU (exact)
#   rsqrt         RMSNorm / LayerNorm
#   tanh          GeLU (gelu_tanh)
#   compare       top-k (sorting network or pairwise rank), piecewise-polynomial activations
#   equal         one-hot conversion of secret indices (gathers)
#   reduce        row maxima (softmax), argmax, cluster bounds
# Semantic phases that op classes cannot separate are measured by differential runs in
# experiments/mpc_cost.py (selection + gather = policy step - oracle step; MLP activation alone).
PHASE_OF_OP = (
    ("matmul", ("pphlo.dot", "pphlo.dot_general", "pphlo.convolution")),
    ("exp", ("pphlo.exponential",)),
    ("divide", ("pphlo.divide",)),
    ("reciprocal", ("pphlo.reciprocal", "pphlo.logistic")),
    ("rsqrt", ("pphlo.rsqrt", "pphlo.sqrt")),
    ("tanh", ("pphlo.tanh", "pphlo.erf")),
    ("compare", ("pphlo.custom_call: mhlo.topk", "pphlo.sort", "pphlo.greater",
                 "pphlo.greater_equal", "pphlo.less", "pphlo.less_equal", "pphlo.select",
                 "pphlo.maximum", "pphlo.minimum")),
    ("equal", ("pphlo.equal", "pphlo.not_equal")),
    ("reduce", ("pphlo.reduce", "pphlo.reduce_window")),
)
_PHASE = {op: phase for phase, ops in PHASE_OF_OP for op in ops}
def phase_breakdown(run: RunCost) -> dict[str, dict[str, float]]:
    """{op class: {comm_bytes, messages, seconds}} from the HLO (pphlo) section of a run (party
    0's sent + received bytes, sent messages). Unlisted ops (multiply, add, ...) are `other`."""
    out: dict[str, dict[str, float]] = {}
    for op, c in run.ops.get("HLO", {}).items():
        phase = _PHASE.get(op, "other")
        d = out.setdefault(phase, {"comm_bytes": 0, "messages": 0, "seconds": 0.0})
        d["comm_bytes"] += c.send_bytes + c.recv_bytes
        d["messages"] += c.send_actions
        d["seconds"] += c.seconds
    return {k: {**v, "seconds": round(v["seconds"], 6)} for k, v in sorted(out.items())}


# ----- network model ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NetworkProfile:
    """Bandwidth in bytes/s and round-trip time in seconds."""

    name: str
    bandwidth: float
    rtt: float

    def latency(self, send_bytes: int, messages: int, compute_s: float = 0.0) -> float:
        """compute + bytes / bandwidth + messages x RTT (each message one sequential round)."""
        return compute_s + send_bytes / self.bandwidth + messages * self.rtt


# The paper's LAN (Rathee et al. 2020): 377 MB/s, 0.3 ms; a WAN profile as in PUMA/BumbleBee
# style evaluations: 40 MB/s, 80 ms RTT.
LAN = NetworkProfile("lan", 377e6, 0.3e-3)
WAN = NetworkProfile("wan", 40e6, 80e-3)


def cost_fields(run: RunCost, wall_s: float, parties: int) -> dict:
    """The cost part of a result record.

    comm_bytes: bytes sent by all parties, estimated as party 0's sent bytes x parties (SPU's
    simulator profiles party 0 only; ABY3/SEMI2K are symmetric up to a few percent);
    messages: party 0's send actions (round proxy); wall_s: measured simulation time (all
    parties share this machine's cores); compute_s: party 0's profiled execution time;
    lan/wan_latency_s: modelled network time, party 0's sent bytes / bandwidth + messages x
    RTT; lan/wan_total_s: network time + compute_s (compute measured in simulation, where the
    parties compete for the same cores, so it overstates a deployment's compute).
    """
    lan = LAN.latency(run.send_bytes, run.send_actions)
    wan = WAN.latency(run.send_bytes, run.send_actions)
    return {
        "comm_bytes": int(run.send_bytes * parties),
        "party0_send_bytes": int(run.send_bytes),
        "party0_recv_bytes": int(run.recv_bytes),
        "messages": int(run.send_actions),
        "wall_s": round(float(wall_s), 4),
        "compute_s": round(float(run.exec_s), 4),
        "lan_latency_s": round(lan, 5),
        "wan_latency_s": round(wan, 4),
        "lan_total_s": round(lan + run.exec_s, 4),
        "wan_total_s": round(wan + run.exec_s, 4),
        "phase_breakdown": phase_breakdown(run),
        "ops": {op: [c.send_bytes, c.send_actions, round(c.seconds, 5)]
                for op, c in run.ops.get("HLO", {}).items() if c.send_bytes or c.seconds > 1e-3},
    }
