"""README's test command enforces the linter, the formatter and the type checker, as `.ci/run` does."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


def test_ruff_check_is_clean():
    result = _run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, (
        f"ruff check . found problems (many fix with `ruff check --fix .`):\n{result.stdout}{result.stderr}"
    )


def test_ruff_format_leaves_the_tree_as_it_is():
    result = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert result.returncode == 0, (
        f"ruff format would change these files (run `ruff format .`):\n{result.stdout}{result.stderr}"
    )


def test_mypy_strict_on_public_modules_is_clean():
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, (
        f"mypy (strict on the files in pyproject.toml) found errors:\n{result.stdout}{result.stderr}"
    )
