"""MkDocs hooks: publish benchmarks/figures (drawn by the benchmark scripts) as docs/figures at build time."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

BENCHMARKS = Path(__file__).parent / "benchmarks"


def on_files(files, config):
    for png in sorted((BENCHMARKS / "figures").glob("*.png")):
        files.append(File(f"figures/{png.name}", str(BENCHMARKS), config["site_dir"], config["use_directory_urls"]))
    return files
