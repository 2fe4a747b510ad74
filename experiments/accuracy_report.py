"""The accuracy run's results: per (task, policy, budget) means, summary.csv, the plots and the
printed table."""
from __future__ import annotations

import collections
import csv
import math

import numpy as np

from experiments import common
from mpcache_jax import primitives as P


FIDELITY_FIELDS = ("score", "full_score", "agree", "agree_prefix", "kl")


def aggregate(sample_records, config: dict, model: str) -> list[dict]:
    """One record per (task, policy, budget): means of the task score, full's score on the same
    samples, greedy agreement with full (exact / prefix share) and KL from full. config: the
    run's settings, recorded in each row."""
    groups = collections.defaultdict(list)
    for r in sample_records:
        groups[(r["task"], r["policy"], r["budget"])].append(r)
    commit = common.git_commit()
    out = []
    for (task, policy, budget), records in groups.items():
        ran = [r for r in records if "skipped" not in r]
        means = {field: float(np.mean([r.get(field, np.nan) for r in ran])) if ran else
                 float("nan") for field in FIDELITY_FIELDS}
        peaks = [r["peak_rss_mb"] for r in ran if "peak_rss_mb" in r]
        means["peak_rss_mb"] = float(np.max(peaks)) if peaks else float("nan")
        out.append({"task": task, "policy": policy, "budget": budget, **means, "n": len(ran),
                    "skipped": len(records) - len(ran), "model": model,
                    "git_commit": commit, "config": config})
    return out


def aggregate_mechanism(sample_records) -> list[dict]:
    """Per (task, policy, budget, layer): mean share of the answer's tokens that survive static
    eviction and that the answer-writing step selects (samples where full wrote the answer)."""
    groups = collections.defaultdict(list)
    for r in sample_records:
        if r.get("mechanism"):
            groups[(r["task"], r["policy"], r["budget"])].append(r["mechanism"])
    rows = []
    for (task, policy, budget), mechs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        layers = len(mechs[0]["survive"])
        for layer in range(layers):
            survive = [m["survive"][layer] for m in mechs]
            select = [m["select"][layer] for m in mechs if m.get("select")]
            rows.append({"task": task, "policy": policy, "budget": budget, "layer": layer,
                         "survive": float(np.nanmean(survive)),
                         "select": float(np.nanmean(select)) if select else float("nan"),
                         "n": len(mechs), "n_select": len(select)})
    return rows


def write_csv(rows: list[dict], columns: list[str], path) -> None:
    common.replace_file(path, lambda tmp: _write_csv(rows, columns, tmp))


