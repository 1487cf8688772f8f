"""Tool-arithmetic toy task (issue 31): each agent is asked for the product of two `env.digits`-digit
numbers (2: a 4-digit product), which a tiny model cannot compute but the `calculator` tool can.
Reward 1 for the right final answer, 0 otherwise; nothing for calling the tool as such, so a rising
tool-call rate is learned from the answers alone.

The answer is the last `answer: <integer>` the agent writes (a tool result, `<tool_response>...`,
never counts). With two agents each gets its own product and the team reward is the share answered
right. Run it with `tools=[calculator]`; `magrpo.envs.tool_arith_warm` builds the warm-started tiny
model that makes the tool reachable (docs/tools.md, "A tiny model learns to call the calculator").
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from magrpo.env import ENVS, Environment

ANSWER = re.compile(r"answer:\s*(-?\d+)")
SPLIT_SEEDS = {"train": 0, "eval": 1}


def product_pair(rng: random.Random, digits: int) -> tuple[int, int]:
    """Two `digits`-digit numbers whose product has exactly 2 * digits digits: every question, call and
    answer then has the same length, so the digits a model copies sit at fixed offsets."""
    low, high = 10 ** (digits - 1), 10**digits - 1
    while True:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if a * b >= 10 ** (2 * digits - 1):
            return a, b


def question(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def final_answer(text: str) -> int | None:
    """The last `answer: N` of a completion, None when it gives none."""
    found = ANSWER.findall(text)
    return int(found[-1]) if found else None


@ENVS.register("tool_arith")
class ToolArithEnv(Environment):
    @dataclass
    class Config:
        num_agents: int = 1
        """Agents, each asked its own product (reward: the share answered right)."""
        train_size: int = 256
        """Problems in the train split."""
        eval_size: int = 32
        """Problems in the eval split (drawn from another seed)."""
        digits: int = 2
        """Digits of each factor (the product has twice as many)."""

    split_keys = {"train": "env.train_size", "eval": "env.eval_size"}

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        from magrpo.config import at_least

        at_least("env.num_agents", cfg.num_agents, 1)
        at_least("env.train_size", cfg.train_size, 1)
        at_least("env.eval_size", cfg.eval_size, 0)
        at_least("env.digits", cfg.digits, 2)

    @property
    def num_agents(self) -> int:
        return self.cfg.num_agents

    def problems(self, split: str) -> list[dict[str, Any]]:
        size = self.cfg.train_size if split == "train" else self.cfg.eval_size
        rng = random.Random(SPLIT_SEEDS[split])
        out = []
        for i in range(size):
            pairs = [product_pair(rng, self.cfg.digits) for _ in range(self.cfg.num_agents)]
            out.append({"id": f"{split}-{i}", "pairs": pairs, "prompt": " ".join(question(a, b) for a, b in pairs)})
        return out

    def agent_prompts(self, problem: Mapping[str, Any]) -> list[str]:
        return [question(a, b) for a, b in problem["pairs"]]

    def rewards(self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]) -> list[float]:
        out = []
        for problem, texts in zip(problems, joint_completions):
            right = [final_answer(t) == a * b for (a, b), t in zip(problem["pairs"], texts)]
            out.append(sum(right) / len(right))
        return out
