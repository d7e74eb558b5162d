"""The layout's rules, checked: the public names import, no import cycle, modules and classes stay
small or say why, and private torch is touched in one module."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys

import torch_storage_loader

PACKAGE = pathlib.Path(torch_storage_loader.__file__).parent
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250
# A module or class over its limit says why at its top, on a line starting with this: in its
# docstring, or in a comment just above the class (public classes keep their docstrings for users).
SIZE_REASON = "Size:"
# The one module that may name private torch (torch._*, torch.utils.data._utils, the DataLoader's
# private iterators and attributes): it checks, when installed, that they are what it needs.
PRIVATE_TORCH_HOME = "_dataloader/hooks.py"
PRIVATE_TORCH_NAMES = re.compile(
    r"torch\._[A-Za-z]|torch\.utils\.data\._utils|_MultiProcessingDataLoaderIter|"
    r"_SingleProcessDataLoaderIter|_BaseDatasetFetcher|\._iterator\b|_utils\.collate|"
    r"default_collate_fn_map|_pin_memory_loop"
)
# Modules and classes still over the size limits, each to be split (or given its reason) in turn:
# remove an entry when it is done; the test fails when an entry is no longer needed.
PENDING_SIZE: set[str] = set()


def _modules() -> dict[str, pathlib.Path]:
    return {
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_public_names_import_sorted_and_from_the_package():
    names = torch_storage_loader.__all__
    assert names == sorted(set(names)), "__all__ is sorted and has no repeats"
    assert set(names) == set(torch_storage_loader._EXPORTS), "__all__ lists exactly the names of __init__.pyi"
    code = (
        "import torch_storage_loader as t\n"
        "for n in t.__all__:\n"
        "    v = getattr(t, n)\n"
        "    assert getattr(v, '__module__', '').startswith('torch_storage_loader.'), n\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)  # a fresh process: nothing cached
    assert set(names) <= set(dir(torch_storage_loader))


def test_every_module_imports_on_its_own():
    for name in _modules():
        module = f"torch_storage_loader.{name}" if name else "torch_storage_loader"
        importlib.import_module(module)


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, at module level or inside functions."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                mod = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("torch_storage_loader"):
                mod = node.module.removeprefix("torch_storage_loader").lstrip(".")
            else:
                continue
            targets = [f"{mod}.{a.name}".lstrip(".") for a in node.names] + [mod]
        elif isinstance(node, ast.Import):
            targets = [
                a.name.removeprefix("torch_storage_loader").lstrip(".")
                for a in node.names
                if a.name.startswith("torch_storage_loader.")
            ]
        for t in targets:
            if t in known and t != name and t:
                found.add(t)
                break
    return found


def test_no_import_cycles():
    modules = _modules()
    known = set(modules)
    graph = {n: _imports(n, p, known) for n, p in modules.items()}
    cycles, index, low, stack, on, counter = [], {}, {}, [], set(), [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}"


def _reason(doc: str | None, comments: list[str] = ()) -> bool:
    lines = [*(doc or "").splitlines(), *(c.lstrip("# ") for c in comments)]
    return any(line.strip().startswith(SIZE_REASON) for line in lines)


def _comments_above(lines: list[str], node: ast.ClassDef) -> list[str]:
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    out = []
    for line in reversed(lines[: first - 1]):
        if not line.lstrip().startswith("#"):
            break
        out.append(line.strip())
    return out


def test_modules_and_classes_are_small_or_say_why():
    over = set()
    for path in _modules().values():
        source = path.read_text()
        tree = ast.parse(source)
        if source.count("\n") > MAX_MODULE_LINES and not _reason(ast.get_docstring(tree)):
            over.add(_rel(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ClassDef)
                and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
                and not _reason(ast.get_docstring(node), _comments_above(source.splitlines(), node))
            ):
                over.add(f"{_rel(path)}:{node.name}")
    assert over >= PENDING_SIZE, f"no longer over the limits: remove {sorted(PENDING_SIZE - over)} from PENDING_SIZE"
    assert over <= PENDING_SIZE, (
        f"over {MAX_MODULE_LINES} lines (module) or {MAX_CLASS_LINES} (class) "
        f"without a {SIZE_REASON!r} line in the docstring: {sorted(over - PENDING_SIZE)}"
    )


def test_private_torch_only_in_its_home():
    users = set()
    for path in _modules().values():
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        if PRIVATE_TORCH_NAMES.search(code):
            users.add(_rel(path))
    assert users == {PRIVATE_TORCH_HOME}, (
        f"private torch outside {PRIVATE_TORCH_HOME}: {sorted(users - {PRIVATE_TORCH_HOME})}"
    )


def test_the_dataset_imports_neither_the_loader_nor_redis_nor_lightning():
    code = (
        "import sys, torch_storage_loader.dataset\n"
        "heavy = {'torch_storage_loader.loader', 'torch_storage_loader.file_loader', 'torch_storage_loader._workers.pool',\n"
        "         'torch_storage_loader.redis_queue', 'torch_storage_loader.lightning', 'redis', 'lightning'}\n"
        "assert not heavy & set(sys.modules), sorted(heavy & set(sys.modules))\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)  # a fresh process: nothing imported yet
