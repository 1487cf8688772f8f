"""The offline `reference` expert: edits derived from the dataset's canonical solution.

It stands in for a strong expert model when no endpoint is configured. What it reveals, exactly:
when the joint program passes every test, nothing ("no changes" for every agent); otherwise, when
the problem has a canonical solution, that solution, without its docstring, to every agent: to each
helper writer renamed to its helper (`aux`, `aux2`, ...), to the main writer as the entry point
itself. It reads the test results the env computed while scoring (no second sandbox run). A problem
without a canonical solution gets no proposal, and the mode falls back to level_feedback (counted
as a fallback).
"""
from __future__ import annotations

import ast
import time
from typing import Any, Mapping

from .stats import ExpertStats


def canonical_function(prompt: str, canonical_solution: str, entry_point: str, name: str) -> str | None:
    """The dataset's solution of `entry_point` (docstring dropped), renamed `name`; None if it does not parse."""
    try:
        tree = ast.parse(prompt + canonical_solution)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str) and len(body) > 1:
                node.body = body[1:]
            node.name = name
            return ast.unparse(node)
    return None


class ReferenceExpert:
    name = "reference"
    model = "canonical-solution"

    def __init__(self):
        self.counts = ExpertStats()

    def check(self) -> None:
        """Nothing to reach: the dataset is the expert."""

    def propose(self, prompts: list[str], contexts: list[Mapping[str, Any]]) -> list[dict[str, str] | None]:
        start = time.perf_counter()
        out = [self._edits(prompt, context) for prompt, context in zip(prompts, contexts)]
        self.counts.add(calls=len(out), failures=sum(edits is None for edits in out),
                        latency_s_total=time.perf_counter() - start)
        return out

    def _edits(self, problem: str, context: Mapping[str, Any]) -> dict[str, str] | None:
        roles, functions = context["roles"], context["functions"]
        if context["ran"] and not context["timed_out"] and context["passed"] == context["total"]:
            return {role: "" for role in roles}
        if not context.get("canonical_solution"):
            return None
        edits = {}
        for role, name in zip(roles, functions):
            code = canonical_function(problem, context["canonical_solution"], context["entry_point"], name)
            if code is None:
                return None
            edits[role] = code
        return edits

    def stats(self) -> dict[str, float]:
        return self.counts.snapshot()

    def reset_stats(self) -> None:
        self.counts.reset()
