"""Build the parties' front door in C (runtime/distributed/fast_front.c) for plain-TCP runs.

    python scripts/build_fast_front.py            # beside this venv's python (scripts/setup.sh)
    python scripts/build_fast_front.py BINARY     # at BINARY (tests, benchmarks, fault cases)

Compiles with cc and OpenSSL's libcrypto, and writes BINARY.sha256 beside it: the hash of the
source it was built from, which the runtime checks before running it
(runtime/distributed/fast_front.py: where the build goes, the hash). Without an argument it
builds only when the build there is not of this source, and always exits 0 (without a C
compiler every party runs front.py: the same checks, more CPU per frame); with BINARY it
exits 1 and says why when it cannot build.
"""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import tempfile

FINDER = pathlib.Path(__file__).resolve().parents[1] / "runtime" / "distributed" / "fast_front.py"


def load_finder():
    """runtime/distributed/fast_front.py (standard library only), without the package."""
    spec = importlib.util.spec_from_file_location("fast_front", FINDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(binary: pathlib.Path, finder) -> str | None:
    """Compile fast_front.c into `binary`, and beside it `binary`.sha256 naming the source it
    was built from -> None, or why it could not."""
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=binary.parent) as scratch:
        built = pathlib.Path(scratch) / binary.name
        try:
            made = subprocess.run(["cc", "-O2", "-pthread", "-o", str(built),
                                   str(finder.FAST_FRONT_SOURCE), "-lcrypto"],
                                  capture_output=True, text=True)
        except OSError as err:
            return f"no C compiler ({err.strerror})"
        if made.returncode != 0:
            last = made.stderr.strip().splitlines()[-1:]
            if not last:
                return "cc failed"
            return "cc failed (OpenSSL's headers, Debian's libssl-dev?): " + last[0][:300]
        built.replace(binary)
    pathlib.Path(f"{binary}.sha256").write_text(finder.fast_front_source_hash() + "\n")
    return None


def main(argv: list[str]) -> int:
    finder = load_finder()
    if len(argv) == 2:
        why = build(pathlib.Path(argv[1]), finder)
        if why:
            print(why, file=sys.stderr)
        return 1 if why else 0
    binary = finder.installed_fast_front()
    if finder.built_from_hash(binary) == finder.fast_front_source_hash():
        print(f"setup: the parties' front in C is up to date ({binary})")
        return 0
    why = build(binary, finder)
    if why:
        print(f"setup: the parties' front in C was not built ({why}); every party runs "
              "front.py: the same checks, about twice the CPU per relayed frame")
    else:
        print(f"setup: built the parties' front in C for plain-TCP runs ({binary})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
