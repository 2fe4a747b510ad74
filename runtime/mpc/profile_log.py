"""SPU profiling logs -> every party's cost of a run (RunCost); costs.py turns one into a record.

SPU 0.9.5 has no Python API for link statistics. With `enable_pphlo_profile` and
`enable_hal_profile` every party's runtime logs, per run, one line per executed op kind,

    - pphlo.dot, executed 3 times, duration 0.01s, send bytes 160 recv bytes 160, send actions 3, recv actions 3

grouped in sections ("HLO profiling", "HAL profiling", "MPC profiling"), opened by
`[Profiling] SPU execution NAME completed ... execution took Xs` and closed by
`Link details: total send bytes B, recv bytes R, send actions S, recv actions A` (that party's
link totals for the run). Only the opening line names anything: the executable. The simulator
therefore runs one executable per party named `NAME.r{rank}` (`party_executable_name`), and
`parse_profile_log` returns one `RunCost` per (run, party); `combine_parties` makes the run's
cost from every party's.

The simulator's parties are threads of one process logging to one file, and their blocks
interleave when runs end together (2 of 18 small runs in one test; the threads are preempted
mid-block). `parse_profile_log` separates them by search (`_solve`) under what SPU guarantees
for each block: opening line first, link line last, sections in order, each op once per section,
op lines sorted by decreasing duration, a section's durations adding up to its logged total
time, and the pphlo op lines adding up exactly to the link totals (bytes and actions, sent and
received; checked on ABY3 / SEMI2K / CHEETAH programs with loops, sorts and secret-index
slices). Sums over parties (bytes, actions, pphlo ops) never depend on the separation; only
which party gets which link totals does, and `RunCost.attribution` says how sure that is: two
opening lines logged back to back followed by both bodies cannot be told apart ("ambiguous").

Why every party: several ABY3 kernels of SPU 0.9.5 make the parties send different amounts, and
most draw the roles anew on every call (B2A by OT, eqz, TruncAPr2; MulA1B has fixed senders), so
one party's bytes x parties varies ~6x between runs of one program, while the sum over parties
is the same in every run (and equals the sum received).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time
import warnings

_OP_LINE = re.compile(
    r"- (?P<op>.+?), executed (?P<count>\d+) times, duration (?P<dur>[0-9.eE+-]+)s, "
    r"send bytes (?P<sb>\d+) recv bytes (?P<rb>\d+), send actions (?P<sa>\d+), "
    r"recv actions (?P<ra>\d+)")
_SECTION = re.compile(r"(?P<name>HLO|HAL|MPC) profiling: total time (?P<total>[0-9.eE+-]+)")
_LINK = re.compile(r"Link details: total send bytes (?P<sb>\d+), recv bytes (?P<rb>\d+), "
                   r"send actions (?P<sa>\d+), recv actions (?P<ra>\d+)")
_RUN = re.compile(r"\[Profiling\] SPU execution (?P<name>\S+) completed.*execution took "
                  r"(?P<dur>[0-9.eE+-]+)s")
_RANKED = re.compile(r"^(?P<base>.+)\.r(?P<rank>\d+)$")
SECTIONS = ("HLO", "HAL", "MPC")   # the order SPU prints them in
ATTRIBUTIONS = ("", "unique", "unverified", "ambiguous", "order")   # from sure to unsure
_DEMERGE_STEPS = 200_000


def party_executable_name(name: str, rank: int) -> str:
    """The executable name party `rank` runs `name` under (its profile's opening line)."""
    return f"{name}.r{rank}"


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
    """One SPU execution: one party's profile (`rank`; None when the name carries none) or a
    whole run (`parties`: every party's RunCost, by rank; see `combine_parties`).

    `ops[section][op] -> OpCost` with section in HLO (pphlo ops), HAL, MPC; link totals;
    `exec_s` = the execution time SPU measured. For a whole run, bytes and actions (link totals
    and per op) are summed over the parties, `exec_s` and op seconds are the slowest party's, op
    counts are per party (every party executes the same ops). `attribution`: how surely each
    party's link totals were told apart in a shared log ("unique", "unverified", "ambiguous",
    "order"; see `parse_profile_log`; "" for a party's own log)."""

    name: str = ""
    exec_s: float = 0.0
    ops: dict = dataclasses.field(default_factory=dict)
    send_bytes: int = 0
    recv_bytes: int = 0
    send_actions: int = 0
    recv_actions: int = 0
    rank: int | None = None
    parties: tuple = ()
    attribution: str = ""
    cpu_s: float | None = None   # the party process's CPU time for the run (multi-process only)

    @property
    def comm_bytes(self) -> int:
        """Bytes sent (summed over the parties for a whole run; = bytes received)."""
        return self.send_bytes

    @property
    def party_runs(self) -> tuple:
        """Every party's RunCost (this one alone when it is one party's profile)."""
        return self.parties or (self,)


class CostAccountingError(ValueError):
    """The parties' profiles do not add up (sent != received, missing or repeated ranks)."""


def combine_parties(runs) -> RunCost:
    """The cost of one run from every party's own RunCost (any order; ranks must be 0..n-1).
    Raises CostAccountingError when the bytes sent and received over all parties differ."""
    runs = sorted(runs, key=lambda r: -1 if r.rank is None else r.rank)
    ranks = [r.rank for r in runs]
    if ranks != list(range(len(runs))):
        raise CostAccountingError(f"need one profile per party 0..{len(runs) - 1}, got ranks "
                                  f"{ranks}")
    names = {r.name for r in runs}
    if len(names) != 1:
        raise CostAccountingError(f"party profiles of different executables: {sorted(names)}")
    sent, recv = sum(r.send_bytes for r in runs), sum(r.recv_bytes for r in runs)
    if sent != recv:
        raise CostAccountingError(
            f"{runs[0].name}: the parties sent {sent} bytes in total but received {recv} "
            f"(per party sent {[r.send_bytes for r in runs]}, received "
            f"{[r.recv_bytes for r in runs]}): the profiles are not of one and the same run")
    ops: dict = {}
    for run in runs:
        for section, table in run.ops.items():
            dst = ops.setdefault(section, {})
            for op, c in table.items():
                d = dst.get(op)
                dst[op] = c if d is None else OpCost(
                    max(d.count, c.count), max(d.seconds, c.seconds),
                    d.send_bytes + c.send_bytes, d.recv_bytes + c.recv_bytes,
                    d.send_actions + c.send_actions, d.recv_actions + c.recv_actions)
    attribution = max((r.attribution for r in runs), key=ATTRIBUTIONS.index)
    cpu = [r.cpu_s for r in runs]
    return RunCost(runs[0].name, max(r.exec_s for r in runs), ops, sent, recv,
                   sum(r.send_actions for r in runs), sum(r.recv_actions for r in runs),
                   None, tuple(runs), attribution,
                   None if None in cpu else max(cpu))


# ----- log parsing -----------------------------------------------------------------------------
def _events(text: str) -> list[tuple]:
    out = []
    for line in text.splitlines():
        m = _RUN.search(line)
        if m:
            out.append(("run", m["name"], float(m["dur"])))
            continue
        m = _SECTION.search(line)
        if m:
            out.append(("section", m["name"], float(m["total"])))
            continue
        m = _OP_LINE.search(line)
        if m:
            out.append(("op", m["op"], OpCost(int(m["count"]), float(m["dur"]), int(m["sb"]),
                                              int(m["rb"]), int(m["sa"]), int(m["ra"]))))
            continue
        m = _LINK.search(line)
        if m:
            out.append(("link", (int(m["sb"]), int(m["rb"]), int(m["sa"]), int(m["ra"]))))
    return out


def _comm(c: OpCost) -> tuple:
    return (c.send_bytes, c.recv_bytes, c.send_actions, c.recv_actions)


def _carries_comm(event) -> bool:
    return any(_comm(event[2]))


def _same_time(total: float, parts: float) -> bool:
    """A section's logged total time vs the sum of its op lines' (summed in another order)."""
    return abs(total - parts) <= 1e-9 * max(abs(total), 1e-3)


class _State:
    """A block's state during `_solve`."""

    def __init__(self):
        self.section: str | None = None
        self.total = {}                # section -> its logged total time
        self.names: dict = {}          # section -> op names seen
        self.last: dict = {}           # section -> duration of the previous op line
        self.time: dict = {}           # section -> sum of its op lines' durations so far
        self.sums = [0, 0, 0, 0]       # pphlo lines: sent/received bytes, sent/received actions
        self.closed = False

    def section_done(self) -> bool:
        sec = self.section
        return sec is None or _same_time(self.total[sec], self.time[sec])


def _solve(events: list[tuple], keys: list[int], timed: bool,
           max_steps: int = _DEMERGE_STEPS):
    """Which block (index in opening order) each line in `keys` (event indices) belongs to: a
    depth-first search (trying the previous line's block first) under the rules of a block:
    its lines come after its opening line and before its link line; sections in order (pphlo
    ops, only they, in HLO); each op once per section; durations non-increasing within a
    section; its pphlo op lines add up to its link line (pruned early: running sums must stay
    within one of the link lines not yet taken) and, if `timed` (every line must then be in
    `keys`), each section's op durations add up to the section's logged total time.

    Returns None when no assignment is found within `max_steps`, else ({event index: block},
    attribution) for the first assignment found, attribution being "unique" (the search ran
    out: no other assignment gives any block other link totals), "ambiguous" (another one
    does: e.g. two opening lines logged back to back, then both bodies) or "unverified" (the
    step budget ran out first)."""
    free = [e[1] for e in events if e[0] == "link"]
    states: list[_State] = []
    frames: list[list] = []        # per key: [candidates, next, chosen block, undo]
    steps = 0
    first = None                   # (owner, link lines per block) of the first assignment

    def accepts(st: _State, ev) -> bool:
        if st.closed:
            return False
        if ev[0] == "link":
            return (("HLO" not in st.names or tuple(st.sums) == ev[1])
                    and (not timed or st.section_done()))
        if ev[0] == "section":
            return (SECTIONS.index(ev[1]) > (SECTIONS.index(st.section) if st.section else -1)
                    and (not timed or st.section_done()))
        sec = st.section
        if sec is None or (sec == "HLO") != ev[1].startswith("pphlo."):
            return False
        c = ev[2]
        if ev[1] in st.names[sec] or c.seconds > st.last[sec]:
            return False
        if timed and st.time[sec] + c.seconds > st.total[sec] * (1 + 1e-9) + 1e-12:
            return False
        if sec != "HLO":
            return True
        new = [x + y for x, y in zip(st.sums, _comm(c))]
        return any(all(x <= y for x, y in zip(new, link)) for link in free)

    def apply(st: _State, ev):
        if ev[0] == "link":
            st.closed = True
            free.remove(ev[1])
            return None
        if ev[0] == "section":
            old = st.section
            st.section = ev[1]
            st.names[ev[1]], st.last[ev[1]] = set(), math.inf
            st.total[ev[1]], st.time[ev[1]] = ev[2], 0.0
            return old
        sec, c = st.section, ev[2]
        old = (st.last[sec], st.time[sec])
        st.names[sec].add(ev[1])
        st.last[sec] = c.seconds
        st.time[sec] += c.seconds
        if sec == "HLO":
            st.sums = [x + y for x, y in zip(st.sums, _comm(c))]
        return old

    def undo(st: _State, ev, old):
        if ev[0] == "link":
            st.closed = False
            free.append(ev[1])
        elif ev[0] == "section":
            for table in (st.names, st.last, st.total, st.time):
                del table[ev[1]]
            st.section = old
        else:
            sec, c = st.section, ev[2]
            st.names[sec].discard(ev[1])
            st.last[sec], st.time[sec] = old
            if sec == "HLO":
                st.sums = [x - y for x, y in zip(st.sums, _comm(c))]

    while True:
        if len(frames) == len(keys):
            if all(st.closed for st in states):
                owner = {keys[k]: f[2] for k, f in enumerate(frames)}
                links = sorted((owner[i], events[i][1]) for i in owner if events[i][0] == "link")
                if first is None:
                    first = (owner, links)
                elif links != first[1]:
                    return first[0], "ambiguous"
        else:
            ev = events[keys[len(frames)]]
            if ev[0] == "run":
                states.append(_State())
                frames.append([[len(states) - 1], 1, len(states) - 1, None])
                continue
            prev = frames[-1][2] if frames else None
            order = ([prev] if prev is not None else []) + [
                b for b in range(len(states)) if b != prev]
            frames.append([[b for b in order if accepts(states[b], ev)], 0, None, None])
        while True:                            # next choice at the deepest frame, backtracking
            steps += 1
            if not frames or steps > max_steps:
                if first is None:
                    return None
                return first[0], ("unique" if not frames else "unverified")
            frame = frames[-1]
            ev = events[keys[len(frames) - 1]]
            if ev[0] == "run":
                states.pop()
                frames.pop()
                continue
            if frame[2] is not None:
                undo(states[frame[2]], ev, frame[3])
                frame[2] = None
            if frame[1] >= len(frame[0]):
                frames.pop()
                continue
            b = frame[0][frame[1]]
            frame[1] += 1
            frame[2], frame[3] = b, apply(states[b], ev)
            break


class _Block:
    """One party's profile block, reassembled."""

    def __init__(self, name: str, exec_s: float, start: int):
        self.name, self.exec_s, self.start = name, exec_s, start
        self.end = math.inf            # index of its link line, once known
        self.section: str | None = None
        self.last: dict = {}           # section -> duration of its previous op line
        self.ops: dict = {}
        self.link: tuple | None = None

    def open_at(self, i: int) -> bool:
        return self.start < i < self.end and self.link is None

    def takes_op(self, ev, strict: bool) -> bool:
        section = "HLO" if ev[1].startswith("pphlo.") else self.section
        if section is None or (section == "HLO") != ev[1].startswith("pphlo."):
            return False
        return ev[1] not in self.ops.get(section, {}) and (
            not strict or ev[2].seconds <= self.last.get(section, math.inf))

    def add_op(self, ev):
        section = "HLO" if ev[1].startswith("pphlo.") else self.section
        self.ops.setdefault(section, {})[ev[1]] = ev[2]
        self.last[section] = ev[2].seconds

    def run_cost(self) -> RunCost:
        m = _RANKED.match(self.name)
        name, rank = (m["base"], int(m["rank"])) if m else (self.name, None)
        sb, rb, sa, ra = self.link if self.link is not None else (0, 0, 0, 0)
        return RunCost(name, self.exec_s, self.ops, sb, rb, sa, ra, rank)


def _separate(events: list[tuple]) -> tuple[list[_Block], str]:
    """Every line to its party's block, and how sure that is (see `_solve`; "order" when no
    consistent separation was found and link lines went to the parties in order of
    appearance). Lines `_solve` left out (op lines without communication when only the lines
    with communication could be separated) go to the previous line's block when the block
    rules allow, else to the first block that takes them."""
    solved = _solve(events, list(range(len(events))), timed=True)
    if solved is None:
        solved = _solve(events, [i for i, e in enumerate(events)
                                 if e[0] != "op" or _carries_comm(e)], timed=False)
    if solved is not None:
        owner, attribution = solved
    else:
        warnings.warn("SPU profile: the parties' interleaved log lines could not be separated "
                      "consistently with their link totals; link lines are given to the parties "
                      "in order of appearance, so per-party numbers may be mixed up (totals "
                      "over parties are exact)")
        runs = [i for i, e in enumerate(events) if e[0] == "run"]
        links = [i for i, e in enumerate(events) if e[0] == "link"]
        owner = {i: k for k, i in enumerate(runs)}
        owner.update({i: k for k, i in enumerate(links[:len(runs)])})
        attribution = "order"
    blocks = [_Block(ev[1], ev[2], i) for i, ev in enumerate(events) if ev[0] == "run"]
    for i, ev in enumerate(events):
        if ev[0] == "link" and i in owner:
            blocks[owner[i]].end = i
    prev = None
    for i, ev in enumerate(events):
        if ev[0] == "run":
            prev = blocks[owner[i]] if i in owner else blocks[-1]
            continue
        if i in owner:
            block = blocks[owner[i]]
        else:
            order = ([prev] if prev is not None else []) + [b for b in blocks if b is not prev]
            open_ = [b for b in order if b.open_at(i)]
            if ev[0] == "section":
                rank = SECTIONS.index(ev[1])
                fit = [b for b in open_ if (SECTIONS.index(b.section) if b.section else -1)
                       < rank]
            elif ev[0] == "op":
                fit = ([b for b in open_ if b.takes_op(ev, True)]
                       or [b for b in open_ if b.takes_op(ev, False)])
            else:
                fit = []
            if not fit:
                continue                   # a line no block can take (incomplete log)
            block = fit[0]
        if ev[0] == "section":
            block.section = ev[1]
        elif ev[0] == "op":
            block.add_op(ev)
        elif ev[0] == "link":
            block.link = ev[1]
        prev = block
    return blocks, attribution


def parse_profile_log(text: str) -> list[RunCost]:
    """Every SPU execution profiled in `text`, one RunCost per (run, party), in the order their
    opening lines appear. Blocks of parties logging at the same time are separated (see the
    module docstring); a block whose link line is missing keeps zero link totals."""
    events = _events(text)
    first = next((i for i, e in enumerate(events) if e[0] == "run"), None)
    if first is None:
        return []
    blocks, attribution = _separate(events[first:])
    return [dataclasses.replace(b.run_cost(), attribution=attribution) for b in blocks]


def _read(log_path, offset: int) -> str:
    if not os.path.exists(log_path):
        return ""
    with open(log_path, "rb") as f:
        if os.fstat(f.fileno()).st_size < offset:   # spdlog rotated the file: a new one
            offset = 0
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    return text[:text.rfind("\n") + 1]           # whole lines only (spdlog may be mid-line)


def read_last_profile(log_path: str | os.PathLike, offset: int = 0, timeout_s: float = 10.0
                      ) -> RunCost:
    """The last SPU run profiled in `log_path` after byte `offset` by a process running one
    party. spdlog writes from the runtime's thread, so wait (up to `timeout_s`) until the run's
    closing link line is there."""
    deadline = time.time() + timeout_s
    while True:
        text = _read(log_path, offset)
        if _RUN.search(text) and "Link details" in text.split("[Profiling] SPU execution")[-1]:
            return parse_profile_log(text)[-1]
        if time.time() > deadline:
            raise RuntimeError(f"no SPU profile of the run in {log_path} (after byte {offset}): "
                               "was enable_pphlo_profile switched off?")
        time.sleep(0.05)


def read_run_profiles(log_path: str | os.PathLike, offset: int, parties: int,
                      timeout_s: float = 10.0) -> RunCost:
    """The one run every party of a simulation profiled in `log_path` after byte `offset`
    (their executables named by `party_executable_name`), combined: waits until all `parties`
    blocks are closed, then `combine_parties`."""
    deadline = time.time() + timeout_s
    while True:
        text = _read(log_path, offset)
        opened, closed = len(_RUN.findall(text)), len(_LINK.findall(text))
        if opened >= parties and closed >= parties:
            break
        if time.time() > deadline:
            raise RuntimeError(f"{log_path} (after byte {offset}) holds {opened} party profiles "
                               f"and {closed} link lines, expected {parties} of each: was "
                               "enable_pphlo_profile switched off for some party?")
        time.sleep(0.05)
    runs = parse_profile_log(text)
    if len(runs) != parties:
        raise CostAccountingError(f"expected one profile per party ({parties}), found "
                                  f"{[(r.name, r.rank) for r in runs]}")
    return combine_parties(runs)
