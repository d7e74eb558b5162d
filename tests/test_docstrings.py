"""The API reference is complete: every public name has a docstring that documents its parameters and
what it returns, parses cleanly the way mkdocstrings reads it (griffe, Google style), is rendered by
exactly one entry of docs/reference/ (which renders nothing else), and its ``>>>`` examples run. And
no docstring of the package names, in backticks, a private name (``_name``) that no longer exists.

Public objects: each name of ``torch_storage_loader.__all__``, and the public methods and properties
that a public class declares itself (inherited ones are checked on the class that declares them).
Each is one test id, e.g. ``test_docstring_is_complete[FileStorage.save]``.
"""

from __future__ import annotations

import ast
import doctest
import logging
import re
from pathlib import Path

import griffe
import pytest

import torch_storage_loader

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "torch_storage_loader"

# Entries known to fail. Each must still fail: once it passes, remove it from here, so this set only
# shrinks. Empty: every public docstring is complete.
PENDING: set[str] = set()


def _load() -> griffe.Module:
    # Static analysis of this checkout (not of an installed copy), as mkdocstrings reads it.
    return griffe.load(
        PACKAGE, search_paths=[str(ROOT)], docstring_parser="google", allow_inspection=False, resolve_aliases=True
    )


_PKG = _load()


# Name -> its path in the package: the top level's names (``__all__``, built from ``__init__.pyi``), and
# the Lightning integration's (a module of its own, imported only by who uses Lightning: its ``__all__``).
PUBLIC = {name: name for name in torch_storage_loader.__all__} | {
    name: f"lightning.{name}" for name in _PKG["lightning"].exports
}


def _public_objects() -> dict[str, griffe.Object]:
    """Test id (``Name`` or ``Name.member``) -> the griffe object, for every public object."""
    objects: dict[str, griffe.Object] = {}
    for name in PUBLIC:
        obj = _PKG[PUBLIC[name]]
        obj = obj.final_target if obj.is_alias else obj
        objects[name] = obj
        if not obj.is_class:
            continue
        for member_name, member in obj.members.items():  # declared here, not inherited
            if member_name.startswith("_") or member.is_alias:
                continue
            if member.is_function or (member.is_attribute and "property" in member.labels):
                objects[f"{name}.{member_name}"] = member
    return objects


OBJECTS = _public_objects()


def _sections(obj: griffe.Object) -> tuple[list[griffe.DocstringSection], list[str]]:
    """The docstring's parsed sections, and the warnings griffe logged while parsing it (mkdocs
    --strict fails on those)."""
    if obj.docstring is None:
        return [], []
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = _Collect(logging.WARNING)
    logger = logging.getLogger("griffe")
    logger.addHandler(handler)
    try:
        sections = obj.docstring.parse("google")
    finally:
        logger.removeHandler(handler)
    return sections, messages


def _documented_parameters(obj: griffe.Object) -> set[str]:
    """Names an Args: section documents; for a class, its Attributes: section too (a dataclass's
    fields are its parameters)."""
    kinds = {griffe.DocstringSectionKind.parameters}
    if obj.is_class:
        kinds.add(griffe.DocstringSectionKind.attributes)
    sections, _ = _sections(obj)
    return {p.name.lstrip("*") for s in sections if s.kind in kinds for p in s.value}


def _kinds(obj: griffe.Object) -> set[griffe.DocstringSectionKind]:
    return {s.kind for s in _sections(obj)[0]}


def _returns_nothing(func: griffe.Function) -> bool:
    return func.returns is not None and str(func.returns) in {"None", "NoReturn", "Never", "typing.NoReturn"}


def _is_generator(func: griffe.Function) -> bool:
    return (
        re.match(r"(typing\.|collections\.abc\.)?(Async)?(Iterator|Generator)\b", str(func.returns or "")) is not None
    )


def _own_parameters(func: griffe.Function) -> list[str]:
    names = [p.name for p in func.parameters]
    if names and names[0] in {"self", "cls"}:
        names = names[1:]
    return names


