"""The layout's rules, checked: the public names are listed once (``__init__.pyi``) and import, no
import cycle (between modules, nor between subpackages), modules and classes stay small or say why,
and private torch is touched in one module."""

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
# Import cycles between the package's first-level parts (a subpackage ``_x`` taken as one, or a
# top-level module), still to be broken: remove an entry when it is; the test fails when one is no
# longer needed. None left.
PENDING_PACKAGE_CYCLES: set[frozenset[str]] = set()
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


def test_public_names_are_the_stubs_and_import_from_the_package():
    """``__init__.pyi`` is the one list of public names: ``__all__`` and the lazy imports are built from
    its ``from .module import Name as Name`` lines, so it holds nothing else a type checker would take
    for public, and no name twice. Each name imports, in a fresh process, from the package's modules."""
    stub = ast.parse((PACKAGE / "__init__.pyi").read_text())
    imports = [n for n in stub.body if isinstance(n, ast.ImportFrom)]
    others = [
        ast.unparse(n)
        for n in stub.body
        if not (n in imports and n.level == 1 and all(a.asname == a.name for a in n.names))
        and not (isinstance(n, ast.AnnAssign) and ast.unparse(n.target) in ("__all__", "__version__"))
    ]
    assert not others, f"__init__.pyi holds only `from .module import Name as Name` lines: {others}"
    names = torch_storage_loader.__all__
    assert len(names) == sum(len(n.names) for n in imports), "a name is imported twice in __init__.pyi"
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


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of ``graph`` with more than one node."""
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
    return cycles


def test_no_import_cycles():
    modules = _modules()
    known = set(modules)
    graph = {n: _imports(n, p, known) for n, p in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}"


def _part(module: str) -> str:
    """The first-level part of the package ``module`` is in: its subpackage, or itself."""
    return module.split(".", 1)[0] or "__init__"


def test_no_import_cycles_between_subpackages():
    """Each subpackage (``_format``, ``_shm``, ...) taken as one: no two depend on each other, also not
    through top-level modules (imports inside functions count)."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {_part(n): set() for n in modules}
    for name, path in modules.items():
        graph[_part(name)] |= {_part(t) for t in _imports(name, path, known)} - {_part(name)}
    cycles = set(_cycles(graph))
    assert cycles >= PENDING_PACKAGE_CYCLES, (
        f"no longer cycles: remove {[sorted(c) for c in PENDING_PACKAGE_CYCLES - cycles]} from PENDING_PACKAGE_CYCLES"
    )
    assert cycles <= PENDING_PACKAGE_CYCLES, (
        f"import cycles between subpackages: {[sorted(c) for c in cycles - PENDING_PACKAGE_CYCLES]}"
    )


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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_torch(tree: ast.AST) -> set[str]:
    """What ``tree`` reaches of private torch through its imports: a private module or name imported
    from torch (``torch._C``, ``from torch.utils.data._utils import ...``, ``_BaseDataLoaderIter``), or a
    private attribute of a name imported from torch (``torch._utils``, ``dataloader._BaseDataLoaderIter``)."""
    bound, found = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    found |= {a.name} if any(_private(p) for p in a.name.split(".")) else set()
                    bound.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                if any(_private(p) for p in [*node.module.split("."), a.name]):
                    found.add(f"{node.module}.{a.name}")
                bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.add(ast.unparse(node))
    return found


def test_private_torch_only_in_its_home():
    users = set()
    for path in _modules().values():
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        if PRIVATE_TORCH_NAMES.search(code) or _private_torch(ast.parse(path.read_text())):
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


def test_hooks_not_installed_by_import():
    """Importing the package, or any module of it, changes nothing in torch: the DataLoader hooks are
    installed where a ``StorageDataset`` is made (or unpickled), not as an import's side effect."""
    modules = [f"torch_storage_loader.{n}" if n else "torch_storage_loader" for n in _modules()]
    code = (
        "import importlib\n"
        "from torch.utils.data import dataloader\n"
        "from torch.utils.data._utils import collate\n"
        "before = dict(collate.default_collate_fn_map)\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert '__new__' not in dataloader._BaseDataLoaderIter.__dict__, 'installed at import'\n"
        "assert collate.default_collate_fn_map == before, 'default_collate_fn_map changed at import'\n"
        "from torch_storage_loader import StorageDataset\n"
        "StorageDataset([])\n"
        "assert '__new__' in dataloader._BaseDataLoaderIter.__dict__, 'not installed by StorageDataset()'\n"
        "assert set(collate.default_collate_fn_map) - set(before), 'no collate entry from StorageDataset()'\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)  # a fresh process: nothing imported yet


def test_the_private_torch_scan_sees_what_it_should():
    scan = _private_torch(
        ast.parse(
            "import torch\nimport torch._C as C\nfrom torch.utils.data import dataloader as d, DataLoader\n"
            "from torch.utils.data._utils import collate\nfrom torch.utils.data.dataloader import _BaseDataLoaderIter\n"
            "torch.cuda._sleep(1); d._MultiProcessingDataLoaderIter; DataLoader._iterator; torch.__version__\n"
            "x._private; torch.utils.data.DataLoader\n"
        )
    )
    assert scan == {
        "torch._C",
        "torch.utils.data._utils.collate",
        "torch.utils.data.dataloader._BaseDataLoaderIter",
        "torch.cuda._sleep",
        "d._MultiProcessingDataLoaderIter",
        "DataLoader._iterator",
    }, scan


# Process mechanisms written once, in the leaf _proc.py: at-fork hooks (fork_safe_lock,
# after_fork_in_child) and self-pipes (WakePipe). Nothing else calls these.
PROC_HOME = "_proc.py"
PROC_ONLY_CALLS = {"os.register_at_fork", "os.pipe"}


def test_fork_hooks_and_self_pipes_only_in_proc_which_is_a_leaf():
    callers = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in PROC_ONLY_CALLS:
                callers.add((_rel(path), ast.unparse(node.func)))
    assert {rel for rel, _ in callers} == {PROC_HOME}, (
        f"use _proc's fork_safe_lock, after_fork_in_child or WakePipe instead: {sorted(callers)}"
    )
    modules = _modules()
    assert not _imports("_proc", modules["_proc"], set(modules)), "_proc imports nothing from the package"


def test_conditions_come_from_proc_and_are_never_entered():
    """``with condition`` can leave its lock held for ever when a signal handler raises inside it
    (torch's SIGCHLD handler, Ctrl-C): conditions are made by ``_proc.signal_safe_condition`` and
    code enters their lock. A ``with`` over a name ending in ``cond`` is taken for a condition."""
    made, entered = set(), set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "threading.Condition":
                made.add(_rel(path))
            if isinstance(node, ast.With | ast.AsyncWith):
                for item in node.items:
                    if ast.unparse(item.context_expr).rsplit(".", 1)[-1].endswith("cond"):
                        entered.add(f"{_rel(path)}:{node.lineno}")
    assert made <= {PROC_HOME}, f"make conditions with _proc.signal_safe_condition: {sorted(made)}"
    assert not entered, f"enter the condition's lock, not the condition: {sorted(entered)}"
