"""Leveled reward for the helpers + entry point code collaboration (after the reference
environment's levels). With N agents, agents 0..N-2 each write one helper (`helper_names`: `aux`,
`aux2`, `aux3`, ...) and agent N-1 writes the entry point ("main"). A per-helper level pays its
weight times the fraction of helpers that reach it, so N=2 (one helper, `aux`) is the original
reward and the maximum stays 4.0 for every N.

| level | check                                                           | weight key    | default |
|-------|-----------------------------------------------------------------|---------------|---------|
| 1     | helpers defined with a `return` (fraction of the N-1)           | aux_defined   | +0.4    |
| 1     | agent N-1 defines the entry point with a `return` (else stop)   | main_defined  | +0.6    |
| 2     | imports + helpers + main parse as one program (else stop)       | syntax        | +0.5    |
| 3     | fraction of test cases passed (timeouts count as failures)      | tests         | +0..1.0 |
| bonus | >= 1 test passes and main calls >= 1 helper; then:              |               |         |
|       |   fraction of helpers that exist and main calls                 | aux_used      | +0.5    |
|       |   main is not a thin wrapper (`return <helper>(...)`)           | non_wrapper   | +1.0    |
|       |   fraction of helpers whose result main discards (bare call)    | ignored_aux   | -0.5    |

Final reward = (sum + shift) * scale. Everything here is static analysis with `ast`; running the
tests is the sandbox's job, and its pass counts come in as numbers.
"""
from __future__ import annotations

import ast
import re
import textwrap
import threading
import warnings
from dataclasses import dataclass
from typing import Sequence

AUX = "aux"
USAGES = ("no_aux", "not_called", "ignored", "used")  # worst to best
FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
# A last line that starts a `def` and never reaches its colon: what a stop string such as "\n\ndef"
# (end a reply where a second function begins) leaves behind. It is never valid code.
UNFINISHED_DEF = re.compile(r"\n[ \t]*(?:async[ \t]+)?def\b[^\n:]*\Z")


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


def helper_names(count: int) -> list[str]:
    """Names of the helpers written by agents 0..count-1: `aux`, `aux2`, `aux3`, ..."""
    return [AUX if k == 0 else f"{AUX}{k + 1}" for k in range(count)]


@dataclass(frozen=True)
class Helper:
    """One helper writer's function, as the entry point sees it."""
    name: str
    source: str | None  # the `def name` found in the writer's completion
    defined: bool  # defined with a return statement
    called: bool  # main calls it
    ignored: bool  # main calls it as a bare statement, dropping its result

    @property
    def used(self) -> bool:
        return self.source is not None and self.called

    @property
    def usage(self) -> str:
        """One of USAGES: missing, not called by main, called but its result dropped, used."""
        if self.source is None:
            return "no_aux"
        if not self.called:
            return "not_called"
        return "ignored" if self.ignored else "used"


@dataclass(frozen=True)
class Analysis:
    helpers: tuple[Helper, ...]  # agents 0..N-2 in order; empty for a single agent
    main_source: str | None  # the entry point's `def` found in agent N-1's completion
    main_defined: bool
    program: str | None  # imports + helpers + main, when main is defined
    parses: bool
    is_wrapper: bool  # main's body is only `return <helper>(...)`

    # Two-agent names (one helper, `aux`), kept for callers written before N agents.
    @property
    def aux_source(self) -> str | None:
        return self.helpers[0].source if self.helpers else None

    @property
    def aux_defined(self) -> bool:
        return bool(self.helpers) and all(h.defined for h in self.helpers)

    @property
    def main_calls_aux(self) -> bool:
        return any(h.called for h in self.helpers)


_PARSE_LOCK = threading.Lock()  # catch_warnings swaps process-wide state


def parse(code: str) -> ast.Module:
    """ast.parse, silent about the model's code: an invalid escape such as "\\ " in a string warns once
    per completion (a DeprecationWarning, from Python 3.12 a SyntaxWarning shown by default), and
    under `-W error` it would raise, making the reward depend on the warnings filter."""
    with _PARSE_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(code)


def strip_fences(text: str) -> str:
    """Code inside markdown fences when there are any (models love them), else the text itself;
    without an unfinished `def` line at the end (UNFINISHED_DEF)."""
    blocks = FENCE.findall(text)
    return UNFINISHED_DEF.sub("", "\n".join(blocks) if blocks else text)


def syntax_error(text: str) -> str | None:
    """`line L, column C: message` for a completion (fences stripped) that does not parse, else None."""
    try:
        parse(strip_fences(text))
    except SyntaxError as e:
        return f"line {e.lineno}, column {e.offset}: {e.msg}"
    return None


# What Python's own parser or unparser raise on legal code that is too deep or too large for them here
# (e.g. ~330 chained operators): analysis degrades instead of failing the reward (docs/environments.md).
TOO_DEEP = (RecursionError, MemoryError)


