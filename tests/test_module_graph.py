"""magrpo's modules form a layered graph: no import cycles (top-level or inside functions), and each
module imports on its own. A cycle is how `config.validate` once reached the backends and came back."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "magrpo"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_of(module: str) -> set[str]:
    """The magrpo modules `module` imports anywhere (lazy imports included; `if TYPE_CHECKING:` blocks,
    which never run, excluded)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("magrpo."):
                found.add(node.module.split(".")[1])
            elif node.module == "magrpo":
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("magrpo."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse((PACKAGE / f"{module}.py").read_text()))
    return (found & set(MODULES)) - {module}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := walk(start)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle_through_a_lazy_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_magrpo_has_no_import_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_bottom_layer_imports_nothing_above_it():
    """Every module may import these, so they import nothing of magrpo but errors."""
    for module in ("errors", "paths", "registry", "sampling", "distributed"):
        assert imports_of(module) == set(), module
    assert imports_of("config") <= {"errors"}


def test_each_module_imports_alone():
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'magrpo' or m.startswith('magrpo.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module('magrpo.' + name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
