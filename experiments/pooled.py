"""Task scores of several fidelity runs pooled into one table, each policy beside a reference.

    mpcache pooled --runs=results/qa_2048,results/lb_2048 [--reference=full] [--rename=d8r3:mpcache]

Reads samples.jsonl of every run folder given (runs of one model and one --lengths; each
may hold other tasks, other samples of a task (another --seed or data file), or other
policies on the same samples).
A task's score is the mean over all its samples in those runs; the pooled score is the mean
over the scored tasks (each task weighs the same, however many samples it has), over the
tasks every listed policy has. Perplexity tasks (metric "ppl") are kept apart: a policy's
mean perplexity and its ratio to the reference's.

Beside each policy: the pooled score's ratio to the reference's with a 90% interval from a
paired bootstrap (the samples of each task and seed or data file are drawn with
replacement, the same draw for every policy: the scores pair sample by sample), and per
task the samples where the policy scored above / below the reference. The interval
says how far the samples pin the ratio down; it is not a test of the held-out tasks.
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
from collections import defaultdict

import numpy as np
from absl import flags

from experiments import accuracy_report, cli, task_registry
from mpcache_jax.primitives import budget_label

PPL_METRICS = ("ppl",)


def _define(fv: flags.FlagValues) -> None:
    flags.DEFINE_list("runs", None, "fidelity run folders (each with samples.jsonl)",
                      flag_values=fv)
    flags.DEFINE_string("reference", "full", "the policy every other is compared with",
                        flag_values=fv)
    flags.DEFINE_list("rename", [], "OLD:NEW policy names, for runs that named one policy "
                      "differently (a variant of the same settings)", flag_values=fv)
    flags.DEFINE_list("policies", [], "policies to show, in this order (default: all)",
                      flag_values=fv)
    flags.DEFINE_integer("resamples", 2000, "bootstrap draws of the samples", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "the bootstrap's seed", flag_values=fv)
    flags.DEFINE_string("out", None, "also write the table's rows as CSV here", flag_values=fv)
    flags.mark_flag_as_required("runs", flag_values=fv)


def parse_renames(entries: list[str]) -> dict:
    """--rename entries -> {(folder or None, old): new}. "OLD:NEW" renames in every run,
    "FOLDER/OLD:NEW" in that run only (policy names hold no "/")."""
    renames = {}
    for entry in entries:
        where, _, pair = entry.rpartition("/")
        old, sep, new = pair.partition(":")
        if not sep or not old or not new:
            raise ValueError(f"--rename={entry}: give OLD:NEW or FOLDER/OLD:NEW, e.g. "
                             "d8r3:mpcache")
        renames[(str(pathlib.Path(where)) if where else None, old)] = new
    return renames


def load_runs(folders: list[str], renames: dict | None = None) -> list[dict]:
    """The per-sample records of every run, policies renamed (`parse_renames`); a policy
    found at several budgets becomes one policy per budget, named POLICY@BUDGET. Each record
    is tagged with its samples' source ("source": the --seed, or the data file of a task that
    reads one) and its run ("folder"), so that runs of the same samples with other policies
    line up sample by sample, and runs of other samples add to them. A sample x policy found
    in two runs counts once when both scored it the same, and is refused when they did not
    (other code or settings). Refuses runs of different models or --lengths (their scores do
    not pool) and a folder without samples.jsonl."""
    renames = renames or {}
    known = {str(pathlib.Path(f)) for f in folders}
    for where, old in renames:
        if where is not None and where not in known:
            raise ValueError(f"--rename: {where} is not one of --runs")
    records, seen = [], {}
    for name in folders:
        folder = pathlib.Path(name)
        path = folder / "samples.jsonl"
        if not path.exists():
            raise ValueError(f"--runs: {path} does not exist (the folder of a finished "
                             "fidelity run: its --output_dir)")
        config_path = folder / "run_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        for key in ("model", "lengths"):
            value = config.get(key)
            if key in seen and value != seen[key][0]:
                raise ValueError(f"--runs: {folder} has --{key}={value}, {seen[key][1]} has "
                                 f"{seen[key][0]}; pool runs of one model and one length")
            seen.setdefault(key, (value, folder))
        for line in path.read_text().splitlines():
            if not line:
                continue
            record = json.loads(line)
            data = (config.get("data_path") if record["task"] in task_registry.DATA_PATH_TASKS
                    else None)
            record["source"] = f"--data_path={data}" if data else f"--seed={config.get('seed')}"
            record["folder"] = str(folder)
            old = record["policy"]
            record["policy"] = renames.get((str(folder), old), renames.get((None, old), old))
            records.append(record)
    # a policy run at several budgets: one row per budget, named policy@budget
    budgets = defaultdict(set)
    for record in records:
        budgets[record["policy"]].add(record.get("budget"))
    first, kept = {}, []
    for record in records:
        if len(budgets[record["policy"]]) > 1:
            budget = record.get("budget")
            record["policy"] = f"{record['policy']}@{budget_label(budget)}"
        key = (record["source"], record["task"], record["sample_id"], record["policy"])
        if key in first:
            earlier = first[key]
            if earlier["score"] != record["score"] or earlier["folder"] == record["folder"]:
                raise ValueError(
                    f"{record['policy']} on {record['task']} sample {record['sample_id']} "
                    f"({record['source']}): {earlier['score']:g} in {earlier['folder']}, "
                    f"{record['score']:g} in {record['folder']}; runs of one sample disagree "
                    "(other code or settings?), or one run holds two budgets of a renamed "
                    "policy")
            continue
        first[key] = record
        kept.append(record)
    return kept


def _tables(records: list[dict]):
    """scores[policy][(samples' source, task, sample_id)] -> score, fields[policy][key] ->
    {agree, kl}, and each task's metric."""
    scores, fields, metric = defaultdict(dict), defaultdict(dict), {}
    for r in records:
        key = (r["source"], r["task"], r["sample_id"])
        scores[r["policy"]][key] = float(r["score"])
        fields[r["policy"]][key] = {f: r.get(f) for f in ("agree", "kl")}
        metric[r["task"]] = r.get("metric")
    return scores, fields, metric


def summarize(records: list[dict], reference: str = "full", policies: list[str] = (),
              resamples: int = 2000, seed: int = 0) -> tuple[list[dict], list[str]]:
    """One row per policy: each scored task's mean (and n), the pooled score, its ratio to the
    reference's with a 90% paired-bootstrap interval, wins/losses per task against the
    reference, mean agreement and KL, mean perplexity and its ratio. Every number is over the
    samples every shown policy has (a run without one of them adds nothing to the table).
    Returns (rows, tasks pooled)."""
    scores, fields, metric = _tables(records)
    if reference not in scores:
        raise ValueError(f"--reference={reference}: no records of it in the runs (policies: "
                         f"{', '.join(sorted(scores))})")
    order = list(policies) or [reference] + sorted(p for p in scores if p != reference)
    if reference not in order:
        order = [reference, *order]
    missing = [p for p in order if p not in scores]
    if missing:
        raise ValueError(f"--policies: {', '.join(missing)} not in the runs (policies: "
                         f"{', '.join(sorted(scores))})")
    shared = set.intersection(*(set(scores[p]) for p in order))
    # strata: the samples of one source (seed or data file) and task; the bootstrap draws
    # within each
    strata = defaultdict(list)
    for key in sorted(shared):
        strata[(key[0], key[1])].append(key)
    tasks = sorted({task for _, task in strata})
    pooled_tasks = [t for t in tasks if metric.get(t) not in PPL_METRICS]
    ppl_tasks = [t for t in tasks if metric.get(t) in PPL_METRICS]
    if not pooled_tasks and not ppl_tasks:
        raise ValueError(f"no sample has records of every one of {', '.join(order)}")
    rng = np.random.default_rng(seed)
    draws = {s: rng.integers(0, len(keys), size=(resamples, len(keys)))
             for s, keys in strata.items()}

    def task_means(policy, bootstrap=False):
        """{task: mean score} over the shared samples ([resamples] arrays when bootstrap)."""
        sums, counts = defaultdict(float), defaultdict(int)
        for s, keys in strata.items():
            values = np.array([scores[policy][k] for k in keys])
            sums[s[1]] = sums[s[1]] + (values[draws[s]].sum(axis=1) if bootstrap
                                       else values.sum())
            counts[s[1]] += len(keys)
        return {t: sums[t] / counts[t] for t in tasks}

    def pooled(means):
        return sum(means[t] for t in pooled_tasks) / len(pooled_tasks) \
            if pooled_tasks else math.nan

    ref_means = task_means(reference)
    ref_pooled = pooled(ref_means)
    ref_draws = pooled(task_means(reference, True)) if pooled_tasks and resamples else None
    ref = scores[reference]
    task_keys = {t: [k for s, ks in strata.items() if s[1] == t for k in ks] for t in tasks}
    rows = []
    for p in order:
        means = task_means(p)
        row = {"policy": p}
        for t, keys in task_keys.items():
            row[t] = float(means[t])
            row[f"{t}_n"] = len(keys)
            if t in pooled_tasks:
                row[f"{t}_wins"] = sum(scores[p][k] > ref[k] for k in keys)
                row[f"{t}_losses"] = sum(scores[p][k] < ref[k] for k in keys)
            else:
                row[f"{t}_ratio"] = float(means[t] / ref_means[t])
        row["pooled"] = float(pooled(means))
        row["ratio"] = row["pooled"] / ref_pooled if ref_pooled else math.nan
        row["ratio_lo"] = row["ratio_hi"] = math.nan
        if ref_draws is not None and p != reference and ref_pooled:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = pooled(task_means(p, True)) / ref_draws
            ratios = ratios[np.isfinite(ratios)]
            if ratios.size:
                row["ratio_lo"], row["ratio_hi"] = (float(x) for x in
                                                    np.quantile(ratios, [0.05, 0.95]))
        for field in ("agree", "kl"):      # over the pooled tasks' samples
            values = [fields[p][k][field] for t in pooled_tasks for k in task_keys[t]
                      if fields[p][k][field] is not None]
            row[field] = sum(values) / len(values) if values else math.nan
        rows.append(row)
    return rows, pooled_tasks


def _cell(value, digits=3):
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.{digits}f}"


def format_table(rows: list[dict], pooled_tasks: list[str], reference: str) -> str:
    ppl = sorted({k[:-6] for r in rows for k in r if k.endswith("_ratio") and k != "ratio"})
    head = ["policy", *pooled_tasks, "pooled", f"/ {reference} [90%]", "agree", "KL", *ppl]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r['policy']}`"]
        for t in pooled_tasks:
            vs = (f" (+{r[f'{t}_wins']} -{r[f'{t}_losses']})"
                  if r["policy"] != reference else "")
            cells.append(f"{_cell(r[t])}{vs}")
        cells.append(_cell(r["pooled"]))
        interval = (f" [{_cell(r['ratio_lo'], 2)}, {_cell(r['ratio_hi'], 2)}]"
                    if not math.isnan(r["ratio_lo"]) else "")
        cells.append(f"{_cell(r['ratio'], 2)}x{interval}")
        cells += [_cell(r["agree"], 2), _cell(r["kl"])]
        cells += [f"{_cell(r[t], 2)} ({_cell(r[f'{t}_ratio'])}x)" for t in ppl]
        lines.append("| " + " | ".join(cells) + " |")
    sizes = ", ".join(f"{t} {rows[0][f'{t}_n']}" for t in [*pooled_tasks, *ppl])
    lines.append(f"\nsamples per task: {sizes}; (+wins -losses): samples scored above / below "
                 f"`{reference}`")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    fv = flags.FlagValues()
    _define(fv)
    cli.parse(fv, argv, __doc__)
    try:
        records = load_runs(fv.runs, parse_renames(fv.rename))
        rows, pooled_tasks = summarize(records, fv.reference, fv.policies, fv.resamples,
                                       fv.seed)
    except ValueError as err:
        cli.usage_error(str(err))
    print(format_table(rows, pooled_tasks, fv.reference))
    if fv.out:
        accuracy_report.write_csv(rows, list(rows[0]), fv.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
