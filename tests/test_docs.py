"""The docs hold together: every relative link in README.md and docs/*.md resolves, anchors included.

A link ``[text](path)`` or ``[text](path#anchor)`` must name a file or folder
that exists in the repository (relative to the page that links it), and an
``#anchor`` must be the slug of a heading in the target page. Slugs follow
GitHub's rule (lowercase, punctuation other than ``-`` and ``_`` dropped,
each space a ``-``, a repeated heading numbered ``-1``, ``-2``); mkdocs'
rule (which folds runs of spaces and hyphens) is accepted too, since the
same pages render on both. Links to other sites are not checked, nor is
anything inside code. Fast and without Ray: it reads files only.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 400

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto: ...


def doc_pages() -> list[Path]:
    """README.md and every page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    lines, in_fence = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            lines.append((number, line))
    return lines


def prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks with inline code blanked out: a link inside code is not a link."""
    return [(number, INLINE_CODE.sub("", line)) for number, line in outside_fences(text)]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation except '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's toc slugify (mkdocs' default): ASCII only, runs of spaces and '-' fold into one '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    """Every anchor a heading of ``path`` defines, under either slug rule."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in outside_fences(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        title = match.group(2).replace("`", "")
        for slug in (github_slug(title), mkdocs_slug(title)):
            found.add(slug)
        base = github_slug(title)
        count = seen.get(base, 0)
        if count:
            found.add(f"{base}-{count}")
        seen[base] = count + 1
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """One message per link of ``page`` that does not resolve: the page, its line, the link and what is missing."""
    problems = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}:{number}: link ({target})"
            if root not in (resolved, *resolved.parents):
                problems.append(f"{where} points outside the repository")
            elif not resolved.exists():
                problems.append(f"{where}: no file or folder {resolved.relative_to(root)}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where}: no heading with anchor #{anchor} in {resolved.relative_to(root)}")
    return problems


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_short() -> None:
    num_lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert num_lines <= README_MAX_LINES, (
        f"README.md has {num_lines} lines, more than {README_MAX_LINES}: move depth to docs/")


def nav_files(nav: list) -> list[str]:
    """Every file named in an mkdocs ``nav`` (nested sections flattened), links to other sites left out."""
    files = []
    for entry in nav:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            if isinstance(value, list):
                files.extend(nav_files(value))
            elif not EXTERNAL.match(value):
                files.append(value)
    return files


def test_mkdocs_nav_files_exist() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs_dir = ROOT / config.get("docs_dir", "docs")
    listed = nav_files(config["nav"])
    missing = [name for name in listed if not (docs_dir / name).is_file()]
    assert listed and not missing, f"mkdocs.yml nav names files missing under {docs_dir.name}/: {missing}"
    unlisted = sorted(p.relative_to(docs_dir).as_posix() for p in docs_dir.rglob("*.md"))
    assert not set(unlisted) - set(listed), f"docs pages not in mkdocs.yml nav: {sorted(set(unlisted) - set(listed))}"


def test_checker_finds_broken_links(tmp_path: Path) -> None:
    """The checker itself can fail: a missing file, a missing anchor and an escape are each reported."""
    (tmp_path / "target.md").write_text("# Real heading\n\n## Second: part `two`\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](target.md#real-heading) [ok2](target.md#second-part-two) [web](https://example.com/x.md)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](target.md#no-such) [up](../../outside.md)\n",
        encoding="utf-8",
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 3, problems
    assert "missing.md" in problems[0] and "#no-such" in problems[1] and "outside" in problems[2]
