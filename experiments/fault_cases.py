"""Every bad-input and fault case of the multi-party side, run for real, as one markdown table.

    mpcache fault-cases --output_dir=results/fault_cases
    mpcache fault-cases --only=tls,launcher      # cases whose name contains these

This file is the runner; the cases are data in experiments/faults/ (cases.py: the list,
`all_cases()`; kinds.py: how each kind runs; forge.py: what a hostile peer sends; harness.py:
running parties, shared with the tests). Each case is an object with `name`, `did` (what was
done), `expected` and `run(ctx)` -> `Observed` (exit codes, the error line that explains it,
time to detect, pass/fail). Kinds: `WireCase` (a forged message decoded in this process), `ConfigCase` (the
`experiments.party` CLI on a bad node config: exit 2 before any party starts), `PartiesCase`
(real party processes on loopback, some with patched code or certificates, a fault injected)
and `LauncherSignalCase` (a signal to `experiments.party --party=all`). CLI cases of other
commands can be added as more entries (any object with name / did / expected / run).

Writes OUTPUT_DIR/fault_cases.md (the table) and fault_cases.jsonl (one record per case);
every case's files (configs, certificates, party logs) are under OUTPUT_DIR/cases/<name>/.
A hostile party is simulated by running its worker with a Python prelude that patches its
code (skips its own checks, or sends a pickle / a forged share): exactly what a party that
controls its own machine can do. The pickles are built as bytes and never loaded here.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

from absl import flags

from experiments import cli

from experiments.faults.cases import all_cases
from experiments.faults.kinds import Context, Observed, short

# ----- running and reporting ---------------------------------------------------------------------

def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(rows: list[tuple]) -> str:
    """Markdown table of (case, observed) pairs."""
    head = ("| case | what was done | observed: exit | observed: error line | time to detect "
            "| expected | result |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for case, obs in rows:
        took = "-" if obs.detect_s is None else (f"{obs.detect_s * 1000:.1f} ms"
                                                 if obs.detect_s < 0.5 else
                                                 f"{obs.detect_s:.1f} s")
        if obs.detect_s is not None and obs.detect_from:
            took += f" ({obs.detect_from})"
        result = "pass" if obs.passed else "FAIL"
        if obs.note:
            result += f" ({obs.note})"
        lines.append("| " + " | ".join(_cell(x) for x in (
            case.name, case.did, obs.exit_codes, short(obs.error), took, case.expected,
            result)) + " |")
    return "\n".join(lines)


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("output_dir", "results/fault_cases", "records and fault_cases.md",
                        flag_values=fv)
    flags.DEFINE_string("only", "", "comma-separated substrings of case names", flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    args = _flags()
    cli.parse(args, argv, __doc__)
    root = pathlib.Path(args.output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    ctx = Context(root)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    cases = [c for c in all_cases() if not wanted or any(w in c.name for w in wanted)]
    rows = []
    records = root / "fault_cases.jsonl"
    start = time.perf_counter()
    with open(records, "w") as f:
        for case in cases:
            t = time.perf_counter()
            try:
                obs = case.run(ctx)
            except Exception as err:  # noqa: BLE001 - one broken case must not hide the rest
                obs = Observed("-", f"case error: {type(err).__name__}: {err}", None, False)
            rows.append((case, obs))
            f.write(json.dumps({"case": case.name, "did": case.did, "expected": case.expected,
                                **dataclasses.asdict(obs), "case_s": time.perf_counter() - t})
                    + "\n")
            f.flush()
            took = time.perf_counter() - t
            print(f"{'pass' if obs.passed else 'FAIL'}  {case.name}  ({took:.1f} s)  "
                  f"{short(obs.error, 160)}", flush=True)
    text = table(rows)
    passed = sum(obs.passed for _, obs in rows)
    summary = (f"{passed}/{len(rows)} cases pass ({time.perf_counter() - start:.0f} s; "
               f"`mpcache fault-cases --output_dir={args.output_dir}`)")
    (root / "fault_cases.md").write_text(text + "\n\n" + summary + "\n")
    print()
    print(text)
    print()
    print(summary)
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
