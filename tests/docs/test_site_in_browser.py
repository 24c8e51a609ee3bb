"""The documentation site as a browser shows it: `make docs` builds it (warnings are errors), then
headless Chromium loads the front page, follows its link to DistributedOptimizer's reference page
and that page must show the class's signature and the example from its docstring.

Chromium runs as `chromium --headless --dump-dom URL`, which prints the page's DOM once loaded
and its scripts ran: no WebDriver whose version must match the browser's, no Python package, and
nothing downloaded at run time (Playwright would fetch a browser build of its own).
"""

import html.parser
import inspect
import re
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

import kerasdist

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "build" / "docs" / "html"
CHROMIUM = shutil.which("chromium")
CLASS_ID = "kerasdist.DistributedOptimizer"


class _Page(html.parser.HTMLParser):
    """The links, code blocks and the text under each id of a DOM."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self, dom):
        super().__init__()
        self.links, self.code_blocks, self.text_by_id = [], [], {}
        self._open = []  # per open element: (tag, id or None, href or None, collected text)
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        attrs = dict(attrs)
        self._open.append((tag, attrs.get("id"), attrs.get("href") if tag == "a" else None, []))

    def handle_endtag(self, tag):
        while self._open:
            open_tag, element_id, href, text = self._open.pop()
            joined = "".join(text)
            if self._open:
                self._open[-1][3].append(joined)
            if element_id:
                self.text_by_id[element_id] = joined
            if href is not None:
                self.links.append((href, joined))
            if open_tag == "pre":
                self.code_blocks.append(joined)
            if open_tag == tag:
                return

    def handle_data(self, data):
        if self._open:
            self._open[-1][3].append(data)


def _words(text):
    return " ".join(text.split())


@pytest.fixture(scope="module")
def site():
    """`make docs`, as CI runs it: installs requirements-docs.txt into .venv when missing, then
    builds the site into build/docs/html (only what changed, when it was built before)."""
    built = subprocess.run(["make", "-s", "-C", str(ROOT), "docs"], capture_output=True, text=True, timeout=1200)
    if built.returncode != 0:
        has_sphinx = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", "import sphinx, myst_parser, furo"])
        if has_sphinx.returncode != 0:
            pytest.skip(f"the docs requirements (requirements-docs.txt) could not be installed: {built.stderr[-2000:]}")
        pytest.fail(f"make docs failed:\n{built.stdout[-4000:]}\n{built.stderr[-4000:]}")
    return SITE


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed: scripts/cluster_packages.sh install (as root on Debian) installs it")
    profile = tmp_path_factory.mktemp("chromium-profile")

    def dom_of(url):
        # As root Chromium starts only without its sandbox; the pages are our own files.
        command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}"]
        shown = subprocess.run([*command, "--dump-dom", url], capture_output=True, text=True, timeout=180)
        assert shown.returncode == 0, f"chromium failed on {url}: {shown.stderr[-2000:]}"
        return _Page(shown.stdout)

    return dom_of


def _reference_page(site, browser):
    """The page that the front page's links naming DistributedOptimizer lead to, which documents
    the class, and its URL."""
    front_page = (site / "index.html").as_uri()
    named = [href for href, text in browser(front_page).links if "DistributedOptimizer" in text]
    assert named, "the front page has no link that names DistributedOptimizer"
    for url in dict.fromkeys(urllib.parse.urljoin(front_page, href) for href in named):
        page = browser(url)
        if CLASS_ID in page.text_by_id:
            return url, page
    pytest.fail(f"no page the front page's links {named} lead to documents {CLASS_ID}")


def test_the_front_page_links_to_the_reference_page_of_distributed_optimizer(site, browser):
    url, _ = _reference_page(site, browser)
    assert urllib.parse.urlparse(url).path == str(site / "api" / "optimizer.html"), url


def test_the_reference_page_shows_the_signature_and_the_example(site, browser):
    _, page = _reference_page(site, browser)
    signature = _words(page.text_by_id[CLASS_ID])
    assert signature.startswith(f"class {CLASS_ID}("), signature
    parameters = inspect.signature(kerasdist.DistributedOptimizer).parameters
    missing = [name for name in parameters if not re.search(rf"\b{name}\b", signature.split("(", 1)[1])]
    assert not missing, f"the rendered signature {signature!r} lacks {missing}"

    example = re.search(r"```python\n(.*?)```", inspect.getdoc(kerasdist.DistributedOptimizer), flags=re.S)[1]
    assert any(_words(example) == _words(block) for block in page.code_blocks), (
        f"no code block on the page reads as the docstring's example:\n{example}"
    )
