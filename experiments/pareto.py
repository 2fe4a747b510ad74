"""Accuracy against MPC cost, for every policy.

Joins fidelity runs (`--experiment=accuracy` with the natural tasks: DIR/summary.csv, per
task / policy / budget: score, agreement with `full`, KL) with decode-cost runs
(`--experiment=mpc_cost --mpc_bench=decode`: DIR/results.jsonl, per policy / sequence length:
bytes summed over the parties, messages, modelled LAN time, simulated compute; with
`--mpc_decode_steps` the mean step of a generation) at one budget, and writes the table
(CSV + markdown) and docs/figures/pareto.png: a row of panels per sequence length, quality
against communication and against LAN + compute time, the Pareto front (no other policy
both cheaper and better) drawn through each.

Quality is the pooled task score over `full`'s (`--quality=score`, the default: the sum of a
policy's per-task scores over `full`'s on the same samples, as `mpcache pooled` pools them)
or greedy agreement with `full` (`--quality=agree`, a diagnostic of exact policies).

    mpcache pareto --fidelity_dir=results/front_smollm2_2048 \
        --cost_dir=results/mpc_long_2048,results/mpc_pareto --budget=0.1min384 \
        --seq_lens=2048 --output_dir=results/pareto --figure=docs/figures/pareto.png
"""
from __future__ import annotations

import csv
import json
import pathlib
import sys

from absl import flags

from experiments import cli
from experiments.options import parse_numbers
from mpcache_jax import primitives as P
from mpcache_jax.policies import DEFAULT_BUDGET


def _same_budget(text: str, budget) -> bool:
    """Whether a summary row's budget (its text) is `budget` (a ratio, count or Budget)."""
    got = P.parse_budget(text)
    if isinstance(got, P.Budget) or isinstance(budget, P.Budget):
        return got == budget
    return abs(float(got) - float(budget)) <= 1e-9


def read_fidelity(path: pathlib.Path, budget,
                  tasks: list[str] | None = None) -> dict[str, dict]:
    """policy -> mean over `tasks` (None: every task of the run) of agree / agree_prefix / kl,
    and the pooled score over `full`'s (the sum of its task scores over the sum of `full`'s on
    the same samples; None where `full` scored nothing) at `budget` (full at any budget: it is
    the reference). A policy that lacks one of `tasks` is an error: its mean would not be
    comparable with the others'."""
    rows = list(csv.DictReader(open(path)))
    if not rows:
        raise SystemExit(f"error: {path}: no rows")
    per: dict[str, list[dict]] = {}
    for r in rows:
        if r["policy"] != "full" and not _same_budget(r["budget"], budget):
            continue
        if tasks is not None and r["task"] not in tasks:
            continue
        if int(r.get("skipped") or 0) and not int(r["n"]):
            continue
        per.setdefault(r["policy"], []).append(r)
    out = {}
    for policy, rs in per.items():
        if tasks is not None and {r["task"] for r in rs} != set(tasks):
            raise SystemExit(f"error: {path}: {policy} at budget {budget} has tasks "
                             f"{sorted({r['task'] for r in rs})}, not {sorted(tasks)}")
        def mean(key):
            vals = [float(r[key]) for r in rs if r[key] not in ("", "nan")]
            return sum(vals) / len(vals) if vals else float("nan")
        full_total = sum(float(r["full_score"] or 0) for r in rs)
        pooled = sum(float(r["score"]) for r in rs) / full_total if full_total > 0 else None
        out[policy] = {"agree": mean("agree"), "agree_prefix": mean("agree_prefix"),
                       "kl": mean("kl"), "score_over_full": pooled}
    return out


def read_costs(path: pathlib.Path, protocol: str, budget=None) -> dict[tuple[str, int], dict]:
    """(policy, seq_len) -> the decoder-layer record of a decode-cost run (at `budget` where
    given: `full` at any budget, as in read_fidelity)."""
    out = {}
    for line in open(path):
        r = json.loads(line)
        if r.get("scope") != "decoder_layers" or r.get("protocol") != protocol:
            continue
        if budget is not None and r["policy"] != "full" \
                and r.get("budget") is not None and not _same_budget(str(r["budget"]), budget):
            continue
        out[(r["policy"], r["seq_len"])] = r
    if not out:
        raise SystemExit(f"error: {path}: no decoder-layer records for {protocol}"
                         + (f" at budget {budget}" if budget is not None else ""))
    return out


