"""The docs site, checked rather than trusted: it builds strictly, every Python example in README.md and
docs/ runs, and every built page renders in a headless Chromium without a console error.

Examples run as a user runs what they copy: a page's blocks in order, saved as ``example.py`` in a
temporary directory and started with ``python example.py`` (so a page whose code starts worker
processes needs ``if __name__ == "__main__":``), with warnings as errors like this suite. Every guide
ends with a section ``## A complete example`` holding one script a reader pastes into a file: it runs
on its own, apart from the page's other blocks (a guide whose last section shows the ``examples/``
scripts, run by tests/test_examples.py, needs none). A block's
first line may say what it needs: ``# tsl-docs: needs cuda`` (skipped without a GPU) or
``# tsl-docs: skip (why)`` (never run: hosts that are only illustrations). Blocks that read
``TSL_REDIS_URL`` get this suite's redis-server; blocks that read ``TSL_S3_BUCKET``/``TSL_S3_OPTIONS``
get a fresh bucket on its SeaweedFS. mkdocs_hooks.py strips the markers from what readers see.

In Chromium at 1280x900 (a laptop screen), every page is also read as a newcomer would: no code block
scrolls sideways, no marker shows, every guide has headings below its title and no paragraph over 150
words, and Home shows its when-to-use headings and its comparison table without scrolling."""

from __future__ import annotations

import functools
import html.parser
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tomllib
import torch
from _helpers import run_script
from _redis_server import redis_server  # noqa: F401  (fixture)
from _s3_server import s3_bucket, s3_server  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
MARKER = re.compile(r"#\s*tsl-docs:\s*(needs cuda|skip\b.*)")
FENCE = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
# Code that starts worker processes: under spawn or forkserver (Python 3.14's default on Linux, for
# DataLoaders too) they re-run the script's top level, so a script that does this needs its main guard.
STARTS_WORKERS = re.compile(r"\b(FileStorageLoader|DataLoader|Trainer|Process)\(")
MAIN_GUARD = 'if __name__ == "__main__":'


COMPLETE_EXAMPLE = "## A complete example"
GUIDES = sorted((ROOT / "docs/guides").glob("*.md"))


def python_blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


def complete_example(page: Path) -> str | None:
    """The script of the page's ``## A complete example`` section, or None."""
    _, heading, section = page.read_text().partition(f"\n{COMPLETE_EXAMPLE}\n")
    blocks = FENCE.findall(section) if heading else []
    return blocks[0] if blocks else None


def _scripts(page: Path) -> list[tuple[str, list[str]]]:
    """What runs of a page, each as a user would run it: its blocks in order (the complete example apart)."""
    blocks, complete = python_blocks(page), complete_example(page)
    rest = [b for b in blocks if b != complete]
    return [(kind, parts) for kind, parts in (("blocks", rest), ("complete", [complete] if complete else [])) if parts]


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_every_guide_ends_with_a_complete_example(guide):
    text = guide.read_text()
    last_section = text.rpartition("\n## ")[2]
    if re.search(r'^--8<-- "examples/\w+\.py"$', last_section, re.M):
        return  # it ends with the examples/ scripts themselves (tests/test_examples.py runs them)
    assert last_section.startswith(COMPLETE_EXAMPLE[3:] + "\n"), f"{guide.name} ends with '## {last_section[:60]}'"
    blocks = FENCE.findall(last_section)
    assert len(blocks) == 1, f"{guide.name}: its complete example should be one python block, found {len(blocks)}"
    if STARTS_WORKERS.search(blocks[0]):
        assert MAIN_GUARD in blocks[0], f"{guide.name}: its complete example starts processes without `{MAIN_GUARD}`"


def _marker(block: str) -> str | None:
    first = block.lstrip().splitlines()[0] if block.strip() else ""
    match = MARKER.match(first)
    return match.group(1) if match else None


# Lightning's own use of a deprecated torch pytree name (tests/test_lightning.py ignores it too).
EXAMPLE_FILTERS = ["ignore:`isinstance(treespec, LeafSpec)` is deprecated:FutureWarning"]


