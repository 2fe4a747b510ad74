"""A run's cost as a result record: op classes (phases), the network model (LAN / WAN) and
`cost_fields`, the record schema both backends write. What a run cost comes from every party's
SPU profile (`runtime.mpc.profile_log`: parsing, RunCost, combine_parties); what is measured
and what is modelled is listed in `cost_fields`.
"""
from __future__ import annotations

import dataclasses

from runtime.mpc.profile_log import CostAccountingError, RunCost


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
# experiments/cost/decode.py (selection + gather = policy step - oracle step; MLP activation alone).
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
    """{op class: {comm_bytes, messages, seconds}} from the HLO (pphlo) section of a run, with
    the run's definitions (`cost_fields`): comm_bytes = bytes sent, summed over the parties (the
    classes add up to the run's comm_bytes); messages = send actions summed over the parties /
    parties; seconds = the slowest party's time in the class's ops. Unlisted ops (multiply,
    add, ...) are `other`."""
    parties = len(run.party_runs)
    out: dict[str, dict[str, float]] = {}
    for op, c in run.ops.get("HLO", {}).items():
        phase = _PHASE.get(op, "other")
        d = out.setdefault(phase, {"comm_bytes": 0, "messages": 0, "seconds": 0.0})
        d["comm_bytes"] += c.send_bytes
        d["messages"] += c.send_actions
        d["seconds"] += c.seconds
    return {k: {**v, "messages": round(v["messages"] / parties, 2),
                "seconds": round(v["seconds"], 6)} for k, v in sorted(out.items())}


# ----- network model ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NetworkProfile:
    """Bandwidth in bytes/s and round-trip time in seconds."""

    name: str
    bandwidth: float
    rtt: float

    def latency(self, send_bytes: float, messages: float, compute_s: float = 0.0) -> float:
        """compute + bytes / bandwidth + messages x RTT (each message one sequential round)."""
        return compute_s + send_bytes / self.bandwidth + messages * self.rtt


# The paper's LAN (Rathee et al. 2020): 377 MB/s, 0.3 ms; a WAN profile as in PUMA/BumbleBee
# style evaluations: 40 MB/s, 80 ms RTT.
LAN = NetworkProfile("lan", 377e6, 0.3e-3)
WAN = NetworkProfile("wan", 40e6, 80e-3)


def cost_fields(run: RunCost, wall_s: float, parties: int | None = None) -> dict:
    """The cost part of a result record, from a whole run's RunCost (every party's profile:
    `combine_parties`; both backends). `parties`, when given, must be the number of party
    profiles in `run` (there is no estimate from fewer).

    Measured (SPU's link counters and op timers, every party):
      comm_bytes       bytes sent, summed over all parties (checked = bytes received);
      party_send_bytes / party_recv_bytes / party_send_actions / party_compute_s
                       each party's own, by rank (party_compute_s = its execution time);
      party_cpu_s      each party process's CPU time for the program (user + system, all its
                       threads: multi-process runs only; in the simulator the parties share
                       one process). party_compute_s there is SPU's timer, network waits included;
      party_attribution how surely the simulator's shared log was split per party (the
                       per-party fields only; every sum above and below is exact regardless);
      messages         send actions summed over the parties / parties, rounded up: the mean
                       party's sends, our round proxy (SPU reports no rounds). For symmetric
                       protocols every party sends the same number, i.e. the former party-0
                       count; unlike one party's count (or the max) it does not depend on the
                       roles SPU draws at random for asymmetric ABY3 kernels;
      compute_s        the slowest party's execution time (in the simulator all parties share
                       this machine's cores, so it overstates a deployment's compute);
      wall_s           the measured time of the run (simulator: all parties; multi-process:
                       the slowest party);
      phase_breakdown, ops   the pphlo ops summed over the parties (`phase_breakdown`; ops:
                       op -> [bytes sent, send actions summed over parties, slowest party's s]).
    Modelled (network time, from the counts above; NetworkProfile LAN / WAN):
      lan/wan_latency_s = comm_bytes / parties / bandwidth + messages x RTT: every party sends
                       over its own link in parallel with the load spread evenly (a lower bound
                       when one party sends more: see party_send_bytes), and each message is one
                       sequential round trip;
      lan/wan_total_s  = that + compute_s.
    """
    per = run.party_runs
    n = len(per)
    if parties is not None and parties != n:
        raise CostAccountingError(
            f"{run.name}: cost_fields needs every party's profile ({parties}), got {n}; "
            "combine the parties' RunCosts with combine_parties")
    sent, recv = sum(p.send_bytes for p in per), sum(p.recv_bytes for p in per)
    if sent != recv:
        raise CostAccountingError(f"{run.name}: the parties sent {sent} bytes but received "
                                  f"{recv}")
    messages = -(-sum(p.send_actions for p in per) // n)
    lan = LAN.latency(sent / n, messages)
    wan = WAN.latency(sent / n, messages)
    compute = max(p.exec_s for p in per)
    cpu = {} if any(p.cpu_s is None for p in per) else {
        "party_cpu_s": [round(float(p.cpu_s), 4) for p in per]}
    return {
        "comm_bytes": int(sent),
        "messages": int(messages),
        "party_send_bytes": [int(p.send_bytes) for p in per],
        "party_recv_bytes": [int(p.recv_bytes) for p in per],
        "party_send_actions": [int(p.send_actions) for p in per],
        "party_compute_s": [round(float(p.exec_s), 4) for p in per],
        **cpu,
        "party_attribution": run.attribution or "own",
        "wall_s": round(float(wall_s), 4),
        "compute_s": round(float(compute), 4),
        "lan_latency_s": round(lan, 5),
        "wan_latency_s": round(wan, 4),
        "lan_total_s": round(lan + compute, 4),
        "wan_total_s": round(wan + compute, 4),
        "phase_breakdown": phase_breakdown(run),
        "ops": {op: [c.send_bytes, c.send_actions, round(c.seconds, 5)]
                for op, c in run.ops.get("HLO", {}).items() if c.send_bytes or c.seconds > 1e-3},
    }
