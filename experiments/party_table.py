"""Medians (or means) and full / other ratios of multi-process decode steps (`mpcache party`
and scripts/netns_3pc.sh runs).

    mpcache party-table results/tbf3c     # every results.jsonl under the folder
    mpcache party-table --statistic=mean results/parties_lan_2048_32

Groups the decode-step records of every run under the folder by (node config, prompt length,
policy) -- repeated runs of one configuration pool their steps -- and prints one markdown row
per group: steps, then the median (with --statistic=mean the mean: a policy whose steps differ
by design, such as refresh and reuse steps, costs its mean per token) of the measured wall per
step, the slowest party's CPU seconds, the counted bytes (summed over the parties) and
messages, the network model's LAN time, and the model plus the slowest party's CPU; where the
folder also holds simulated steps of the same prompt length and policy (`experiments.party
--compare_sim`), the cost model's prediction for the run's link (`link.shape` of its node
config: the LAN or WAN time of the simulated step, network model plus simulated compute).
Then, per node config and length, each policy's ratio to `full` (full / policy: above 1 means
cheaper than full).
Writes the rows to FOLDER/party_table.csv.
"""
from __future__ import annotations

import csv
import json
import pathlib
import statistics
import sys
from collections import defaultdict

from absl import flags

from experiments import cli

COLUMNS = ("node_config", "link", "prompt_tokens", "policy", "steps", "wall_s",
           "max_party_cpu_s", "comm_mb", "messages", "lan_network_s", "lan_network_plus_cpu_s",
           "model_s")
RATIOS = ("wall_s", "comm_mb", "lan_network_s", "lan_network_plus_cpu_s", "model_s")
# The simulated step's time under a link shape: network model + simulated compute.
MODEL_TIME = {"lan": "lan_total_s", "wan": "wan_total_s"}


def _link(results: pathlib.Path) -> str:
    """The run's `link.shape` ("lan", "wan", "custom") from the node config beside its
    results, or "-" (none, or no config there)."""
    config = results.parent / "node_config.json"
    if not config.is_file():
        return "-"
    shape = json.loads(config.read_text())["devices"]["SPU"]["config"].get("link", {}).get("shape")
    return shape if shape in MODEL_TIME else ("custom" if shape else "-")


def decode_steps(folder: pathlib.Path) -> dict[tuple, list[dict]]:
    """Measured decode steps (real parties) by (node config, link, prompt length, policy).
    A step copied into a second file (--compare_sim gathers the parties' records into its
    own results.jsonl) counts once, from the run folder that holds its node config."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    seen = set()
    paths = sorted(folder.rglob("results.jsonl"),
                   key=lambda p: (not (p.parent / "node_config.json").is_file(), str(p)))
    for path in paths:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        # The node config's id is in each run's closing summary record.
        config = next((r["node_config"] for r in records if r.get("summary")), path.parent.name)
        link = _link(path)
        for record in records:
            if record.get("phase") == "decode" and record.get("backend") != "spu_sim":
                copy = json.dumps(record, sort_keys=True)
                if copy in seen:
                    continue
                seen.add(copy)
                groups[(config, link, record["prompt_tokens"], record["policy"])].append(record)
    return groups


def simulated_steps(folder: pathlib.Path) -> dict[tuple, list[dict]]:
    """Simulated decode steps (spu_sim records) by (prompt length, policy)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for path in sorted(folder.rglob("results.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("phase") == "decode" and record.get("backend") == "spu_sim":
                groups[(record["prompt_tokens"], record["policy"])].append(record)
    return groups


STATISTICS = {"median": statistics.median, "mean": statistics.mean}


def summarize(groups: dict[tuple, list[dict]],
              simulated: dict[tuple, list[dict]] | None = None,
              statistic: str = "median") -> list[dict]:
    """One row per group: its steps' `statistic` ("median" or "mean") of each measured
    column; the simulated model time is the mean of the simulated steps."""
    centre = STATISTICS[statistic]
    rows = []
    for (config, link, T, policy), steps in sorted(groups.items()):
        cpu = [max(s["party_cpu_s"]) for s in steps]
        network = [s["lan_latency_s"] for s in steps]
        model = [s[MODEL_TIME[link]] for s in (simulated or {}).get((T, policy), [])
                 if link in MODEL_TIME]
        rows.append({
            "node_config": config, "link": link, "prompt_tokens": T, "policy": policy,
            "steps": len(steps),
            "wall_s": centre([s["wall_s"] for s in steps]),
            "max_party_cpu_s": centre(cpu),
            "comm_mb": centre([s["comm_bytes"] for s in steps]) / 1e6,
            "messages": centre([s["messages"] for s in steps]),
            "lan_network_s": centre(network),
            "lan_network_plus_cpu_s": centre([n + c for n, c in zip(network, cpu)]),
            "model_s": statistics.mean(model) if model else None,
        })
    return rows


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_tables(rows: list[dict]) -> str:
    lines = ["| node config | link | T | policy | steps | wall s (measured) | slowest party CPU s "
             "| comm MB | messages | modelled LAN network s | model + CPU s | model s (simulated, "
             "this link) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['node_config']} | {r['link']} | {r['prompt_tokens']} | "
                     f"`{r['policy']}` | {r['steps']} | {r['wall_s']:.3f} | "
                     f"{r['max_party_cpu_s']:.3f} | {r['comm_mb']:.2f} | {r['messages']:.0f} | "
                     f"{r['lan_network_s']:.3f} | {r['lan_network_plus_cpu_s']:.3f} | "
                     f"{_cell(r['model_s'], '.3f')} |")
    full = {(r["node_config"], r["prompt_tokens"]): r for r in rows if r["policy"] == "full"}
    ratio_lines = []
    for r in rows:
        base = full.get((r["node_config"], r["prompt_tokens"]))
        if base is None or r["policy"] == "full":
            continue
        cells = " | ".join("-" if base[k] is None or r[k] is None else f"{base[k] / r[k]:.2f}x"
                           for k in RATIOS)
        ratio_lines.append(f"| {r['node_config']} | {r['prompt_tokens']} | `{r['policy']}` | "
                           f"{cells} |")
    if ratio_lines:
        lines += ["", "| node config | T | full / policy | wall (measured) | comm | "
                      "modelled LAN network | model + CPU | model (simulated, this link) |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += ratio_lines
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    fv = flags.FlagValues()
    flags.DEFINE_enum("statistic", "median", sorted(STATISTICS),
                      "Each group's measured columns over its steps: median or mean.",
                      flag_values=fv)
    (name,) = cli.parse(fv, argv, __doc__, positional=("FOLDER",))
    folder = pathlib.Path(name)
    if not folder.is_dir():
        cli.usage_error(f"{folder} is not a folder (the output folder of the runs)")
    rows = summarize(decode_steps(folder), simulated_steps(folder), fv.statistic)
    if not rows:
        print(f"no decode-step records under {folder}", file=sys.stderr)
        return 1
    with open(folder / "party_table.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(format_tables(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