def _problems(test_id: str, obj: griffe.Object) -> list[str]:
    """What the docstring of ``obj`` lacks, each as what to add; empty when complete."""
    problems = []
    if obj.docstring is None or not obj.docstring.value.strip():
        return [f"{test_id} ({obj.path}) has no docstring: add one that says what it is for."]
    _, warnings = _sections(obj)
    problems += [f"{test_id}: griffe (mkdocstrings) warns while parsing its docstring: {w}" for w in warnings]
    if ">>>" in obj.docstring.value and griffe.DocstringSectionKind.examples not in _kinds(obj):
        problems.append(
            f"{test_id}: its >>> example is not in an Examples: section (griffe renders an "
            f"'Example:' title as a note, not as code): title it Examples:."
        )

    if obj.is_class:
        init = obj.members.get("__init__")
        if init is not None and not init.is_alias and init.is_function:
            documented = _documented_parameters(obj) | _documented_parameters(init)
            for name in _own_parameters(init):
                if name.lstrip("*") not in documented:
                    problems.append(
                        f"{test_id}: parameter {name!r} of __init__ is not documented: add it to "
                        f"an Args: section of the class docstring (or of __init__; a dataclass's "
                        f"field to its Attributes: section)."
                    )
    elif obj.is_function:
        documented = _documented_parameters(obj)
        for name in _own_parameters(obj):
            if name.lstrip("*") not in documented:
                problems.append(f"{test_id}: parameter {name!r} is not documented: add it to an Args: section.")
        kinds = _kinds(obj)
        if obj.returns is None and obj.name != "__init__":
            problems.append(f"{test_id}: no return annotation, so what it returns is unknown: annotate it.")
        elif not _returns_nothing(obj):
            if _is_generator(obj):
                if not kinds & {griffe.DocstringSectionKind.yields, griffe.DocstringSectionKind.returns}:
                    problems.append(
                        f"{test_id}: returns an iterator ({obj.returns}) but its docstring has "
                        f"no Yields: (or Returns:) section: add one."
                    )
            elif griffe.DocstringSectionKind.returns not in kinds:
                problems.append(f"{test_id}: returns {obj.returns} but its docstring has no Returns: section: add one.")
    # Properties (and other attributes) are documented like attributes: a docstring says what they hold.
    return problems


@pytest.mark.parametrize("test_id", sorted(OBJECTS))
def test_docstring_is_complete(test_id: str) -> None:
    problems = _problems(test_id, OBJECTS[test_id])
    if test_id in PENDING:
        assert problems, (
            f"{test_id} is listed in PENDING (tests/test_docstrings.py) but its docstring is "
            f"complete now: remove it from PENDING."
        )
        pytest.xfail("pending the redis_queue split: " + " | ".join(problems))
    assert not problems, "\n".join(problems)


def test_pending_names_public_objects() -> None:
    unknown = sorted(PENDING - set(OBJECTS))
    assert not unknown, f"PENDING names objects that are not public (any more): {unknown}"


def _reference_directives() -> list[str]:
    """What docs/reference/*.md renders: the identifier of each ``::: identifier`` directive."""
    pages = sorted((ROOT / "docs" / "reference").glob("*.md"))
    return [m.group(1) for page in pages for m in re.finditer(r"(?m)^:::\s+(\S+)", page.read_text(encoding="utf-8"))]


def test_the_api_reference_documents_each_public_name_once() -> None:
    """docs/reference/ is a copy of the public names (mkdocstrings needs one directive per entry): it
    must agree with them exactly, so a name added, renamed or removed cannot leave the reference behind."""
    documented = _reference_directives()
    public = {f"{PACKAGE}.{path}" for path in PUBLIC.values()}
    repeated = sorted({name for name in documented if documented.count(name) > 1})
    missing, extra = sorted(public - set(documented)), sorted(set(documented) - public)
    assert not (repeated or missing or extra), (
        f"docs/reference/*.md must render each public name once, and nothing else: public but not rendered "
        f"{missing} (add `::: {PACKAGE}.Name` to the page of its kind), rendered but not public {extra}, "
        f"rendered more than once {repeated}."
    )


