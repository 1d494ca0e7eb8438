"""Every relative link between the README and the pages of docs/ resolves: the file exists and, for a link with a
``#fragment`` into a markdown file, so does the heading; every ``docs/...md`` named in their text exists."""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "jobs" / "README.md",
                *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
MENTION = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md)\b")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (their ``#`` lines are not headings, their brackets not links)."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page``: lower case, punctuation dropped, spaces as hyphens, -1, -2 on repeats."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", _prose(page.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_pages_exist():
    for name in ("benchmarks", "library", "config", "operations", "cluster", "design"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), f"docs/{name}.md is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = unquote(target).partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            bad.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: broken links:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_docs_pages_exist(page):
    named = set(MENTION.findall(page.read_text(encoding="utf-8")))
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"{page.relative_to(ROOT)} names pages that do not exist: {missing}"
