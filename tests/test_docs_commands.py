"""Every command line in the README and docs/ names what exists: its verb, module or script,
each flag it passes (defined by the module's absl flags, read from the source), its flag file
and that file's flags, JSON where a flag takes JSON, and registered policy and model names.
Static: nothing is run, so a renamed flag or a deleted script is caught in a second instead of
by a reader. tests/test_cli.py runs every verb's --help."""
from __future__ import annotations

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
    """(doc, command words) for every `mpcache VERB ...`, `python -m ...` and
    `bash scripts/...` line."""
    found = []
    for doc in DOCS:
        for line in _code_lines(doc.read_text()):
            line = line.split(" # ")[0].split(" > ")[0].split(" | ")[0].lstrip("$ ")
            for part in re.split(r";|&&|\bdo\b|\bthen\b", line):
                part = part.strip()
                match = re.search(r"(?:^|\s)((?:\S*/)?mpcache [a-z-]+|python -m \S+|"
                                  r"bash scripts/\S+)(.*)$", part)
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
        if "cli.parse(" in path.read_text():
            continue                             # a verb with flags of its own
        names |= set(re.findall(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"", path.read_text()))
    return names


def _own_flags(source: str) -> set[str]:
    """The flags of a module that parses its own FlagValues (experiments/cli.py `parse`)."""
    return ABSL_BUILTIN | set(re.findall(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"", source))


def _module_and_flags(words: list[str]) -> tuple[str, list[str]]:
    """(module, flag words) of `mpcache VERB ...` or `python -m MODULE ...`."""
    from experiments.cli import VERBS

    if words[0].endswith("mpcache"):
        verb = VERBS.get(words[1])
        assert verb is not None, f"no verb {words[1]!r} (mpcache --help lists them)"
        extra = [f"--experiment={verb.experiment}"] if verb.experiment else []
        return verb.module, words[2:] + extra
    return words[2], words[3:]


def _flags_of(words: list[str]) -> list[tuple[str, str | None]]:
    out = []
    for word in words:
        if word.startswith("--"):
            name, _, value = word[2:].partition("=")
            out.append((name, value if "=" in word else None))
    return out


COMMANDS = _commands()
ABSL_FLAGS = _absl_flags()


def _variant_names() -> dict[str, set[str]]:
    """Per doc, the variant names its commands define: `mpcache pooled` pools those runs."""
    names: dict[str, set[str]] = {}
    for doc, words in COMMANDS:
        for name, value in _flags_of(words):
            if name == "variants" and value and not PLACEHOLDER.search(value):
                names.setdefault(doc, set()).update(json.loads(value))
    return names


DOC_VARIANTS = _variant_names()


def test_the_docs_hold_commands_to_check():
    modules = {_module_and_flags(w)[0] for _, w in COMMANDS if w[0] != "bash"}
    assert len(COMMANDS) > 100 and "experiments.run" in modules and len(modules) >= 10


@pytest.mark.parametrize("doc,words", COMMANDS, ids=lambda x: x if isinstance(x, str) else
                         " ".join(x)[:80])
def test_command_names_what_exists(doc, words):
    from models.registry import MODEL_NAMES
    from mpcache_jax.policies import POLICY_NAMES as POLICIES
    from mpcache_jax.primitives import parse_budget

    if words[0] == "bash":
        assert (ROOT / words[1]).is_file(), f"{doc}: {words[1]} does not exist"
        return
    module, flag_words = _module_and_flags(words)
    if module == "pytest":
        return
    path = ROOT / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"{doc}: no module {module}"
    source = path.read_text()
    absl = "app.run" in source           # the process-wide FLAGS (every other verb: its own)
    known = ABSL_FLAGS if absl else _own_flags(source)
    flags = _flags_of(flag_words)
    variants = {}
    for name, value in list(flags):
        if name == "flagfile" and not PLACEHOLDER.search(pathlib.Path(value).stem):
            flagfile = ROOT / value
            assert flagfile.is_file(), f"{doc}: flag file {value} does not exist"
            lines = [line.strip() for line in flagfile.read_text().splitlines()]
            flags += _flags_of([line for line in lines if line.startswith("--")])
        if name == "variants" and value:          # (empty: no variants)
            variants = json.loads(value)
        if name == "rename":                      # `mpcache pooled`: OLD:NEW names a policy
            variants.update({entry.rpartition(":")[2]: {} for entry in value.split(",")})
    if words[:2] == ["mpcache", "pooled"]:            # the runs of the doc's other commands
        variants.update(dict.fromkeys(DOC_VARIANTS.get(doc, ()), {}))
    for name, value in flags:
        bare = name[2:] if name.startswith("no") and name[2:] in known else name
        assert bare in known, f"{doc}: {module} has no flag --{name} ({' '.join(words)[:120]})"
        if not value or PLACEHOLDER.search(value):
            continue
        if name in JSON_FLAGS:
            json.loads(value)
        if name == "policies":
            for policy in value.split(","):
                # `mpcache pooled` names a policy run at several budgets POLICY@BUDGET
                policy, _, budget = policy.partition("@")
                assert policy in POLICIES or policy in variants, \
                    f"{doc}: policy {policy!r} is not registered ({' '.join(words)[:120]})"
                if budget:
                    parse_budget(budget)
        if name == "model" and "/" not in value:
            assert value in MODEL_NAMES, f"{doc}: model {value!r} is not registered"