def _examples() -> dict[str, griffe.Object]:
    return {
        test_id: obj for test_id, obj in OBJECTS.items() if obj.docstring is not None and ">>>" in obj.docstring.value
    }


@pytest.mark.parametrize(
    "test_id", sorted(_examples()) or [pytest.param("none", marks=pytest.mark.skip("no examples"))]
)
def test_docstring_examples_run(test_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    obj = OBJECTS[test_id]
    assert obj.docstring is not None
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    # Examples may register storage types or configure object stores: undo that for the tests after.
    from torch_storage_loader._redis import records
    from torch_storage_loader._stores import config

    monkeypatch.setattr(records, "_REGISTRY", dict(records._REGISTRY))
    monkeypatch.setattr(config, "_config", dict(config._config))
    test = doctest.DocTestParser().get_doctest(
        obj.docstring.value,
        {"torch_storage_loader": torch_storage_loader},
        test_id,
        str(obj.filepath),
        obj.docstring.lineno or 0,
    )
    failures: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=failures.append)
    assert runner.failures == 0, f"{test_id}: its docstring's example fails; fix the example:\n" + "".join(failures)


# A private name in backticks in a docstring (``_release``, `_registry`, ``_format.tree.plan_for``):
# each ``_`` part of the dotted (or slashed) path must exist in the package's source.
_TICKED = re.compile(r"``?([A-Za-z_][\w./]*)(?:\(\))?``?")
# torch's own private names that docstrings name without their module (those under ``torch.`` are
# skipped as torch's): _dataloader/hooks.py documents the torch it relies on.
TORCH_NAMES_IN_DOCSTRINGS = {"_next_data"}


def _docstring_nodes(tree: ast.Module) -> list[ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]:
    return [
        n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def _source_names(trees: dict[Path, ast.Module], package: Path) -> set[str]:
    """Every name the package's code defines or uses: modules and packages, defs, classes, parameters,
    variables, attributes, imports, and string values that are not docstrings (file names, ``__slots__``)."""
    names = set()
    for path, tree in trees.items():
        names.add(path.stem)
        names.update(path.relative_to(package).parts[:-1])
        docstrings = {id(n.body[0].value) for n in _docstring_nodes(tree) if ast.get_docstring(n, clean=False)}
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
            elif isinstance(n, ast.alias):
                names.update({n.asname or n.name, *n.name.split(".")})
            elif isinstance(n, ast.Name):
                names.add(n.id)
            elif isinstance(n, ast.Attribute):
                names.add(n.attr)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
                names.add(n.value)
    return names


def test_private_names_in_docstrings_exist() -> None:
    package = ROOT / PACKAGE
    trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
    known = _source_names(trees, package) | TORCH_NAMES_IN_DOCSTRINGS
    stale = []
    for path, tree in trees.items():
        for node in _docstring_nodes(tree):
            for mention in _TICKED.finditer(ast.get_docstring(node, clean=False) or ""):
                parts = re.split(r"[./]", mention.group(1))
                if parts[0] in ("torch", "torchdata"):
                    continue
                for part in parts:
                    if part.startswith("_") and not part.startswith("__") and part not in known:
                        where = f"{path.relative_to(package)}:{getattr(node, 'name', '(module)')}"
                        stale.append(f"{where}: {mention.group(0)} names {part}, which is nowhere in the package")
    assert not stale, "docstrings name private names that no longer exist:\n" + "\n".join(stale)


def test_the_private_name_check_finds_a_stale_name() -> None:
    tree = ast.parse('"""Uses ``_gone`` and ``_here``."""\n_here = "x"\n')
    names = _source_names({ROOT / PACKAGE / "m.py": tree}, ROOT / PACKAGE)
    assert "_here" in names and "_gone" not in names
    assert "Uses ``_gone`` and ``_here``." not in names, "a docstring is not a name"
