"""Every command line in the README and docs/ names what exists: its module or script, each
flag it passes (defined by the module's absl flags or argparse arguments, read from the
source), its flag file and that file's flags, JSON where a flag takes JSON, and registered
policy and model names. Static: nothing is run, so a renamed flag or a deleted script is
caught in a second instead of by a reader."""
from __future__ import annotations

import ast
import json
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "WORKSPACE.md", *sorted((ROOT / "docs").glob("*.md"))]
# absl's own flags, accepted by every absl entry point
ABSL_BUILTIN = {"flagfile", "undefok", "helpfull", "help", "helpshort", "logtostderr",
                "alsologtostderr", "v", "verbosity", "log_dir", "only_check_args"}
JSON_FLAGS = {"variants", "job"}
# placeholders a reader replaces (`--model=PATH`, `--policies=<the sum>`)
PLACEHOLDER = re.compile(r"[<>]|^[A-Z_]+$|\$")


def _code_lines(text: str) -> list[str]:
    """Command lines of fenced and 4-space-indented code blocks, continuations joined."""
    lines, fenced, out = text.splitlines(), False, []
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            out.append(line.strip())
    joined, buffer = [], ""
    for line in out:
        buffer = f"{buffer} {line[:-1]}" if line.endswith("\\") else f"{buffer} {line}"
        if not line.endswith("\\"):
            joined.append(buffer.strip())
            buffer = ""
    return joined


def _commands():
    """(doc, command words) for every `python -m ...` and `bash scripts/...` line."""
    found = []
    for doc in DOCS:
        for line in _code_lines(doc.read_text()):
            line = line.split(" # ")[0].split(" > ")[0].split(" | ")[0].lstrip("$ ")
            for part in re.split(r";|&&|\bdo\b|\bthen\b", line):
                part = part.strip()
                match = re.search(r"(?:^|\s)(python -m \S+|bash scripts/\S+)(.*)$", part)
                if match:
                    try:
                        words = shlex.split(match.group(1) + match.group(2))
                    except ValueError:           # a quote closed on a later line: skip
                        continue
                    found.append((doc.name, words))
    return found


def _absl_flags() -> set[str]:
    names = set(ABSL_BUILTIN)
    for path in [*(ROOT / "experiments").glob("*.py"), *(ROOT / "runtime").rglob("*.py")]:
        names |= set(re.findall(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"", path.read_text()))
    return names


def _argparse_flags(path: pathlib.Path) -> set[str]:
    """Options a module's argparse parser accepts (its --name strings; --no-name too for a
    BooleanOptionalAction)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                    names.add(str(arg.value)[2:])
                    if any(isinstance(k.value, ast.Attribute) and
                           k.value.attr == "BooleanOptionalAction" for k in node.keywords):
                        names.add("no-" + str(arg.value)[2:])
    return names


def _flags_of(words: list[str]) -> list[tuple[str, str | None]]:
    out = []
    for word in words:
        if word.startswith("--"):
            name, _, value = word[2:].partition("=")
            out.append((name, value if "=" in word else None))
    return out


COMMANDS = _commands()
ABSL_FLAGS = _absl_flags()


def test_the_docs_hold_commands_to_check():
    modules = {w[2] for _, w in COMMANDS if w[0] == "python"}
    assert len(COMMANDS) > 100 and "experiments.run" in modules and len(modules) >= 10


@pytest.mark.parametrize("doc,words", COMMANDS, ids=lambda x: x if isinstance(x, str) else
                         " ".join(x)[:80])
def test_command_names_what_exists(doc, words):
    from models.registry import MODEL_NAMES
    from mpcache_jax.policies import POLICY_NAMES as POLICIES

    if words[0] == "bash":
        assert (ROOT / words[1]).is_file(), f"{doc}: {words[1]} does not exist"
        return
    module = words[2]
    if module == "pytest":
        return
    path = ROOT / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"{doc}: no module {module}"
    source = path.read_text()
    absl = "absl" in source and "app.run" in source
    known = ABSL_FLAGS if absl else _argparse_flags(path)
    flags = _flags_of(words[3:])
    variants = {}
    for name, value in list(flags):
        if name == "flagfile" and not PLACEHOLDER.search(pathlib.Path(value).stem):
            flagfile = ROOT / value
            assert flagfile.is_file(), f"{doc}: flag file {value} does not exist"
            lines = [line.strip() for line in flagfile.read_text().splitlines()]
            flags += _flags_of([line for line in lines if line.startswith("--")])
        if name == "variants" and value:          # (empty: no variants)
            variants = json.loads(value)
    if not absl and "sys.argv" in source and not known:
        return                                     # positional arguments only
    for name, value in flags:
        bare = name[2:] if absl and name.startswith("no") and name[2:] in known else name
        assert bare in known, f"{doc}: {module} has no flag --{name} ({' '.join(words)[:120]})"
        if not value or PLACEHOLDER.search(value):
            continue
        if name in JSON_FLAGS:
            json.loads(value)
        if name == "policies":
            for policy in value.split(","):
                assert policy in POLICIES or policy in variants, \
                    f"{doc}: policy {policy!r} is not registered ({' '.join(words)[:120]})"
        if name == "model" and absl and "/" not in value:
            assert value in MODEL_NAMES, f"{doc}: model {value!r} is not registered"