def _write_csv(rows: list[dict], columns: list[str], path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in rows:
            writer.writerow([f"{r[c]:.4f}" if isinstance(r[c], float) else r[c] for c in columns])


def write_summary(results, path):
    rows = sorted(results, key=lambda r: (r["task"], r["policy"], str(r["budget"])))
    write_csv(rows, ["task", "policy", "budget", *FIDELITY_FIELDS, "peak_rss_mb", "n", "skipped"],
              path)


METRIC_LABELS = {"score": "score", "agree": "greedy agreement with full",
                 "kl": "KL(full || policy), nats per step"}


def plot_vs_budget(results, path, field: str = "score"):
    """One panel per task: `field` vs budget, one line per policy (full as a dashed level)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task_names = sorted({r["task"] for r in results})
    many = len({r["policy"] for r in results}) > 8
    cols = 2 if len(task_names) >= 4 else len(task_names)
    rows = -(-len(task_names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[len(task_names):]:
        ax.axis("off")
    for ax, task in zip(axes.flat, task_names):
        by_policy = collections.defaultdict(list)
        for r in results:
            if r["task"] == task:
                by_policy[r["policy"]].append((P.budget_ratio(r["budget"]), r[field], r["n"]))
        colors = plt.get_cmap("tab20").colors
        markers = "osD^vP*X<>"
        for i, (policy, points) in enumerate(sorted(by_policy.items())):
            points.sort()
            if policy == "full":
                ax.axhline(points[0][1], color="black", linestyle="--", label="full")
                continue
            # Distinct colour + marker per policy, slightly jittered so equal scores stay visible.
            jitter = 0.004 * (i - len(by_policy) / 2) if len(by_policy) > 8 else 0.0
            ax.plot([p[0] for p in points], [p[1] + jitter for p in points],
                    marker=markers[i % len(markers)], color=colors[i % len(colors)], label=policy)
        n = max(p[2] for points in by_policy.values() for p in points)
        ax.set_xlabel("budget (prompt tokens attended, ratio or count)")
        ppl = field == "score" and any(r["task"] == task and r.get("full_score", 0) > 1.5
                                       for r in results)
        ax.set_ylabel("perplexity (lower is better)" if ppl else METRIC_LABELS[field])
        ax.set_title(f"{task} ({results[0]['model']}, n={n})")
        if not many:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if many:  # one shared legend beside the panels instead of one covering each panel
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_mechanism(rows: list[dict], path):
    """One panel per task: per layer, the share of the answer's tokens surviving static
    eviction (solid) and selected at the answer step (dashed), one colour per policy@budget."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task_names = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(task_names), figsize=(6 * len(task_names), 4.2), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for ax, task in zip(axes.flat, task_names):
        combos = sorted({(r["policy"], P.budget_label(r["budget"])) for r in rows
                         if r["task"] == task})
        for i, (policy, budget) in enumerate(combos):
            mine = sorted((r for r in rows if r["task"] == task and r["policy"] == policy
                           and P.budget_label(r["budget"]) == budget), key=lambda r: r["layer"])
            layers = [r["layer"] for r in mine]
            color = colors[i % len(colors)]
            ax.plot(layers, [r["survive"] for r in mine], color=color,
                    label=f"{policy}@{budget}")
            ax.plot(layers, [r["select"] for r in mine], color=color, linestyle="--")
        ax.set_xlabel("layer")
        ax.set_ylabel("share of answer tokens")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{task}: kept by static eviction (solid), selected (dashed)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_needle_heatmaps(sample_records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["policy"], r["budget"]) for r in sample_records},
                    key=lambda combo: (combo[0], str(combo[1])))
    lengths = sorted({r["length"] for r in sample_records})
    depths = sorted({r["depth"] for r in sample_records})
    cols = min(4, len(combos))
    rows = math.ceil(len(combos) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    for ax, (policy, budget) in zip(axes.flat, combos):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, depth in enumerate(depths):
            for j, length in enumerate(lengths):
                scores = [r["score"] for r in sample_records if "skipped" not in r and
                          r["policy"] == policy and
                          r["budget"] == budget and r["depth"] == depth and r["length"] == length]
                if scores:
                    grid[i, j] = np.mean(scores)
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(f"{policy}@{P.budget_label(budget)}", fontsize=8)
        ax.set_xlabel("prompt tokens", fontsize=7)
        ax.set_ylabel("needle depth", fontsize=7)
    for ax in list(axes.flat)[len(combos):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(out, results, sample_records, task_names) -> list[str]:
    """results.jsonl, summary.csv, the plots vs budget, the mechanism table and plot (when
    the run measured it) and the needle heat maps (needle task) under `out`; prints the table.
    Returns the names written."""
    common.write_jsonl(out / "results.jsonl", results)
    write_summary(results, out / "summary.csv")
    written = ["results.jsonl", "summary.csv"]
    for field in ("score", "agree", "kl"):
        plot_vs_budget(results, out / f"{field}_vs_budget.png", field)
        written.append(f"{field}_vs_budget.png")
    mechanism_rows = aggregate_mechanism(sample_records)
    if mechanism_rows:
        write_csv(mechanism_rows, ["task", "policy", "budget", "layer", "survive", "select", "n",
                                   "n_select"], out / "mechanism.csv")
        plot_mechanism(mechanism_rows, out / "mechanism.png")
        written += ["mechanism.csv", "mechanism.png"]
    if "needle" in task_names:
        plot_needle_heatmaps([r for r in sample_records if r["task"] == "needle"],
                             out / "needle_heatmap.png")
        written.append("needle_heatmap.png")
    print_table(results, mechanism_rows)
    return written


def print_table(results, mechanism_rows) -> None:
    width = max([len("task")] + [len(r["task"]) for r in results]) + 2
    print(f"\n{'task':<{width}}{'policy':<22}{'budget':>7}{'score':>8}{'full':>8}{'agree':>7}"
          f"{'prefix':>8}{'kl':>8}{'peak MB':>9}{'n':>4}{'skip':>5}")
    for r in sorted(results, key=lambda r: (r["task"], r["policy"], str(r["budget"]))):
        print(f"{r['task']:<{width}}{r['policy']:<22}{r['budget']!s:>7}{r['score']:>8.3f}"
              f"{r['full_score']:>8.3f}{r['agree']:>7.2f}{r['agree_prefix']:>8.2f}"
              f"{r['kl']:>8.3f}{r.get('peak_rss_mb', float('nan')):>9.0f}{r['n']:>4}"
              f"{r.get('skipped', 0):>5}")
    if mechanism_rows:
        print(f"\n{'mechanism: task':<16}{'policy':<22}{'budget':>7}{'survive':>9}{'select':>8}"
              f"{'n':>4}  (means over layers)")
        groups = collections.defaultdict(list)
        for r in mechanism_rows:
            groups[(r["task"], r["policy"], str(r["budget"]))].append(r)
        def mean(values):   # "-": no sample had one (e.g. every answer began at prefill)
            values = [v for v in values if v is not None and not np.isnan(v)]
            return f"{np.mean(values):.3f}" if values else "-"
        for (task, policy, budget), rows in sorted(groups.items()):
            print(f"{task:<16}{policy:<22}{budget:>7}{mean(r['survive'] for r in rows):>9}"
                  f"{mean(r['select'] for r in rows):>8}{rows[0]['n']:>4}")
