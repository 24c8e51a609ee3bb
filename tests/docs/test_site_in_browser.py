"""The documentation site as a browser shows it: `make docs` builds it (warnings are errors), then
headless Chromium loads the front page, follows its link to DistributedOptimizer's reference page
and that page must show the class's signature and the example from its docstring. At 1366 px
wide no code block of the front page or the CLI page is cut off, and the site's search for the
launcher or one of its flags lists the CLI page first.

Chromium runs as `chromium --headless --dump-dom URL`, which prints the page's DOM once loaded
and its scripts ran: no WebDriver whose version must match the browser's, no Python package, and
nothing downloaded at run time (Playwright would fetch a browser build of its own).
"""

import html.parser
import inspect
import json
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
    """The links, code blocks and the text under each id of a DOM; the links of the search's
    results, in the order shown; the attributes of <body>."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self, dom):
        super().__init__()
        self.links, self.code_blocks, self.text_by_id = [], [], {}
        self.search_results, self.attribute_of_body = [], {}
        self._open = []  # per open element: (tag, attributes, collected text)
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        attrs = dict(attrs)
        if tag == "body":
            self.attribute_of_body = attrs
        # The search's results are the links of <ul class="search">.
        if tag == "a" and any(
            open_tag == "ul" and "search" in (open_attrs.get("class") or "").split()
            for open_tag, open_attrs, _ in self._open
        ):
            self.search_results.append(attrs.get("href"))
        self._open.append((tag, attrs, []))

    def handle_endtag(self, tag):
        while self._open:
            open_tag, attrs, text = self._open.pop()
            joined = "".join(text)
            if self._open:
                self._open[-1][2].append(joined)
            if attrs.get("id"):
                self.text_by_id[attrs["id"]] = joined
            if open_tag == "a" and attrs.get("href") is not None:
                self.links.append((attrs["href"], joined))
            if open_tag == "pre":
                self.code_blocks.append(joined)
            if open_tag == tag:
                return

    def handle_data(self, data):
        if self._open:
            self._open[-1][2].append(data)


def _words(text):
    return " ".join(text.split())


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed: scripts/cluster_packages.sh install (as root on Debian) installs it")
    profile = tmp_path_factory.mktemp("chromium-profile")

    def dom_of(url, window_size=(1366, 768)):
        # As root Chromium starts only without its sandbox; the pages are our own files. The virtual
        # time lets the page's scripts finish (the search runs after its index loaded) however
        # long they take in real time.
        command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}"]
        command += [f"--window-size={window_size[0]},{window_size[1]}", "--virtual-time-budget=20000"]
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


# Run in a copy of a page after it loaded: every code block whose lines are wider than its box
# (a scroll bar, the rest cut off), as [width needed, width shown, longest line].
_MEASURE_CODE_BLOCKS = """<script>
window.addEventListener("load", () => {
  const cut = [];
  for (const block of document.querySelectorAll("article pre")) {
    if (block.scrollWidth > block.clientWidth) {
      const lines = block.textContent.split("\\n");
      cut.push([block.scrollWidth, block.clientWidth, lines.reduce((a, b) => (b.length > a.length ? b : a))]);
    }
  }
  document.body.setAttribute("data-code-blocks-cut-off", JSON.stringify(cut));
});
</script>"""


@pytest.mark.parametrize("page", ["index.html", "cli.html"])
def test_no_code_block_is_cut_off_on_a_1366_pixel_wide_screen(site, browser, page, tmp_path):
    # The page as the browser gets it, from a copy that keeps the site's stylesheets (<base>) and
    # measures its code blocks once laid out at 1366 x 768, the commonest laptop screen.
    measured = tmp_path / page
    measured.write_text(
        (site / page)
        .read_text()
        .replace("<head>", f'<head><base href="{site.as_uri()}/">', 1)
        .replace("</body>", f"{_MEASURE_CODE_BLOCKS}</body>", 1)
    )
    shown = browser(measured.as_uri(), window_size=(1366, 768))
    assert shown.code_blocks, f"{page} has no code block"
    cut_off = json.loads(shown.attribute_of_body["data-code-blocks-cut-off"])
    assert not cut_off, f"code blocks of {page} wider than the column at 1366 px (needed, shown, line): {cut_off}"


@pytest.mark.parametrize("query", ["kerasdist-run", "--np", "-np", "--dry-run", "--fusion-threshold-mb"])
def test_searching_for_the_launcher_or_a_flag_shows_the_cli_page_first(site, browser, query):
    shown = browser(f"{(site / 'search.html').as_uri()}?{urllib.parse.urlencode({'q': query})}")
    assert shown.search_results, f"the search for {query!r} found nothing"
    assert shown.search_results[0].split("#")[0] == "cli.html", (
        f"the search for {query!r} lists first {shown.search_results[0]}: {shown.search_results[:5]}"
    )
