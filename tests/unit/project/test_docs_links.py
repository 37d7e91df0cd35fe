"""Every relative link in README.md and docs/*.md points to a file of the repository, and every
#anchor to a heading of the page it names, by GitHub's slug rules. External links are not
fetched."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+).*?\1")
# [text](target "title") and ![alt](target); the target has no spaces or is in <...>.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text, lowercased, every character that
    is not a letter, digit, space, '-' or '_' dropped, spaces turned into '-'."""
    text = LINK_TEXT.sub(r"\1", heading).replace("`", "").replace("*", "")
    kept = "".join(ch for ch in text.lower() if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(page.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    found = []
    for line in prose_lines(page.read_text()):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append(match.group(1).strip("<>"))
    return found


def test_slug_follows_github() -> None:
    assert slug("The API (`llama_grpc.v1.LlmService`)") == "the-api-llama_grpcv1llmservice"
    assert slug("Local models: `llama-grpc models`") == "local-models-llama-grpc-models"
    assert slug("Sessions that survive: the KV tiers") == "sessions-that-survive-the-kv-tiers"
    assert slug("Without a proxy: client-side load balancing") == (
        "without-a-proxy-client-side-load-balancing"
    )


def test_repeated_headings_are_numbered(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# A\n## Notes\n```sh\n# Notes\n```\n## Notes\n### Notes\n")
    assert anchors(page) == {"a", "notes", "notes-1", "notes-2"}


def test_links_skip_code(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text('[a](x.md#y) `[b](c.md)`\n```\n[d](e.md)\n```\n![i](img.png "t")\n')
    assert links(page) == ["x.md#y", "img.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s):, mailto: ...: not fetched
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT) or not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert broken == []