def find_function(text: str, name: str) -> ast.FunctionDef | None:
    """The top-level `def name` of `text`, parsing only that function when the rest is broken."""
    return _find(text, name)[0]


def _find(text: str, name: str) -> tuple[ast.FunctionDef | None, str]:
    """The top-level `def name` of `text` (None if absent, or too deep for the parser) and the code
    it was parsed from (its line numbers refer to that code)."""
    code = strip_fences(text)
    try:
        tree = parse(code)
    except (SyntaxError, *TOO_DEEP):
        tree, code = _parse_def_only(code, name)
    if tree is None:
        return None, code
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node, code
    return None, code


def _parse_def_only(code: str, name: str) -> tuple[ast.Module | None, str]:
    """Cut from `def name(` to the next line at the same or lower indent, and parse that."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"\s*(async\s+)?def\s+{re.escape(name)}\s*\(", line):
            indent = len(line) - len(line.lstrip())
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
                end += 1
            cut = "\n".join(line[indent:] for line in lines[i:end])
            try:
                return parse(cut), cut
            except (SyntaxError, *TOO_DEEP):
                return None, cut
    return None, code


def function_source(fn: ast.FunctionDef, code: str) -> str:
    """The function as the combined program holds it: normalised by ast.unparse, or, where its tree is
    too deep to unparse, its own lines as written (decorators included, dedented)."""
    try:
        return ast.unparse(fn)
    except TOO_DEEP:
        first = min([d.lineno for d in fn.decorator_list] + [fn.lineno])
        return textwrap.dedent("\n".join(code.splitlines()[first - 1 : fn.end_lineno]))


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


def _is_call_of(node: ast.AST, names: frozenset[str]) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names


def calls(fn: ast.FunctionDef, name: str) -> bool:
    return any(_is_call_of(n, frozenset({name})) for n in ast.walk(fn))


def ignores(fn: ast.FunctionDef, name: str) -> bool:
    """A statement that is only `name(...)`: the call runs, its value is thrown away."""
    return any(isinstance(n, ast.Expr) and _is_call_of(n.value, frozenset({name})) for n in ast.walk(fn))


def is_wrapper(fn: ast.FunctionDef, names: frozenset[str] = frozenset({AUX})) -> bool:
    """Main does nothing but `return helper(...)` for one of `names` (a docstring aside)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                       and isinstance(s.value.value, str))]
    return len(body) == 1 and isinstance(body[0], ast.Return) and _is_call_of(body[0].value, names)


def analyze(helpers: Sequence[str] | str | None, main_completion: str, entry_point: str, imports: str = "") -> Analysis:
    """helpers: the completions of agents 0..N-2 in order, writing `helper_names(N-1)`; one string
    is the two-agent form (`aux`), None or () the single-agent setting."""
    completions = () if helpers is None else (helpers,) if isinstance(helpers, str) else tuple(helpers)
    names = helper_names(len(completions))
    found = [_find(text, name) for text, name in zip(completions, names)]
    fns = [fn for fn, _ in found]
    main, main_code = _find(main_completion, entry_point)
    sources = [function_source(fn, code) if fn is not None else None for fn, code in found]
    main_src = function_source(main, main_code) if main is not None else None
    program = None
    parses = False
    if main is not None:
        program = "\n\n".join(part for part in (imports.strip(), *sources, main_src) if part)
        try:
            parse(program)
            parses = True
        except (SyntaxError, *TOO_DEEP):
            parses = False
    return Analysis(
        helpers=tuple(Helper(name, src, fn is not None and has_return(fn), main is not None and calls(main, name),
                             main is not None and ignores(main, name))
                      for name, fn, src in zip(names, fns, sources)),
        main_source=main_src,
        main_defined=main is not None and has_return(main),
        program=program,
        parses=parses,
        is_wrapper=main is not None and is_wrapper(main, frozenset(names)),
    )


def _share(weight: float, flags: Sequence[bool]) -> float:
    """`weight` times the fraction of helpers flagged (exactly `weight` with one flagged helper of one)."""
    return weight * sum(flags) / len(flags) if any(flags) else 0.0


def score(a: Analysis, passed: int, total: int, w: RewardWeights = RewardWeights()) -> tuple[float, dict[str, float]]:
    """Reward and its parts per level. `passed`/`total`: test cases of the combined program."""
    parts = {"aux_defined": _share(w.aux_defined, [h.defined for h in a.helpers])}
    if a.main_defined:
        parts["main_defined"] = w.main_defined
        if a.parses:
            parts["syntax"] = w.syntax
            parts["tests"] = w.tests * (passed / total if total else 0.0)
            used = [h.used for h in a.helpers]
            if passed > 0 and any(used):
                parts["aux_used"] = _share(w.aux_used, used)
                parts["non_wrapper"] = 0.0 if a.is_wrapper else w.non_wrapper
                parts["ignored_aux"] = _share(w.ignored_aux, [h.used and h.ignored for h in a.helpers])
    return (sum(parts.values()) + w.shift) * w.scale, parts
