"""The docs are self-contained: every link in README.md and docs/*.md points at a file of this
repository (and at a heading that exists there), every docs page can be reached from README.md or
docs/README.md, and nothing cites the design briefs that lived outside the repository."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
INDEXES = [ROOT / "README.md", ROOT / "docs" / "README.md"]
# Design briefs once kept beside the checkout; the repository's own pages replace them.
OUTSIDE_BRIEFS = ("DESIGN.md", "ALGORITHMS.md")
WEB_SCHEMES = ("http://", "https://", "mailto:")

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(page):
    """The page's lines outside fenced code blocks, where markdown is rendered."""
    inside_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            inside_fence = not inside_fence
        elif not inside_fence:
            yield line


def links(page):
    """Every link and image target on the page, in order."""
    return [target for line in prose_lines(page) for target in _LINK.findall(_INLINE_CODE.sub("", line))]


def heading_anchors(page):
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces
    as hyphens, and -1, -2, ... for repeats."""
    anchors, seen = set(), {}
    for line in prose_lines(page):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(2).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(page):
    return [target for target in links(page) if not target.startswith(WEB_SCHEMES)]


def resolve(page, target):
    """(file the link names, anchor or None); a bare #anchor names the page itself."""
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    return file, anchor or None


def page_id(page):
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_stay_inside_the_repository(page):
    escaping = [
        target
        for target in relative_links(page)
        if not resolve(page, target)[0].is_relative_to(ROOT) or target.startswith("/")
    ]
    assert not escaping, f"{page_id(page)} links outside the repository: {escaping}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_name_files_that_exist(page):
    broken = [target for target in relative_links(page) if not resolve(page, target)[0].is_file()]
    assert not broken, f"{page_id(page)} links to files that do not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_anchors_name_headings_of_the_linked_page(page):
    broken = []
    for target in relative_links(page):
        file, anchor = resolve(page, target)
        if anchor and file.suffix == ".md" and file.is_file() and anchor not in heading_anchors(file):
            broken.append(target)
    assert not broken, f"{page_id(page)} links to headings that do not exist: {broken}"


def test_every_docs_page_is_linked_from_an_index():
    linked = {resolve(index, target)[0] for index in INDEXES for target in relative_links(index)}
    orphans = [page_id(page) for page in PAGES if page not in INDEXES and page not in linked]
    assert not orphans, f"no link from README.md or docs/README.md reaches {orphans}"


def citing_files():
    """Files that must not cite the outside briefs: the docs, the code and the tests. (This file
    names them to look for them.)"""
    code = [
        path
        for folder in ("kerasdist", "tests")
        for path in (ROOT / folder).rglob("*.py")
        if path != pathlib.Path(__file__).resolve()
    ]
    return PAGES + sorted(code)


def test_nothing_cites_the_design_briefs_from_outside_the_repository():
    citations = [
        f"{path.relative_to(ROOT)}: {brief}"
        for path in citing_files()
        for brief in OUTSIDE_BRIEFS
        if brief in path.read_text(encoding="utf-8")
    ]
    assert not citations, f"cite docs/design.md or docs/algorithms.md instead: {citations}"
