"""The package's import structure: every module imports on its own, the modules import each other
without cycles, and no module imports another's private names.

The cycle check reads the sources (ast), so it also sees the imports inside functions: an import
moved into a function still closes a cycle, it only hides it until the function runs. Imports under
`if TYPE_CHECKING:` are for annotations only and are left out.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Found, not imported: the static checks read the sources even when the package would not import.
_SPEC = importlib.util.find_spec("tokenloom")
assert _SPEC is not None and _SPEC.origin is not None
ROOT = Path(_SPEC.origin).parent


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (packages as their __init__.py), found without
    importing any of them."""
    found = {"tokenloom": ROOT / "__init__.py"}

    def walk(path: Path, prefix: str) -> None:
        for info in pkgutil.iter_modules([str(path)]):
            name = f"{prefix}.{info.name}"
            if info.ispkg:
                found[name] = path / info.name / "__init__.py"
                walk(path / info.name, name)
            else:
                found[name] = path / f"{info.name}.py"

    walk(ROOT, "tokenloom")
    return found


MODULES = _modules()


# --- every module imports in a fresh interpreter --------------------------------------------------------
# One interpreter per module would pay torch's import (~2 s) each time. Instead one interpreter imports
# the third-party libraries, nothing of tokenloom, and forks a child per module: each child starts with
# no tokenloom module loaded, as a fresh interpreter would, and imports just its one module.
_FORK_SERVER = r"""
import importlib, json, multiprocessing, os, sys, traceback
for lib in ("torch", "numpy", "safetensors", "tokenizers", "gguf", "jinja2", "fastapi", "uvicorn", "pydantic",
            "prometheus_client", "httpx", "zmq", "pandas", "tqdm", "psutil", "matplotlib"):
    try:
        importlib.import_module(lib)
    except ImportError:
        pass
assert not any(m == "tokenloom" or m.startswith("tokenloom.") for m in sys.modules)

def try_import(name):
    try:
        importlib.import_module(name)
        return None
    except BaseException:
        return traceback.format_exc(limit=-8)

if __name__ == "__main__":
    names = json.loads(sys.stdin.read())
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(max(2, os.cpu_count() or 2), maxtasksperchild=1) as pool:
        errors = dict(zip(names, pool.map(try_import, names, chunksize=1)))
    print(json.dumps({n: e for n, e in errors.items() if e}))
"""


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    names = sorted(MODULES)
    if sys.platform == "win32":  # no fork: one interpreter per module
        failed = {}
        for name in names:
            r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
            if r.returncode:
                failed[name] = r.stderr
    else:
        r = subprocess.run([sys.executable, "-c", _FORK_SERVER], input=json.dumps(names), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
        failed = json.loads(r.stdout.strip().splitlines()[-1])
    assert not failed, "modules that fail to import on their own:\n" + "\n".join(
        f"--- {name}\n{err}" for name, err in failed.items())


# --- the import graph ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # the tokenloom module imported
    names: tuple[str, ...]  # `from target import names` (empty for `import target`)
    line: int
    in_function: bool


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, source: str, is_pkg: bool) -> list[Import]:
    """The tokenloom imports of module `name`, at any depth except under `if TYPE_CHECKING:`."""
    out: list[Import] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tokenloom" or alias.name.startswith("tokenloom."):
                    out.append(Import(name, alias.name, (), node.lineno, in_function))
        elif isinstance(node, ast.ImportFrom):
            module = resolve(node)
            if module == "tokenloom" or module.startswith("tokenloom."):
                # `from pkg import submodule` imports the submodule; other names come from `pkg` itself.
                subs = [a.name for a in node.names if f"{module}.{a.name}" in MODULES]
                rest = tuple(a.name for a in node.names if f"{module}.{a.name}" not in MODULES)
                out.extend(Import(name, f"{module}.{s}", (), node.lineno, in_function) for s in subs)
                if rest:
                    out.append(Import(name, module, rest, node.lineno, in_function))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source, name), False)
    return out


IMPORTS = {name: _imports(name, path.read_text(), path.name == "__init__.py") for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected component that has one (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                components.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles = []
    for comp in components:  # a shortest cycle through the component's first module (breadth-first)
        members, start = set(comp), comp[0]
        parent: dict[str, str] = {}
        frontier, seen = [start], {start}
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        found = v
                        break
                    if w not in seen:
                        seen.add(w)
                        parent[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        assert found is not None
        path = [found]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycles.append([*reversed(path), start])
    return cycles


def _edge(importer: str, target: str) -> str:
    imp = next(i for i in IMPORTS[importer] if i.target == target)
    where = "inside a function, " if imp.in_function else ""
    return f"{importer} -> {target} ({where}{MODULES[importer].relative_to(ROOT.parent)}:{imp.line})"


def test_modules_import_each_other_without_cycles() -> None:
    graph = {name: {i.target for i in imports if i.target != name} for name, imports in IMPORTS.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (an import inside a function closes one too), one per group:\n" + "\n".join(
        "  " + "  |  ".join(_edge(a, b) for a, b in zip(cycle, cycle[1:])) for cycle in cycles)


def test_no_module_imports_another_modules_private_names() -> None:
    private = [
        f"{MODULES[i.importer].relative_to(ROOT.parent)}:{i.line}: from {i.target} import {n}"
        for imports in IMPORTS.values() for i in imports for n in i.names
        if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))
    ]
    assert not private, "private names imported from another module:\n" + "\n".join(private)


def test_the_graph_sees_imports_of_every_kind() -> None:
    """The walker itself: relative imports, `from package import submodule`, imports inside functions
    (counted) and under `if TYPE_CHECKING:` (left out)."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "from tokenloom.models import gguf\n"
        "from . import limits\n"
        "if TYPE_CHECKING:\n"
        "    from tokenloom.llm import LLM\n"
        "class C:\n"
        "    from tokenloom.outputs import RequestOutput\n"
        "def f():\n"
        "    from tokenloom.errors import _hidden\n"
    )
    found = {(i.target, i.names, i.in_function) for i in _imports("tokenloom.kernels", src, is_pkg=True)}
    assert found == {
        ("tokenloom.models.gguf", (), False),
        ("tokenloom.kernels.limits", (), False),
        ("tokenloom.outputs", ("RequestOutput",), False),
        ("tokenloom.errors", ("_hidden",), True),
    }
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
