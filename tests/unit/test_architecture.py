"""The architecture as a test (docs/architecture.md): layers that import only downward, no import cycle between
packages or files, Prefect kept out of the control plane and the cluster side, and no file or function grown past
what a reader takes in at once. Reads the source (ast), imports nothing of it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

# Top to bottom. A module may import its own layer and those below it, never one above.
LAYERS = ("unbroken", "deployments", "flows", "tasks", "control", "ray_jobs")
# Where the control plane may import Prefect: emitting an event (Prefect's event bus is how a promotion, a refused
# dataset and a recovery reach automations; there is no other channel). Nowhere else below tasks/.
PREFECT_IN_CONTROL = {"control/series/promotion.py", "control/sources.py"}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 40


def _modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import names (``a.b.c`` may be a module, or a name inside ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Every project module ``module`` imports, at the top or inside a function (a lazy import is still a use)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {_resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out |= {_resolve(f"{base}.{a.name}") or _resolve(base) for a in node.names}
    return {m for m in out if m and m != module}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_layers_import_only_downward() -> None:
    upward = sorted(f"{a} -> {b}" for a, bs in GRAPH.items() for b in bs if _layer(b) < _layer(a))
    assert upward == [], "imports that run up the layers:\n" + "\n".join(upward)


def test_no_import_cycle_between_files() -> None:
    assert _cycles(GRAPH) == []


def _unit(module: str) -> str:
    """What a cycle is counted between: a module's package -- but a file beside subpackages (``control/registry.py``
    beside ``control/backends/``) is a unit of its own, so a cycle through a package and its parent is seen too."""
    if MODULES[module].name == "__init__.py":
        return module
    package = module.rpartition(".")[0]
    return module if any(m.startswith(package + ".") and _unit_package(m) != package for m in MODULES) else package


def _unit_package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def test_no_import_cycle_between_packages_a_package_and_its_parent_included() -> None:
    units: dict[str, set[str]] = defaultdict(set)
    for a, bs in GRAPH.items():
        units[_unit(a)] |= {_unit(b) for b in bs} - {_unit(a)}
    assert _cycles(units) == []


def test_no_private_name_is_used_across_modules() -> None:
    """``from m import _name`` or ``m._name`` of a project module: a name another module needs is public."""
    found = []
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in MODULES and _private(a.name):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {base} import {a.name}")
            elif isinstance(node, ast.Import):
                aliases |= {a.asname or a.name: a.name for a in node.names if a.name in MODULES}
        for node in ast.walk(tree):
            value = node.value if isinstance(node, ast.Attribute) and _private(node.attr) else None
            if isinstance(value, ast.Name) and value.id in aliases:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {value.id}.{node.attr}")
    assert found == [], "\n".join(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_fmt_skip_only_on_data_tables() -> None:
    """Code is laid out by ``ruff format`` (make lint checks it), so the sizes above are of formatted code; ``# fmt:
    skip`` keeps a data table's rows one a line, nothing else: the statement it ends assigns a display (a dict, list,
    tuple or set)."""
    found = []
    for path in MODULES.values():
        text = path.read_text()
        if "fmt: skip" not in text:
            continue
        ends = {node.end_lineno: node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.stmt)}
        for n, line in enumerate(text.splitlines(), 1):
            if "# fmt: skip" in line and not _table(ends.get(n)):
                found.append(f"{path.relative_to(ROOT)}:{n}")
    assert found == [], "# fmt: skip outside a data table:\n" + "\n".join(found)


def _table(node: ast.stmt | None) -> bool:
    value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
    return isinstance(value, ast.Dict | ast.List | ast.Tuple | ast.Set)


def test_prefect_stays_above_the_control_plane() -> None:
    uses = set()
    for module, path in MODULES.items():
        if _layer(module) >= LAYERS.index("control"):
            tree = ast.parse(path.read_text())
            names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
            if any(n == "prefect" or n.startswith("prefect.") for n in names):
                uses.add(str(path.relative_to(ROOT)))
    assert uses <= PREFECT_IN_CONTROL, sorted(uses - PREFECT_IN_CONTROL)


def test_tasks_holds_only_prefect_tasks() -> None:
    for path in (ROOT / "tasks").glob("*.py"):
        if path.name != "__init__.py":
            assert "@task(" in path.read_text(), f"{path.name} defines no Prefect task: it belongs to control/"


def test_no_file_or_function_is_too_long_to_read() -> None:
    long_files, long_functions = [], []
    for path in MODULES.values():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long_files == [] and long_functions == [], "\n".join(long_files + long_functions)


def test_only_the_formats_package_tells_a_source_file_format_by_its_name() -> None:
    """A new source file format is a module of ray_jobs/data/formats/ and one line in its READERS: nothing else in
    the product tells a format by a file's suffix (``url.endswith(".parquet")``) -- it asks ``reader_for(url)``."""
    from ray_jobs.data.formats import READERS

    suffixes = {s for r in READERS for s in r.suffixes}
    found = []
    for module, path in _modules().items():
        if module.startswith("ray_jobs.data.formats"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "endswith":
                consts = {c.value for a in node.args for c in ast.walk(a) if isinstance(c, ast.Constant)}
                if consts & suffixes:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


# Backend names that appear with another meaning: ``on="local"`` (where staging runs), ``LOCAL`` (fsspec's local
# protocols), a backend's ``mode`` (a head of this machine, or an existing cluster).
NOT_A_BACKEND = {("ray_jobs/data/staging.py", "local"), ("control/sources.py", "local"),
                 ("control/check/__init__.py", "local")}  # fmt: skip


def test_a_backend_is_one_module_and_its_name_in_the_config() -> None:
    """A new cluster backend is control/backends/<name>.py with a ``BACKEND`` class and its name in the typed config's
    ``BackendName`` (the registration line); the control plane finds it from there, and no other file names a
    backend (a comparison with a backend's name outside control/backends/ and the config is a second list)."""
    from typing import get_args

    from ray_jobs.config import BackendName

    names = set(get_args(BackendName))
    for name in names:  # each name leads to its module, whose class says the same name
        module = ROOT / "control" / "backends" / f"{name.replace('-', '_')}.py"
        assert module.is_file(), f"backend {name!r}: no {module.relative_to(ROOT)}"
        assert "\nBACKEND = " in module.read_text(), f"{module.relative_to(ROOT)}: no BACKEND"
    found = []
    for path in MODULES.values():
        where = str(path.relative_to(ROOT))
        if where.startswith(("control/backends/", "ray_jobs/config/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names and (where, node.value) not in NOT_A_BACKEND:
                found.append(f"{where}:{node.lineno} {node.value!r}")
    assert not found, found
