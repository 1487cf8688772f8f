"""Code-env feedback from what scoring found, from most to least detailed:

- `level_feedback`: each level with its diagnostics (definitions, syntax error with line/column,
  tests passed p/t with the first failing case and its error, each helper's usage, thin-wrapper
  warning);
- `level_passed`: the same levels as bare passed/failed;
- `passed`: one line, all levels passed or not.

All three read the code env's context (no re-run of the sandbox) and share the prompt layout of
external/prompts.py.
"""
from __future__ import annotations

from typing import Any, Mapping

from magrpo.feedback import FEEDBACK

from .prompts import CODE_CONTEXT, assemble

AUX_USAGE = {
    "no_aux": "there is no `{helper}` to call.",
    "not_called": "`{entry}` does not call `{helper}`.",
    "ignored": "`{entry}` calls `{helper}` but ignores its result.",
    "used": "`{entry}` uses the result of `{helper}`.",
}


def _returned_calls(helpers: list[str], quote: str = "") -> str:
    """What a thin wrapper returns: `aux(...)`, or `aux(...)` or `aux2(...)` with several helpers."""
    return " or ".join(f"{quote}{h}(...){quote}" for h in helpers)


def levels(context: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """(level name, passed) in reward order; the helper levels once per helper writer (none alone)."""
    helpers, entry = context["functions"][:-1], context["entry_point"]
    out = [(f"{h} defined", ok) for h, ok in zip(helpers, context["helper_defined"])]
    out += [(f"{entry} defined", context["main_defined"]),
            ("syntax", context["syntax_ok"]),
            ("tests", context["ran"] and context["passed"] == context["total"] and not context["timed_out"])]
    if helpers:
        used = [usage == "used" for usage in context["helper_usage"]]
        out += [(f"{h} used", ok) for h, ok in zip(helpers, used)]
        out += [(f"{entry} does more than return {_returned_calls(helpers)}", any(used) and not context["is_wrapper"])]
    return out


def diagnostics(context: Mapping[str, Any], agent: int) -> str:
    entry, functions = context["entry_point"], context["functions"]
    helpers = functions[:-1]
    lines = [f"- `{h}`: " + ("defined with a return." if ok else "not found with a return statement.")
             for h, ok in zip(helpers, context["helper_defined"])]
    lines.append(f"- `{entry}`: " + ("defined with a return." if context["main_defined"]
                                     else "not found with a return statement."))
    if context["syntax_ok"]:
        lines.append("- syntax: the combined program parses.")
    else:  # raw completions: the error that kept a function from being found
        for a, error in enumerate(context["syntax_errors"]):
            if error:
                whose = "your code" if a == agent else f"the code of `{functions[a]}`"
                lines.append(f"- syntax error in {whose} at {error}")
    if context["ran"]:
        if context["timed_out"]:
            lines.append(f"- tests: timed out; {context['passed']}/{context['total']} passed before the limit.")
        else:
            lines.append(f"- tests: {context['passed']}/{context['total']} passed.")
        failure = context["first_failure"]
        if failure is not None and not context["timed_out"]:
            case = "\n".join("    " + line for line in failure["case"].splitlines())
            lines.append(f"  First failing test:\n{case}\n  Error: {failure['error']}")
    else:
        lines.append("- tests: not run (the program is incomplete).")
    if helpers and context["main_defined"]:
        lines += [f"- {h} usage: " + AUX_USAGE[usage].format(entry=entry, helper=h)
                  for h, usage in zip(helpers, context["helper_usage"])]
        if context["is_wrapper"]:
            lines.append(f"- warning: `{entry}` only returns {_returned_calls(helpers, '`')}; "
                         f"do part of the work in `{entry}` itself.")
    return "Feedback on the combined program:\n" + "\n".join(lines)


def level_lines(context: Mapping[str, Any], agent: int) -> str:
    return "Checks:\n" + "\n".join(f"- {name}: {'passed' if ok else 'failed'}" for name, ok in levels(context))


def passed_line(context: Mapping[str, Any], agent: int) -> str:
    return "Result: all checks passed." if all(ok for _, ok in levels(context)) else "Result: not all checks passed."


def _mode(paragraph):
    """A feedback function showing `paragraph(context, agent)` between the code and the instruction."""

    def mode(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent, **context):
        return [assemble(i, num_agents, context, prompt_history_per_agent, response_history_per_agent,
                         paragraph(context, i)) for i in range(num_agents)]

    mode.requires_context = CODE_CONTEXT
    return mode


level_feedback = FEEDBACK.register("level_feedback")(_mode(diagnostics))
level_passed = FEEDBACK.register("level_passed")(_mode(level_lines))
passed = FEEDBACK.register("passed")(_mode(passed_line))