def _warning_flags() -> list[str]:
    """This suite's warning filters (pyproject.toml), as the interpreter's -W options, in the same order."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    entries = [*config["filterwarnings"], *EXAMPLE_FILTERS]
    return [flag for entry in entries for flag in ("-W", entry)]


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    print(f"mkdocs build --strict: {elapsed:.1f} s")
    return site


def test_site_builds_strictly(built_site):
    pages = sorted(p.relative_to(built_site).as_posix() for p in built_site.rglob("index.html"))
    assert "index.html" in pages and "reference/loaders/index.html" in pages, pages
    reference = (built_site / "reference/loaders/index.html").read_text()
    assert "torch_storage_loader.FileStorageLoader" in reference  # mkdocstrings rendered the public name
    for figure in (ROOT / "benchmarks/figures").glob("*.png"):  # the scripts' plots, published as they are
        assert (built_site / "figures" / figure.name).read_bytes() == figure.read_bytes()


def test_headline_plot_is_drawn_from_the_measured_table():
    """benchmarks/plot_headline.py reads the benchmarks page's table; the page embeds what it draws."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plot_headline
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    page = (ROOT / "docs/benchmarks.md").read_text()
    figures = plot_headline.headline(page)
    assert figures["throughput"]["7.2 MB samples"] > 1 and figures["trainer"]["StorageDataset"] > 0
    assert "](figures/headline.png)" in page and "python benchmarks/plot_headline.py" in page
    assert (ROOT / "benchmarks/figures/headline.png").exists()


