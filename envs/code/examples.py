"""A problem's visible examples: the input/output pairs its statement shows the agents, which the
`run_tests` tool runs (the hidden tests in `test` never leave the judge).

HumanEval-style datasets have no separate field for them, so they are read from the entry point's
docstring, in two forms:
* doctest lines: `>>> f(1, 2)` followed by the expected value on the next line;
* comparisons: `f(1, 2) == 3`, also written with `==>`, `=>`, `->` or `➞` (HumanEval's other styles),
  on a line of their own or after `>>>`.
Only calls of the entry point whose expected value is a Python expression count (prose, a traceback or
a `>>>` line without output are skipped). HumanEval: 355 examples, in 124 of its 164 problems; the
other 40 show none in a form read here (or call a function of another name) and get none.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

ARROWS = r"==>|==|=>|->|➞"


@dataclass(frozen=True)
class Example:
    call: str  # an expression, e.g. "add(1, 2)"
    expected: str  # the expected value as written in the statement, e.g. "3"

    def case(self) -> str:
        """A judge case (magrpo's sandbox): the call, then an assert whose message says what came back."""
        return f"_got = {self.call}\nassert _got == ({self.expected}), 'got ' + repr(_got)"


def _expression(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return False
    return bool(text.strip())


def _docstring(prompt: str, entry_point: str) -> str:
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return prompt  # a prompt that does not parse: read all of it
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            return ast.get_docstring(node) or ""
    return ""


def visible_examples(prompt: str, entry_point: str) -> tuple[Example, ...]:
    """The examples of `entry_point`'s docstring in `prompt`, in order, without repeats."""
    lines = _docstring(prompt, entry_point).splitlines()
    one_line = re.compile(rf"^({re.escape(entry_point)}\(.*\))\s*(?:{ARROWS})\s*(.+?)[.,;]?$")
    found = []
    for line, after in zip(lines, [*lines[1:], ""]):  # read by hand: doctest refuses odd indents
        text, after = line.strip(), after.strip()
        call = text.removeprefix(">>>").strip()
        readings = [(call, after)] if text.startswith(">>>") and not after.startswith(">>>") else []
        if match := one_line.match(call):  # `f(x) == y`, as a line or as a `>>>` line of its own
            readings.append(match.groups())
        for call, expected in readings:
            if entry_point in call and _expression(call) and _expression(expected):
                found.append(Example(call, expected))
                break
    return tuple(dict.fromkeys(found))
