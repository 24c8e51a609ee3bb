"""Sphinx configuration of kerasdist's documentation site (`make docs`, output in build/docs/html).

The guide pages are the Markdown files of this folder, read by MyST as GitHub shows them; the API
reference (api/*.rst) is autodoc over kerasdist's Google-style docstrings, read by napoleon.
"""

import hashlib
import os
import pathlib
import re
import sys

from docutils import nodes
from myst_parser.parsers.sphinx_ import MystParser
from sphinx import addnodes
from sphinx.directives.other import Include
from sphinx.transforms import SphinxTransform

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's kerasdist, also where it is not installed

project = "kerasdist"
author = "the kerasdist developers"
copyright = "the kerasdist developers"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"

# The pages link to headings by GitHub's anchors (guide.md#what-each-piece-does).
myst_heading_anchors = 6
# Some pages step from ## to ####, which GitHub renders as written; the site does too.
suppress_warnings = ["myst.header"]
# The docstrings write code as Markdown does, in single backticks: show it as code, linked to its
# reference entry where one exists.
default_role = "py:obj"

napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the docstrings say what the arguments are; there are few annotations
# Members documented here, not the Keras hooks (on_train_begin, build, get_config) they override.
autodoc_inherit_docstrings = False

html_theme = "furo"
html_title = "kerasdist"
# A wider column than furo's, so that the README's code lines show whole (_static/kerasdist.css).
html_static_path = ["_static"]
html_css_files = ["kerasdist.css"]

# A docstring's example is a Markdown code fence (```python ... ```), as GitHub and an editor
# show it and as tests/test_docstring_examples.py runs it; reStructuredText needs a directive.
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>\w*)\s*$")
_BACKTICKED = re.compile(r"(``.*?``|`[^`]*`)")


def _bars_escaped(line):
    """The docstrings write absolute values and norms as |x|, which reStructuredText would read
    as a substitution reference."""
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in _BACKTICKED.split(line))


def docstring_as_restructuredtext(app, what, name, obj, options, lines):
    converted, inside_fence, indent = [], False, ""
    for line in lines:
        fence = _FENCE.match(line)
        if fence and not inside_fence:
            inside_fence, indent = True, fence["indent"]
            converted += [f"{indent}.. code-block:: {fence['language'] or 'text'}", ""]
        elif fence:
            inside_fence = False
            converted.append("")
        elif inside_fence:
            converted.append(f"{indent}   {line.removeprefix(indent)}" if line.strip() else "")
        else:
            converted.append(_bars_escaped(line))
    lines[:] = converted


_LINK_TARGET = re.compile(r"(\]\()([^)\s#]+)")
# Markdown files at the top of the checkout that are pages of the site, included by an .rst page.
_INCLUDED_PAGES = {ROOT / "README.md": "index.rst", ROOT / "CHANGELOG.md": "changelog.rst"}


def _links_for_the_site(text, base):
    """The Markdown text's links, written relative to the folder `base` as GitHub reads them,
    rewritten relative to docs/ and to the pages that include README.md and CHANGELOG.md."""

    def rewritten(match):
        target = (base / match[2]).resolve()
        if target in _INCLUDED_PAGES:
            return match[1] + _INCLUDED_PAGES[target]
        if base == ROOT and target.exists():
            return match[1] + os.path.relpath(target, ROOT / "docs")
        return match[0]  # a docs page's own links, or code that looks like a link

    return _LINK_TARGET.sub(rewritten, text)


def links_of_a_docs_page(app, docname, source):
    source[0] = _links_for_the_site(source[0], ROOT / "docs")


class _MarkdownForTheSite(MystParser):
    def parse(self, inputstring, document):
        folder = pathlib.Path(document["source"]).resolve().parent
        super().parse(_links_for_the_site(inputstring, folder), document)


class IncludeMarkdown(Include):
    """``.. include-markdown:: ../README.md``: a Markdown file of another folder read by MyST, its
    links rewritten for docs/ (Sphinx's include-read event is not sent for a file with a parser)."""

    def run(self):
        self.options["parser"] = _MarkdownForTheSite
        return super().run()


class FlagSearchEntries(SphinxTransform):
    """Search entries on cli.md (written by make_cli_page.py) for `kerasdist-run` and each of its
    flags, so that the site's search for "kerasdist-run" or "--dry-run" lists that page first: the
    search ranks an index entry the query matches above pages that merely contain its words."""

    default_priority = 800  # before SphinxDomains (850) collects the index entries

    def apply(self):
        if self.env.current_document.docname != "cli":
            return
        page = next(self.document.findall(nodes.section))
        entries = [("single", "kerasdist-run", page["ids"][0], "main", None)]
        for row in self.document.findall(nodes.row):
            section = row.parent
            while not isinstance(section, nodes.section):
                section = section.parent
            flags = [literal.astext() for literal in row.children[0].findall(nodes.literal)]
            for flag in (flag for flag in flags if flag.startswith("-")):
                entries.append(("single", flag, section["ids"][0], "main", None))
                if len(flag) > 2 and not flag.startswith("--"):  # -np, which Open MPI also spells --np
                    entries.append(("see", f"-{flag}; {flag}", section["ids"][0], "main", None))
        page.insert(1, addnodes.index(entries=list(dict.fromkeys(entries))))


def cli_page_read_every_time(app, env, added, changed, removed):
    """Sphinx's search index, when built again, keeps the words of the pages it does not read anew
    but drops their index entries (IndexBuilder.load): FlagSearchEntries' must be made each time."""
    return ["cli"]


def setup(app):
    # Sphinx rebuilds the pages when a configuration value changes, not when this file's code does;
    # this value changes with the file.
    app.add_config_value("conf_py_digest", hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest(), "env")
    # After napoleon (priority 500), which reads the Google-style sections around the fences.
    app.connect("autodoc-process-docstring", docstring_as_restructuredtext, priority=600)
    app.connect("source-read", links_of_a_docs_page)
    app.add_directive("include-markdown", IncludeMarkdown)
    app.add_transform(FlagSearchEntries)
    app.connect("env-get-outdated", cli_page_read_every_time)
