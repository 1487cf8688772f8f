"""Leveled reward for the aux + main code collaboration (after the reference environment's levels).

| level | check                                                        | weight key        | default |
|-------|--------------------------------------------------------------|-------------------|---------|
| 1     | agent 0 defines `aux` with a `return`                        | aux_defined       | +0.4    |
| 1     | agent 1 defines the entry point with a `return` (else stop)  | main_defined      | +0.6    |
| 2     | imports + aux + main parse as one program (else stop)        | syntax            | +0.5    |
| 3     | fraction of test cases passed (timeouts count as failures)   | tests             | +0..1.0 |
| bonus | >= 1 test passes, aux defined and main calls aux             | aux_used          | +0.5    |
| bonus | ... and main is not a thin wrapper (`return aux(...)`)       | non_wrapper       | +1.0    |
| bonus | ... and main calls aux but discards its result               | ignored_aux       | -0.5    |

Final reward = (sum + shift) * scale. Everything here is static analysis with `ast`; running the
tests is the sandbox's job, and its pass counts come in as numbers.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

AUX = "aux"
FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class RewardWeights:
    aux_defined: float = 0.4
    main_defined: float = 0.6
    syntax: float = 0.5
    tests: float = 1.0
    aux_used: float = 0.5
    non_wrapper: float = 1.0
    ignored_aux: float = -0.5
    shift: float = 0.0
    scale: float = 1.0


@dataclass(frozen=True)
class Analysis:
    aux_source: str | None  # the `def aux` found in agent 0's completion
    main_source: str | None  # the entry point's `def` found in agent 1's completion
    aux_defined: bool  # defined with a return statement
    main_defined: bool
    program: str | None  # imports + aux + main, when main is defined
    parses: bool
    main_calls_aux: bool
    is_wrapper: bool  # main's body is only `return aux(...)`
    ignores_aux: bool  # main calls aux as a bare statement, dropping its result


def strip_fences(text: str) -> str:
    """Code inside markdown fences when there are any (models love them), else the text itself."""
    blocks = FENCE.findall(text)
    return "\n".join(blocks) if blocks else text


def syntax_error(text: str) -> str | None:
    """`line L, column C: message` for a completion (fences stripped) that does not parse, else None."""
    try:
        ast.parse(strip_fences(text))
    except SyntaxError as e:
        return f"line {e.lineno}, column {e.offset}: {e.msg}"
    return None


def find_function(text: str, name: str) -> ast.FunctionDef | None:
    """The top-level `def name` of `text`, parsing only that function when the rest is broken."""
    code = strip_fences(text)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        tree = _parse_def_only(code, name)
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def _parse_def_only(code: str, name: str) -> ast.Module | None:
    """Cut from `def name(` to the next line at the same or lower indent, and parse that."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"\s*(async\s+)?def\s+{re.escape(name)}\s*\(", line):
            indent = len(line) - len(line.lstrip())
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
                end += 1
            try:
                return ast.parse("\n".join(l[indent:] for l in lines[i:end]))
            except SyntaxError:
                return None
    return None


def _own_nodes(fn: ast.AST):
    """Nodes of a function body, not descending into nested functions, lambdas or classes."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def has_return(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Return) and n.value is not None for n in _own_nodes(fn))


def _is_aux_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == AUX


def calls_aux(fn: ast.FunctionDef) -> bool:
    return any(_is_aux_call(n) for n in ast.walk(fn))


def ignores_aux(fn: ast.FunctionDef) -> bool:
    """A statement that is only `aux(...)`: the call runs, its value is thrown away."""
    return any(isinstance(n, ast.Expr) and _is_aux_call(n.value) for n in ast.walk(fn))


def is_wrapper(fn: ast.FunctionDef) -> bool:
    """Main does nothing but `return aux(...)` (a docstring aside)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                       and isinstance(s.value.value, str))]
    return len(body) == 1 and isinstance(body[0], ast.Return) and _is_aux_call(body[0].value)


def analyze(aux_completion: str | None, main_completion: str, entry_point: str, imports: str = "") -> Analysis:
    """aux_completion None: single-agent setting (no aux writer)."""
    aux = find_function(aux_completion, AUX) if aux_completion is not None else None
    main = find_function(main_completion, entry_point)
    aux_src = ast.unparse(aux) if aux is not None else None
    main_src = ast.unparse(main) if main is not None else None
    program = None
    parses = False
    if main is not None:
        program = "\n\n".join(part for part in (imports.strip(), aux_src, main_src) if part)
        try:
            ast.parse(program)
            parses = True
        except SyntaxError:
            parses = False
    return Analysis(
        aux_source=aux_src,
        main_source=main_src,
        aux_defined=aux is not None and has_return(aux),
        main_defined=main is not None and has_return(main),
        program=program,
        parses=parses,
        main_calls_aux=main is not None and calls_aux(main),
        is_wrapper=main is not None and is_wrapper(main),
        ignores_aux=main is not None and ignores_aux(main),
    )


def score(a: Analysis, passed: int, total: int, w: RewardWeights = RewardWeights()) -> tuple[float, dict[str, float]]:
    """Reward and its parts per level. `passed`/`total`: test cases of the combined program."""
    parts = {"aux_defined": w.aux_defined if a.aux_defined else 0.0}
    if a.main_defined:
        parts["main_defined"] = w.main_defined
        if a.parses:
            parts["syntax"] = w.syntax
            parts["tests"] = w.tests * (passed / total if total else 0.0)
            if passed > 0 and a.aux_source is not None and a.main_calls_aux:
                parts["aux_used"] = w.aux_used
                parts["non_wrapper"] = 0.0 if a.is_wrapper else w.non_wrapper
                parts["ignored_aux"] = w.ignored_aux if a.ignores_aux else 0.0
    return (sum(parts.values()) + w.shift) * w.scale, parts