def read_cost_runs(paths: list[pathlib.Path], protocol: str, budget=None) -> dict:
    """(policy, seq_len) -> its record from the first run that has it: a run of a few
    policies over a whole generation (`--mpc_decode_steps`) listed before a run of every
    policy over one step gives those policies their generation's mean step."""
    out: dict = {}
    for path in paths:
        for key, record in read_costs(path, protocol, budget).items():
            out.setdefault(key, dict(record, source=str(path.parent)))
    return out


QUALITY = {"score": ("score_over_full", "task score / full's (pooled)"),
           "agree": ("agree", "greedy agreement with full")}


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (cost no higher and quality no lower,
    one of them strictly), cheapest first. points: (cost, quality)."""
    front = []
    for i, (c, q) in enumerate(points):
        dominated = any((c2 <= c and q2 >= q) and (c2 < c or q2 > q)
                        for j, (c2, q2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def join(fidelity: dict, costs: dict, seq_lens: list[int], quality: str = "score") -> list[dict]:
    """One row per (sequence length, policy) with both a fidelity and a cost record; the
    fronts (`front_comm`, `front_time`) over `quality` (a QUALITY key). A policy without a
    pooled score (`full` scored nothing) stays off the score fronts."""
    key = QUALITY[quality][0]
    rows = []
    for T in seq_lens:
        for policy, fid in sorted(fidelity.items()):
            cost = costs.get((policy, T))
            if cost is None:
                continue
            rows.append({"seq_len": T, "policy": policy, "agree": fid["agree"],
                         "agree_prefix": fid["agree_prefix"], "kl": fid["kl"],
                         "score_over_full": fid["score_over_full"],
                         "comm_mb": cost["comm_bytes"] / 1e6, "messages": cost["messages"],
                         "lan_s": cost["lan_latency_s"], "compute_s": cost["compute_s"],
                         "lan_total_s": cost["lan_latency_s"] + cost["compute_s"],
                         "steps": len(cost.get("steps") or [None]),
                         "cost_run": cost.get("source", "")})
        group = [r for r in rows if r["seq_len"] == T and r[key] is not None]
        for i in pareto_front([(r["comm_mb"], r[key]) for r in group]):
            group[i]["front_comm"] = True
        for i in pareto_front([(r["lan_total_s"], r[key]) for r in group]):
            group[i]["front_time"] = True
    return rows


def write(rows: list[dict], out: pathlib.Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    keys = ["seq_len", "policy", "score_over_full", "agree", "agree_prefix", "kl", "comm_mb",
            "messages", "lan_s", "compute_s", "lan_total_s", "steps", "cost_run", "front_comm",
            "front_time"]
    with open(out / "pareto.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})
    lines = ["| T | policy | score / full | agree | KL | comm MB | messages | LAN s | "
             "LAN + compute s | steps | front (comm / time) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f2 = lambda v: "-" if v is None else f"{v:.2f}"
    for r in sorted(rows, key=lambda r: (r["seq_len"], r["comm_mb"])):
        front = "/".join(x for x, k in (("comm", "front_comm"), ("time", "front_time")) if r.get(k))
        lines.append(f"| {r['seq_len']} | `{r['policy']}` | {f2(r['score_over_full'])} | "
                     f"{r['agree']:.2f} | {r['kl']:.3f} | {r['comm_mb']:.2f} | {r['messages']} | "
                     f"{r['lan_s']:.3f} | {r['lan_total_s']:.2f} | {r['steps']} | {front or '-'} |")
    table = "\n".join(lines)
    (out / "pareto.md").write_text(table + "\n")
    return table


def plot(rows: list[dict], path: pathlib.Path, budget, quality: str = "score") -> None:
    """A row per sequence length: quality against communication and against LAN + compute,
    each with its Pareto front; the default `mpcache` as a star, the other MPCache policies
    red, `full` black, the rest blue."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    key, label = QUALITY[quality]
    seq_lens = sorted({r["seq_len"] for r in rows})
    axes_of = (("comm_mb", "front_comm", "decode-step communication, MB (all parties, ABY3)"),
               ("lan_total_s", "front_time", "decode step, LAN (modelled) + compute s"))
    fig, axes = plt.subplots(len(seq_lens), 2, figsize=(13, 5 * len(seq_lens)), squeeze=False)
    for row_axes, T in zip(axes, seq_lens):
        for ax, (x, front_key, xlabel) in zip(row_axes, axes_of):
            group = sorted((r for r in rows if r["seq_len"] == T and r[key] is not None),
                           key=lambda r: r[x])
            for r in group:
                name = r["policy"]
                color = ("black" if name == "full" else
                         "tab:red" if name.startswith("mpcache") else "tab:blue")
                ax.scatter(r[x], r[key], s=160 if name == "mpcache" else 40, zorder=3,
                           marker="*" if name == "mpcache" else "o", color=color)
                ax.annotate(name, (r[x], r[key]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
            front = [r for r in group if r.get(front_key)]
            ax.plot([r[x] for r in front], [r[key] for r in front], "--", color="gray",
                    zorder=2, label="Pareto front")
            ax.set_xscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.set_title(f"T = {T}, budget {P.budget_label(budget)}")
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_list("fidelity_dir", None, "accuracy runs' output directories, "
                        "comma-separated (same tasks and seed; a policy is taken from the first "
                        "run that has it)", flag_values=fv)
    flags.DEFINE_list("cost_dir", None, "decode-cost runs' output directories, "
                        "comma-separated (a policy and length are taken from the first run "
                        "that has them)", flag_values=fv)
    flags.DEFINE_string("budget", P.budget_label(DEFAULT_BUDGET), "the budget whose rows are "
                        "joined (a ratio, a token count or RATIOminTOKENS; default: the "
                        "shipped budget)", flag_values=fv)
    flags.DEFINE_enum("quality", "score", sorted(QUALITY), "the fronts' and the figure's "
                      "quality: the pooled task score over full's, or greedy agreement",
                      flag_values=fv)
    flags.DEFINE_list("tasks", "multi_hop,multi_needle,qa,longbench_jsonl", "the tasks "
                        "pooled into a policy's fidelity (every policy needs all)",
                        flag_values=fv)
    flags.DEFINE_string("protocol", "ABY3", "the cost run's protocol", flag_values=fv)
    flags.DEFINE_list("seq_lens", "2048", "comma-separated cache lengths of the cost runs",
                        flag_values=fv)
    flags.DEFINE_string("output_dir", "results/pareto", "pareto.csv and pareto.md",
                        flag_values=fv)
    flags.DEFINE_string("figure", "docs/figures/pareto.png", "the figure", flag_values=fv)
    flags.mark_flags_as_required(["fidelity_dir", "cost_dir"], flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    args = _flags()
    cli.parse(args, argv, __doc__)
    try:
        budget = P.parse_budget(args.budget)
    except ValueError as err:
        print(f"error: --budget: {err}", file=sys.stderr)
        return 2
    fid_paths = [pathlib.Path(d) / "summary.csv" for d in args.fidelity_dir]
    cost_paths = [pathlib.Path(d) / "results.jsonl" for d in args.cost_dir]
    try:
        seq_lens = parse_numbers("seq_lens", args.seq_lens, int)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for p in fid_paths + cost_paths:
        if not p.is_file():
            print(f"error: {p} does not exist (run the accuracy / cost command first)",
                  file=sys.stderr)
            return 2
    fidelity = {}
    for p in fid_paths:
        for policy, row in read_fidelity(p, budget, args.tasks).items():
            fidelity.setdefault(policy, row)
    costs = read_cost_runs(cost_paths, args.protocol, budget)
    rows = join(fidelity, costs, seq_lens, args.quality)
    if not rows:
        print("error: no policy has both a fidelity row and a cost row", file=sys.stderr)
        return 2
    missing = sorted({p for p, _ in costs} - set(fidelity)) + sorted(
        set(fidelity) - {p for p, _ in costs})
    table = write(rows, pathlib.Path(args.output_dir))
    plot(rows, pathlib.Path(args.figure), budget, args.quality)
    print(table)
    if missing:
        print(f"(in only one of the two runs, left out: {', '.join(missing)})")
    print(f"wrote {args.output_dir}/pareto.csv, pareto.md and {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
