"""Every relative link in the README, WORKSPACE.md and docs/ reaches a file of the repo and,
where it names a heading (#anchor), a heading of that file, with anchors made as GitHub
makes them (lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats) or
named by an explicit <a id="...">."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "WORKSPACE.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        out |= set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", line))     # explicit anchors
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def _links():
    found = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):          # http:, https:, mailto:
                continue
            found.append((doc, target))
    return found


def test_anchors_follow_githubs_rule():
    doc = ROOT / "docs" / "design.md"
    assert "the-default-a-working-set-mpcache_jaxpoliciesworking_setpy" in anchors(doc)


@pytest.mark.parametrize("doc,target", _links(),
                         ids=lambda x: x.name if isinstance(x, pathlib.Path) else x[:60])
def test_relative_link_reaches_its_file_and_heading(doc, target):
    path, _, anchor = target.partition("#")
    file = (doc.parent / path).resolve() if path else doc
    assert file.exists(), f"{doc.name}: link to {target}: no file {path}"
    if anchor and file.suffix == ".md":
        assert anchor in anchors(file), f"{doc.name}: link to {target}: no such heading"
