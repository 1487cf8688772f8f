"""magrpo's modules form a layered graph: no import cycles (top-level or inside functions), and each
module imports on its own. A cycle is how `config.validate` once reached the backends and came back."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "magrpo"


def module_name(path: Path) -> str:
    """magrpo/backends/hf.py -> "backends.hf"; a subpackage's __init__.py -> its name ("backends")."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(name for name in map(module_name, PACKAGE.rglob("*.py")) if name)  # "" is magrpo itself


def source_of(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def known_module(dotted: str) -> str | None:
    """The magrpo module a dotted name (relative to magrpo) lands in: "backends.hf.HFBackend" ->
    "backends.hf"; None outside magrpo's modules."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def imports_of(module: str) -> set[str]:
    """The magrpo modules `module` imports anywhere: lazy imports, and `if TYPE_CHECKING:` blocks too
    (they never run, but an annotation that names a module above is a layer turned upside down: the
    circle models -> tool_loop -> conversation -> models ran through one). A submodule's own package
    __init__, which Python runs first, is not counted: a package that imports its submodules only on
    use (backends) is no cycle."""
    package = module.split(".") if source_of(module).name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()

    def resolve(node: ast.ImportFrom) -> list[str]:
        """The dotted names (relative to magrpo) an import may load: the module and each name from it."""
        if node.level:  # relative to this module's package (level 1) or a parent of it
            stem = [*package[: len(package) - node.level + 1], *([node.module] if node.module else [])]
        elif node.module == "magrpo" or (node.module or "").startswith("magrpo."):
            stem = node.module.split(".")[1:]
        else:
            return []
        return [".".join([*stem, alias.name]) for alias in node.names] + [".".join(stem)]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom):
            found.update(filter(None, map(known_module, resolve(node))))
        elif isinstance(node, ast.Import):
            found.update(filter(None, (known_module(a.name.removeprefix("magrpo."))
                                       for a in node.names if a.name.startswith("magrpo."))))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source_of(module).read_text()))
    return found - {module}


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
    # lifeline and mcp_relay run as scripts (python -I -S): the stdlib only
    for module in ("errors", "paths", "sampling", "distributed", "lifeline", "mcp_relay"):
        assert imports_of(module) == set(), module
    assert imports_of("config") <= {"errors"}
    assert imports_of("registry") <= {"errors"}  # a plugin's hook runs under limits.user_code_timeout_s


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


def test_imports_in_a_subpackage_resolve_to_modules():
    """`from ..models import Agent` in backends/hf.py is magrpo.models, `from .base import x` is
    magrpo.backends.base: a cycle through a subpackage is seen like any other."""
    assert {"backends.base", "generation", "models", "sampling"} <= imports_of("backends.hf")
    assert {"backends.hf", "backends.vllm"} <= imports_of("backends")
