"""What scripts/setup.sh and scripts/dev_requirements.sh install, checked with a stand-in
python that records its arguments instead of running pip (no network, no real venv): setup.sh
installs the runtime pins only and the `mpcache` command (the project itself, no dependencies),
the test references come with the test command, and both skip pip once their hash stamp
matches."""
import pathlib
import shutil
import stat
import subprocess

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../../calls.log"
case "$*" in *" -e ."*) printf '#!/bin/sh\\n' > "$(dirname "$0")/mpcache"
                        chmod +x "$(dirname "$0")/mpcache";; esac   # what pip's install makes
exit 0
"""


def fake_repo(tmp_path: pathlib.Path) -> pathlib.Path:
    """The scripts and requirement files in a scratch tree whose .venv/bin/python logs calls."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "dev_requirements.sh"):
        shutil.copy(REPO_ROOT / "scripts" / name, repo / "scripts" / name)
    for name in ("requirements.txt", "requirements-dev.txt"):
        shutil.copy(REPO_ROOT / name, repo / name)
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return repo


def run(repo: pathlib.Path, script: str) -> list[str]:
    """Run a script -> the stand-in python's calls so far (one string each)."""
    proc = subprocess.run(["bash", f"scripts/{script}"], cwd=repo, capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(repo / ".venv/bin/python")})
    assert proc.returncode == 0, proc.stderr
    log = repo / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def pip_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip install")]


def test_setup_installs_the_runtime_pins_only(tmp_path):
    repo = fake_repo(tmp_path)
    calls = pip_calls(run(repo, "setup.sh"))
    assert len(calls) == 2 and calls[0].endswith("-r requirements.txt")
    assert calls[1].endswith("--no-deps -e .")                  # the command, no dependencies
    assert "requirements-dev.txt" not in calls[0]
    runtime = (REPO_ROOT / "requirements.txt").read_text()
    for reference in ("torch", "transformers", "accelerate", "pytest"):
        assert reference not in runtime
    assert len(pip_calls(run(repo, "setup.sh"))) == 2       # stamp and command there: no pip


def test_dev_requirements_install_once_with_the_runtime_pins(tmp_path):
    repo = fake_repo(tmp_path)
    calls = pip_calls(run(repo, "dev_requirements.sh"))
    assert len(calls) == 1
    assert calls[0].endswith("-r requirements.txt -r requirements-dev.txt")
    assert len(pip_calls(run(repo, "dev_requirements.sh"))) == 1   # idempotent
    with open(repo / "requirements-dev.txt", "a") as f:              # a pin changes
        f.write("# changed\n")
    assert len(pip_calls(run(repo, "dev_requirements.sh"))) == 2


def test_dev_requirements_without_a_venv_says_what_to_run(tmp_path):
    repo = fake_repo(tmp_path)
    shutil.rmtree(repo / ".venv")
    proc = subprocess.run(["bash", "scripts/dev_requirements.sh"], cwd=repo, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "run bash scripts/setup.sh first" in proc.stderr


def test_pyproject_reads_the_pins():
    import tomllib
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    dynamic = project["tool"]["setuptools"]["dynamic"]
    assert dynamic["dependencies"] == {"file": ["requirements.txt"]}
    assert dynamic["optional-dependencies"]["dev"] == {"file": ["requirements-dev.txt"]}
    assert dynamic["optional-dependencies"]["kvpress"] == {"file": ["requirements-kvpress.txt"]}
    assert project["project"]["scripts"]["mpcache"] == "experiments.cli:entry"
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-kvpress.txt"):
        lines = (REPO_ROOT / name).read_text().splitlines()
        assert not any(line.startswith("-") for line in lines), f"{name}: setuptools reads no options"
