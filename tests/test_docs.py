"""The README stays a front door and the docs' links lead somewhere.

README.md is held to 300 lines (measurement narratives belong in docs/), and every relative
markdown link in README.md and docs/*.md must name a file or folder inside the repository --
a link that climbs out of it (the seed once sat at `../shared/...`) is broken in every clone
-- and, where it carries a `#fragment`, a heading of that file, slugged as GitHub slugs them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); link text may hold one level of brackets.
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """The text with code blocks and code spans removed: what they hold is not a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    prose = _prose(text)
    return [m.group(1) for m in _INLINE.finditer(prose)] + [m.group(1) for m in _REFERENCE.finditer(prose)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "")  # code spans and emphasis render as their text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of `path` (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in links(doc.read_text(encoding="utf-8")):
        if _EXTERNAL.match(target):
            continue
        path_part, _, fragment = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if not dest.is_relative_to(root):
            problems.append(f"{target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{target}: no heading #{fragment} in {dest.relative_to(root)}")
    return problems


def test_readme_is_at_most_300_lines():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move narrative to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_relative_links_resolve(doc: Path):
    assert broken_links(doc) == []


def test_the_checker_catches_what_it_must(tmp_path: Path):
    """The checker itself, on a small repository of its own: a link out of the repository, a
    missing file, a missing heading and a missing reference target are reported; code,
    external links, folders and existing headings are not."""
    root = tmp_path / "repo"
    (root / "docs" / "results").mkdir(parents=True)
    (tmp_path / "outside.md").write_text("# outside\n", encoding="utf-8")  # exists, but not in the repository
    (root / "README.md").write_text("# Read me\n## Usage: `max_num_seqs`\n## Usage: `max_num_seqs`\n", encoding="utf-8")
    doc = root / "docs" / "probe.md"
    doc.write_text(
        "# A heading, with `code` & punctuation!\n"
        "[ok](../README.md) [self](#a-heading-with-code--punctuation) ![img](results/)\n"
        "[again](../README.md#usage-max_num_seqs-1)\n"
        "[out](../../outside.md) [gone](nope.md) [bad anchor](../README.md#no-such)\n"
        "`[in code](nope.md)` [web](https://example.com/x.md)\n"
        "```\n[fenced](nope.md)\n```\n"
        "[ref]: missing-ref.md\n", encoding="utf-8")
    problems = broken_links(doc, root)
    assert [p.split(":")[0] for p in problems] == ["../../outside.md", "nope.md", "../README.md#no-such",
                                                   "missing-ref.md"], problems
    assert slug("The seed's question 3: a long prompt and everyone's P95") == \
        "the-seeds-question-3-a-long-prompt-and-everyones-p95"
