"""The code env's built-in tools (docs/tools.md), registered when the env is imported:
`tools=[run_python]` runs a snippet, `tools=[run_tests]` runs code against the problem's visible
examples. Both run model-written code in the judge's sandbox (`env.sandbox`), each call for at most
`env.tool_timeout_s` seconds. They read the problem from the env's tool context
(`CodeEnv.tool_context`), which holds the statement and its examples and never the hidden tests.
"""
from __future__ import annotations

import ast
import math
from dataclasses import replace
from typing import Any, Mapping

from magrpo.tool_state import ToolContext
from magrpo.tools import TOOLS, function_tool

from .examples import Example
from .problems import wrap_case
from .reward import strip_fences
from .sandbox import Program, SandboxLimits, run_program
from .script import ScriptResult, run_script

OUTPUT_BYTES = 2_000  # of stdout and of stderr each, per call: room for both in tools.max_output_chars


def tool_limits(limits: SandboxLimits, timeout_s: float) -> SandboxLimits:
    """The judge's limits with the tools' short time limit (CPU time too) and output cap."""
    return replace(limits, timeout_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)), output_bytes=OUTPUT_BYTES)


def _problem(context: ToolContext, tool: str) -> Mapping[str, Any]:
    problem = context.problem
    if not isinstance(problem, Mapping) or "tool_limits" not in problem:
        raise ValueError(f"{tool} comes with the code env (env=code); this problem has no code env context")
    return problem


def run_python(code: str, *, context: ToolContext) -> str:
    """Run a Python snippet (standard library only, a few seconds at most) and see its exit status,
    stdout and stderr. Print what you want to see."""
    limits = _problem(context, "run_python")["tool_limits"]
    return describe_script(run_script(strip_fences(code), limits), limits)


def describe_script(result: ScriptResult, limits: SandboxLimits) -> str:
    if result.timed_out:
        head = f"timed out after {limits.timeout_s:g} s (killed)"
    elif result.returncode is not None and result.returncode < 0:
        head = f"killed by signal {-result.returncode}"
    else:
        head = f"exit status {result.returncode}"
    parts = [head]
    for name, text, cut in (("stdout", result.stdout, result.stdout_cut), ("stderr", result.stderr, result.stderr_cut)):
        if text or cut:
            note = f"\n[{name} cut at {limits.output_bytes} bytes]" if cut else ""
            parts.append(f"{name}:\n{text.rstrip(chr(10))}{note}")
    return "\n".join(parts)


def run_tests(code: str, *, context: ToolContext) -> str:
    """Run your code (the function the problem asks for, and any it calls) on the examples the problem
    shows, and see which pass; for a failure, the expected value and what your code returned."""
    problem = _problem(context, "run_tests")
    entry, examples = problem["entry_point"], problem["examples"]
    if not examples:
        return "this problem shows no examples to run; check your code with run_python if you have it"
    source = strip_fences(code).strip()
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"error: the code does not parse: {e.msg} (line {e.lineno})"
    if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == entry for n in tree.body):
        return f"error: the code defines no function `{entry}`, which the examples call"
    # The statement's imports and helpers before the code (as the env's grading does), and in the
    # judge before the examples; nothing of the hidden tests is in either.
    program = Program(code=f"{problem['preamble']}\n{source}\n", preamble=problem["preamble"],
                      cases=[wrap_case(example.case(), entry) for example in examples], entry_point=entry)
    return describe_tests(examples, run_program(program, problem["tool_limits"]))


def describe_tests(examples: tuple[Example, ...], result) -> str:
    lines = [f"{result.passed} of {len(examples)} examples passed" + (" (timed out)" if result.timed_out else "")]
    for example, case in zip(examples, result.cases):
        if case.passed:
            lines.append(f"passed: {example.call} == {example.expected}")
            continue
        error = case.error or "failed"
        got = error.removeprefix("AssertionError: ") if error.startswith("AssertionError: got ") else f"but {error}"
        lines.append(f"FAILED: {example.call}: expected {example.expected}, {got}")
    if result.stdout.strip():
        lines.append(f"stdout:\n{result.stdout.strip()}")
    return "\n".join(lines)


TOOLS.register("run_python")(function_tool(run_python))
TOOLS.register("run_tests")(function_tool(run_tests))