class _ApiEntries(html.parser.HTMLParser):
    """The API entries (mkdocstrings' ``div.doc-object``) of a page, each with whether it shows its source."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[list] = []  # [id, has source]
        self._open: list[tuple[int, list]] = []  # (div depth, entry) of the entries open here
        self._depth = 0

    def handle_starttag(self, tag, attrs) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div":
            self._depth += 1
            if "doc-object" in classes:
                self.entries.append(entry := [None, False])
                self._open.append((self._depth, entry))
        elif self._open and "doc-heading" in classes and self._open[-1][1][0] is None:
            self._open[-1][1][0] = dict(attrs).get("id")
        elif tag == "details" and "mkdocstrings-source" in classes and self._open:
            self._open[-1][1][1] = True  # a class's source comes after its members: theirs are closed

    def handle_endtag(self, tag) -> None:
        if tag == "div":
            if self._open and self._open[-1][0] == self._depth:
                self._open.pop()
            self._depth -= 1


def test_every_api_entry_shows_its_source(built_site):
    """Each class, function and property of the API reference ends with its source (folded)."""
    missing, count = [], 0
    for page in sorted((built_site / "reference").rglob("index.html")):
        parser = _ApiEntries()
        parser.feed(page.read_text())
        count += len(parser.entries)
        missing += [f"{page.parent.name}: {name}" for name, has_source in parser.entries if not has_source]
    assert count >= 100, count  # every page's entries were found
    assert not missing, f"API entries without their source: {missing}"


@pytest.mark.parametrize(
    ("page", "kind"),
    [
        pytest.param(page, kind, id=f"{page.relative_to(ROOT).as_posix()}-{kind}")
        for page in PAGES
        for kind, _ in _scripts(page)
    ],
)
def test_examples_run(page, kind, request, tmp_path):
    blocks = dict(_scripts(page))[kind]
    markers = [_marker(b) for b in blocks]
    if any(m == "needs cuda" for m in markers) and not torch.cuda.is_available():
        pytest.skip("an example of this page needs a CUDA device and none is present")
    runnable = [b for b, m in zip(blocks, markers, strict=True) if m is None or m == "needs cuda"]
    if not runnable:
        pytest.skip(f"every example of this page is marked to skip: {markers}")
    script = "\n\n".join(runnable)
    if STARTS_WORKERS.search(script):
        assert MAIN_GUARD in script, f"{page.relative_to(ROOT)}: examples that start workers need `{MAIN_GUARD}`"
    env = {}
    if "TSL_REDIS_URL" in script:
        env["TSL_REDIS_URL"] = request.getfixturevalue("redis_server").url
    if "TSL_S3_" in script:
        server = request.getfixturevalue("s3_server")
        env["TSL_S3_BUCKET"] = f"s3://{request.getfixturevalue('s3_bucket')}"
        env["TSL_S3_OPTIONS"] = json.dumps(server.storage_options)
    result = run_script(script, tmp_path, timeout=240, env=env, python_args=tuple(_warning_flags()))
    assert result.returncode == 0, (
        f"the examples of {page.relative_to(ROOT)}, run as a script, failed:\n{script}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:
        pass


@pytest.fixture
def site_url(built_site):
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(built_site))
    )
    thread = threading.Thread(target=server.serve_forever, name="tsl-docs-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


SCREENSHOTS = {
    "": "home.png",
    "getting-started/": "getting-started.png",
    "guides/troubleshooting/": "troubleshooting.png",
    "benchmarks/": "benchmarks.png",
    "reference/loaders/": "reference-loaders.png",
}
VIEWPORT = {"width": 1280, "height": 900}  # a laptop screen: what a reader sees without scrolling
MAX_GUIDE_PARAGRAPH_WORDS = 150
# Measured in the page: code blocks that scroll sideways (cut for a reader), the docs test's markers in
# rendered text, identifiers in a table's first column broken across lines (exception names), a guide's
# headings below its title and its longest paragraphs.
LAYOUT_JS = """() => {
  const article = document.querySelector("article.md-content__inner");
  const cut = [...article.querySelectorAll("pre, pre > code")]
    .filter(e => e.scrollWidth > e.clientWidth + 1)
    .map(e => `${e.scrollWidth}>${e.clientWidth}px: ${e.innerText.split("\\n").find(l => l.length > 60) || ""}`);
  const long = [...article.querySelectorAll("p")]
    .map(p => [p.innerText.split(/\\s+/).filter(Boolean).length, p.innerText.slice(0, 80)]);
  const broken = [...article.querySelectorAll("td:first-child > code:only-child")]
    .filter(c => c.getClientRects().length > 1).map(c => c.innerText);
  return {
    cut,
    broken,
    marker: /#\\s*tsl-docs:/.test(article.innerText),
    headings: article.querySelectorAll("h2, h3").length,
    long,
  };
}"""


def _layout_problems(page, path: str) -> list[str]:
    """What a reader at 1280x900 would trip on: code cut at the right edge, test markers, walls of prose."""
    found = page.evaluate(LAYOUT_JS)
    problems = [f"/{path}: code block scrolls sideways at 1280 px ({cut})" for cut in found["cut"]]
    problems += [f"/{path}: the table entry {name!r} breaks across lines" for name in found["broken"]]
    if found["marker"]:
        problems.append(f"/{path}: a docs-test marker (# tsl-docs: ...) shows in the rendered page")
    if path.startswith("guides/"):
        if found["headings"] == 0:
            problems.append(f"/{path}: a guide with no heading below its title (empty table of contents)")
        problems += [
            f"/{path}: a paragraph of {n} words (> {MAX_GUIDE_PARAGRAPH_WORDS}): {text}..."
            for n, text in found["long"]
            if n > MAX_GUIDE_PARAGRAPH_WORDS
        ]
    if path == "":  # Home: why, when (and when not), and the comparison on the first screen
        fold = page.evaluate(
            """() => [...document.querySelectorAll("article h2, article table")]
                 .map(e => [e.tagName, e.innerText.slice(0, 30), e.getBoundingClientRect().bottom])"""
        )
        fold = fold[: [tag for tag, _, _ in fold].index("TABLE") + 1] if any(t == "TABLE" for t, _, _ in fold) else fold
        tags = [tag for tag, _, _ in fold]
        if tags.count("TABLE") < 1 or tags.count("H2") < 2:
            problems.append(f"/: Home should open with its when-to-use headings and a comparison table, got {fold}")
        problems += [
            f"/: {tag} {text!r} ends at {bottom:.0f} px, below the fold (900)"
            for tag, text, bottom in fold
            if bottom > VIEWPORT["height"]
        ]
    return problems


def test_pages_render_in_chromium(built_site, site_url):
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (.ci/run installs it: apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    shots = os.environ.get("TSL_DOCS_SCREENSHOTS")
    paths = sorted(p.parent.relative_to(built_site).as_posix() + "/" for p in built_site.rglob("index.html"))
    paths = [("" if p == "./" else p) for p in paths if not p.startswith(("assets/", "search/"))]
    assert len(paths) >= 20, paths
    problems = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            for path in paths:
                page = browser.new_page(viewport=VIEWPORT)
                errors: list[str] = []
                page.on(
                    "console",
                    lambda m, e=errors: e.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
                )
                page.on("pageerror", lambda exc, e=errors: e.append(f"page error: {exc}"))
                page.on("requestfailed", lambda r, e=errors: e.append(f"request failed: {r.url} {r.failure}"))
                page.on(
                    "response", lambda r, e=errors: e.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None
                )
                response = page.goto(f"{site_url}/{path}", wait_until="networkidle")
                page.wait_for_load_state("networkidle")  # the search worker's index, images: nothing in flight
                heading = page.locator("article.md-content__inner h1").first
                if response is None or response.status != 200:
                    problems.append(f"/{path}: HTTP {response and response.status}")
                elif heading.count() == 0 or not heading.inner_text().strip():
                    problems.append(f"/{path}: no main content (no heading in the article)")
                for image in page.locator("article img").all():
                    if not image.evaluate("img => img.complete && img.naturalWidth > 0"):
                        problems.append(f"/{path}: image {image.get_attribute('src')} did not load")
                if shots and path in SCREENSHOTS:
                    os.makedirs(shots, exist_ok=True)
                    page.screenshot(path=os.path.join(shots, SCREENSHOTS[path]), full_page=False)
                problems += _layout_problems(page, path)
                problems += [f"/{path}: {e}" for e in errors]
                page.close()
        finally:
            browser.close()
    assert not problems, "\n".join(problems)
