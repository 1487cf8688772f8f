"""`expert_edits`: an expert proposes edits for each agent's code; the next prompt shows the agent
its previous code and the expert's version of it.

The expert (external.expert.backend) is the offline `reference` (edits from the dataset's canonical
solution, expert/reference.py), any OpenAI-compatible endpoint (`openai`) or a local transformers
model (`hf`). LLM experts get EXPERT_PROMPT and answer with JSON {"aux": ..., "main": ...} (one
key per agent: its helper's name, or "main"). All branches of a turn go to the expert in one call
(concurrent requests, or one batched generate).
A branch whose request fails or whose reply does not parse falls back to the level_feedback
prompt, counted as expert/fallbacks; it is never left with an empty prompt.
"""
from __future__ import annotations

import sys
from typing import Any, Mapping

from magrpo.distributed import is_main_process
from magrpo.feedback import FEEDBACK, Branch, FeedbackMode
from magrpo.metrics import Counter, Gauge

from .expert.cache import open_cache
from .expert.parse import parse_edits
from .levels import diagnostics
from .prompts import CODE_CONTEXT, assemble, fenced

EXPERT_PROMPT = """You review Python code that {count} wrote together for one problem.{roles}

Problem:
{problem}

{codes}

Test results: {results}

Propose the smallest edits that make every test pass. Reply with only a JSON object with the keys \
{keys}: each value is the complete corrected code of that agent's function, or "" when it needs no change."""


def expert_prompt(problem: str, context: Mapping[str, Any]) -> str:
    roles, functions = context["roles"], context["functions"]
    codes = "\n\n".join(
        f'Agent {a} wrote `{functions[a]}` (key "{roles[a]}"):\n{fenced(context["code"][a] or "# (no code)")}'
        for a in range(len(roles))
    )
    if not context["ran"]:
        results = "not run (the program is incomplete)"
    elif context["timed_out"]:
        results = f"timed out after {context['passed']}/{context['total']} passed"
    else:
        results = f"{context['passed']}/{context['total']} passed"
        if context["first_failure"] is not None:
            results += (
                f"; first failing test: {context['first_failure']['case']} -> {context['first_failure']['error']}"
            )
    return EXPERT_PROMPT.format(
        count={1: "one agent", 2: "two agents"}.get(len(roles), f"{len(roles)} agents"),
        roles=_roles_line(functions), problem=problem.strip(), codes=codes, results=results,
        keys=", ".join(f'"{r}"' for r in roles),
    )


def _roles_line(functions: list[str]) -> str:
    """Who writes what, after the first sentence (nothing for a single agent)."""
    helpers, entry = functions[:-1], functions[-1]
    if not helpers:
        return ""
    who = ", ".join(
        f"agent {a} a helper `{h}`" if a else f"Agent 0 writes a helper `{h}`" for a, h in enumerate(helpers)
    )
    calls = f"`{helpers[0]}`" if len(helpers) == 1 else "them"
    return f" {who}; agent {len(helpers)} writes `{entry}`, which may call {calls}."


class LLMExpert:
    """An expert model behind `complete(prompts) -> replies` (OpenAIExpert, HFExpert)."""

    def __init__(self, client):
        self.client, self.name, self.model = client, client.name, client.model

    def check(self) -> None:
        self.client.check()
        self.model = self.client.model  # the openai check may pick the served model

    def propose(self, problems: list[str], contexts: list[Mapping[str, Any]]) -> list[dict[str, str] | None]:
        replies = self.client.complete([expert_prompt(p, c) for p, c in zip(problems, contexts)])
        return [parse_edits(r, c["roles"]) if r is not None else None for r, c in zip(replies, contexts)]

    def stats(self) -> dict[str, float]:
        return self.client.stats()

    def reset_stats(self) -> None:
        self.client.reset_stats()


def make_expert(cfg: Any, max_concurrency: int):
    if cfg.backend == "reference":
        from .expert.reference import ReferenceExpert

        return ReferenceExpert()
    cache = open_cache(cfg.cache)
    if cfg.backend == "openai":
        from .expert.openai_backend import OpenAIExpert

        return LLMExpert(OpenAIExpert(cfg, max_concurrency, cache))
    from .expert.hf_backend import HFExpert

    return LLMExpert(HFExpert(cfg, cache))


def edit_paragraph(context: Mapping[str, Any], agent: int, edit: str) -> str:
    name = context["functions"][agent]
    if not edit.strip():
        return f"An expert reviewed the program and proposes no changes to your `{name}`."
    return f"An expert reviewed the program and proposes this `{name}`:\n{fenced(edit)}"


@FEEDBACK.register("expert_edits")
class ExpertEdits(FeedbackMode):
    requires_context = CODE_CONTEXT | {"canonical_solution"}

    def __init__(self, external_cfg: Any, env: Any):
        super().__init__(external_cfg, env)
        x = external_cfg.expert
        if x.backend == "auto":  # resolved in place, so config.json records which expert ran
            x.backend = "openai" if x.base_url else "reference"
        self.expert = make_expert(x, external_cfg.max_concurrency)
        self.fallbacks = 0

    def check(self) -> None:
        self.expert.check()
        if self.expert.name != "reference":
            self.cfg.expert.model = self.expert.model  # the served model the endpoint picked, for config.json
        if not is_main_process():  # one start-up line per run, not per torchrun process
            return
        if self.expert.name == "reference":
            print(
                "magrpo: expert_edits uses the offline reference expert (no external.expert.base_url): its edits "
                "reveal the dataset's canonical solution when tests fail (docs/feedback.md, 'expert_edits')",
                file=sys.stderr,
            )
        else:
            print(f"magrpo: expert_edits asks {self.expert.name} expert {self.expert.model!r}", file=sys.stderr)

    def batch(self, branches: list[Branch]) -> list[list[str]]:
        proposals = self.expert.propose([b.prompt for b in branches], [b.context for b in branches])
        out = []
        for branch, edits in zip(branches, proposals):
            c, n = branch.context, len(branch.agent_completions)
            if edits is None:
                self.fallbacks += 1
            paragraphs = [diagnostics(c, a) if edits is None else edit_paragraph(c, a, edits.get(c["roles"][a], ""))
                          for a in range(n)]
            out.append([assemble(a, n, c, branch.prompt_history, branch.response_history, paragraphs[a])
                        for a in range(n)])
        return out

    def metrics(self) -> dict[str, float]:
        s = self.expert.stats()
        self.expert.reset_stats()
        metrics = {
            **{f"expert/{key}": Counter(s[key]) for key in ("calls", "cache_hits", "failures", "retries",
                                                            "breaker_open", "late")},
            "expert/fallbacks": Counter(self.fallbacks),
            "expert/latency_s": Gauge(s["latency_s_total"] / s["calls"] if s["calls"] else 0.0),
            "expert/reference": Gauge(self.expert.name == "reference"),
        }
        self.fallbacks = 0
        return metrics
