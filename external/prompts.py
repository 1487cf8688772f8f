"""Pieces every built-in mode's next-turn prompt is made of, so the modes differ only in their
feedback paragraph:

    [the agent's first prompt]        external.original_prompt=true (else a one-line role reminder)
    [earlier attempts]                external.history=attempts
    Your previous code: ...
    [feedback paragraph]              the mode's own
    Revise ... Output only ...        the revision instruction

In a conversation (external.history=messages or continuation) the agent already sees its first prompt
and its reply, so the prompt is only the feedback paragraph and the revision instruction.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

# Context keys of the code env that the code modes read (checked at start-up against the env).
CODE_CONTEXT = frozenset({"roles", "functions", "code", "entry_point", "helper_defined", "main_defined", "syntax_ok",
                          "syntax_errors", "ran", "passed", "total", "timed_out", "first_failure", "helper_usage",
                          "is_wrapper"})


def in_conversation(options: Mapping[str, Any]) -> bool:
    """The agent sees its earlier turns itself (external.history=messages | continuation)."""
    return options.get("history_mode") in ("messages", "continuation")


def fenced(code: str) -> str:
    return f"```python\n{code.strip()}\n```"


def instruction(context: Mapping[str, Any], agent: int) -> str:
    name = context["functions"][agent]
    return f"Revise your code. Output only the code of `def {name}(...)`, with a return statement."


def role_line(context: Mapping[str, Any], agent: int, num_agents: int) -> str:
    return f"You are agent {agent} of {num_agents} and you write `{context['functions'][agent]}`."


def assemble(
    agent: int,
    num_agents: int,
    context: Mapping[str, Any],
    prompt_history: Sequence[Sequence[str]],
    response_history: Sequence[Sequence[str]],
    feedback: str,
) -> str:
    """One agent's next-turn prompt in the code env."""
    options = context.get("options", {})
    if in_conversation(options):
        return "\n\n".join([p for p in (feedback, instruction(context, agent)) if p])
    parts = [
        prompt_history[agent][0] if options.get("original_prompt", True) else role_line(context, agent, num_agents)
    ]
    earlier = response_history[agent][:-1]
    if options.get("history", False) and earlier:
        attempts = "\n\n".join(f"Attempt {t + 1}:\n{fenced(code)}" for t, code in enumerate(earlier))
        parts.append(f"Your earlier attempts, oldest first:\n{attempts}")
    parts.append(f"Your previous code:\n{fenced(context['code'][agent] or '# (no code)')}")
    if feedback:
        parts.append(feedback)
    parts.append(instruction(context, agent))
    return "\n\n".join(parts)
