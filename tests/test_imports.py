"""Imports inside the package run one way: the graph of ``gradfuse`` modules has no cycle.

Read from the source with ``ast`` (nothing is imported), counting every import statement
wherever it stands: a function-level import that closes a circle is a cycle all the same, it
only fails later and more rarely. An edge goes to the module an import names (``from . import
ops`` -> ``gradfuse.ops``; ``from .ops import f`` -> ``gradfuse.ops``); the package
``__init__`` files that Python runs on the way are not edges, or every sibling import would
close a circle through the package itself.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "python" / "gradfuse"


def module_files(root: Path, package: str = "gradfuse") -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` (and ``.pyi`` stub of an extension) under
    ``root``, following symlinked folders (``gradfuse/kernels`` is one)."""
    found: dict[str, Path] = {}
    for folder, _, names in os.walk(root, followlinks=True):
        rel = Path(folder).relative_to(root).parts
        for name in names:
            stem, ext = os.path.splitext(name)
            if ext not in (".py", ".pyi"):
                continue
            dotted = ".".join([package, *rel, *([] if stem == "__init__" else [stem])])
            if ext == ".py" or dotted not in found:
                found[dotted] = Path(folder) / name
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that module ``name`` (at ``path``) imports, anywhere in its body."""
    is_package = path.stem == "__init__"
    here = name.split(".") if is_package else name.split(".")[:-1]
    targets: set[str] = set()

    def nearest_module(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # ``from pkg import name``: the submodule ``pkg.name`` when there is one, else ``pkg``.
            candidates = [f"{source}.{alias.name}" for alias in node.names]
            candidates = [c if c in modules else source for c in candidates]
        else:
            continue
        for candidate in candidates:
            if candidate.split(".")[0] == "gradfuse" and (target := nearest_module(candidate)) and target != name:
                targets.add(target)
    return targets


def import_graph(root: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items() if path.suffix == ".py"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_package_imports_are_acyclic():
    graph = import_graph()
    # The walk must have seen the package, its sub-packages (kernels through its symlink) and the
    # edges this test exists for, or an empty graph would pass.
    for module in ("gradfuse.ops", "gradfuse._cpu", "gradfuse.kernels._norm", "gradfuse.bench.engine"):
        assert module in graph, f"{module} not found under {PACKAGE_DIR}"
    assert "gradfuse._cpu" in graph["gradfuse.ops"]  # a function-level import, counted
    assert "gradfuse.ops" in graph["gradfuse.train.attribution"]  # ``from ..ops import ...``
    assert "gradfuse._rust" in graph["gradfuse._plan"]  # an extension module, known by its stub
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_import_nothing_from_the_package():
    """``gradfuse.kernels`` takes addresses, sizes and dtype codes and launches kernels: it
    imports no module of the package above it (the package's backend imports it)."""
    graph = import_graph()
    kernels = {m for m in graph if m == "gradfuse.kernels" or m.startswith("gradfuse.kernels.")}
    assert "gradfuse.kernels._norm" in kernels and "gradfuse.kernels._launch" in kernels
    upward = {(m, d) for m in kernels for d in graph[m] if d.startswith("gradfuse") and d not in kernels}
    assert not upward, sorted(upward)


@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        # the shape of the old ops <-> _cpu cycle: a top-level import one way, a function-level back
        (
            {"ops.py": "def f():\n    from . import _cpu\n", "_cpu.py": "from . import _rust, ops\n"},
            ["gradfuse._cpu", "gradfuse.ops", "gradfuse._cpu"],
        ),
        # across sub-packages, with ``from ..x import name`` and an absolute import
        (
            {
                "a/__init__.py": "",
                "a/m.py": "from ..b.n import g\n",
                "b/__init__.py": "",
                "b/n.py": "import gradfuse.a.m\n",
            },
            ["gradfuse.a.m", "gradfuse.b.n", "gradfuse.a.m"],
        ),
        # ``from . import x`` inside a package __init__, and x importing the package back by name
        ({"__init__.py": "from . import x\n", "x.py": "import gradfuse\n"}, ["gradfuse", "gradfuse.x", "gradfuse"]),
        # no cycle: siblings through the package __init__ are not edges
        ({"__init__.py": "from . import x, y\n", "x.py": "from . import y\n", "y.py": "import os\n"}, None),
    ],
)
def test_the_cycle_check_finds_cycles(tmp_path, files, cycle):
    """The checker itself can fail: cycles of the shapes this package has had are found."""
    root = tmp_path / "gradfuse"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert find_cycle(import_graph(root)) == cycle
