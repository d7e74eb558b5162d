"""MkDocs hooks: publish benchmarks/figures (drawn by the benchmark scripts) as docs/figures at build time,
and keep the docs test's markers (``# tsl-docs: needs cuda``, ``skip (...)``, ``needs s3``) out of the
code a reader sees: tests/test_docs.py reads them from the markdown source, readers copy the rest."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

BENCHMARKS = Path(__file__).parent / "benchmarks"
# A whole line that is only a docs-test marker comment, inside a fenced block.
TEST_MARKER_LINE = re.compile(r"^[ \t]*#\s*tsl-docs:[^\n]*\n", re.M)
FENCED_BLOCK = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[ \t]*$", re.M | re.S)


def on_files(files, config):
    for png in sorted((BENCHMARKS / "figures").glob("*.png")):
        files.append(File(f"figures/{png.name}", str(BENCHMARKS), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    return FENCED_BLOCK.sub(lambda block: TEST_MARKER_LINE.sub("", block.group(0)), markdown)
