"""Cooperative length-ratio toy task (after CoMLRL's): agent i's answer should be `ratio` times as
long (in characters) as agent i-1's. With one agent, its answer should be `target_chars` long.

It needs no knowledge, so even a randomly initialised tiny model learns it on a CPU: the agents only
have to learn how long to talk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from magrpo.env import ENVS, Environment
from magrpo.feedback import FEEDBACK

TOPICS = [
    "rivers", "bread", "clocks", "winter", "bees", "trains", "maps", "tea", "stars", "gardens",
    "bridges", "paper", "music", "salt", "wind", "glass", "owls", "cities", "rain", "chess",
]


def length_score(actual: float, target: float) -> float:
    """min(actual/target, target/actual) in [0, 1]; 1 exactly on target, symmetric in log-ratio."""
    if actual <= 0 or target <= 0:
        return 0.0
    return math.exp(-abs(math.log(actual / target)))


@ENVS.register("length_ratio")
class LengthRatioEnv(Environment):
    @dataclass
    class Config:
        num_agents: int = 2
        """Agents in the chain (1 = plain GRPO towards `target_chars`)."""
        ratio: float = 2.0
        """Target len(agent i) / len(agent i-1)."""
        target_chars: int = 40
        """Single-agent target length in characters."""
        train_size: int = 64
        """Problems in the train split."""
        eval_size: int = 16
        """Problems in the eval split."""

    default_feedback = "length_ratio"
    split_keys = {"train": "env.train_size", "eval": "env.eval_size"}

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        from magrpo.config import above, at_least

        at_least("env.num_agents", cfg.num_agents, 1)
        above("env.ratio", cfg.ratio, 0)
        at_least("env.target_chars", cfg.target_chars, 1)
        at_least("env.train_size", cfg.train_size, 1)
        at_least("env.eval_size", cfg.eval_size, 0)

    @property
    def num_agents(self) -> int:
        return self.cfg.num_agents

    def problems(self, split: str) -> list[dict[str, Any]]:
        size, offset = (self.cfg.train_size, 0) if split == "train" else (self.cfg.eval_size, 7)
        out = []
        for i in range(size):
            topic = TOPICS[(i + offset) % len(TOPICS)]
            out.append({"id": f"{split}-{i}", "topic": topic, "prompt": f"Write about {topic}."})
        return out

    def agent_prompts(self, problem: Mapping[str, Any]) -> list[str]:
        topic = problem["topic"]
        if self.cfg.num_agents == 1:
            return [f"Write about {topic} in about {self.cfg.target_chars} characters."]
        first = [f"Write a short text about {topic}."]
        rest = [
            f"Write about {topic}, {self.cfg.ratio:g} times as long as agent {i - 1}'s text."
            for i in range(1, self.cfg.num_agents)
        ]
        return first + rest

    def rewards(self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]) -> list[float]:
        return [self._reward(texts) for texts in joint_completions]

    def _reward(self, texts: Sequence[str]) -> float:
        lengths = [len(t) for t in texts]
        if len(lengths) == 1:
            return length_score(lengths[0], self.cfg.target_chars)
        scores = [length_score(lengths[i], self.cfg.ratio * lengths[i - 1]) for i in range(1, len(lengths))]
        return sum(scores) / len(scores)


@FEEDBACK.register("length_ratio")
def length_ratio_feedback(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    """Tells every agent all agents' lengths this turn, then repeats its own first prompt."""
    lengths = ", ".join(f"agent {i}: {len(c)} characters" for i, c in enumerate(agent_completions))
    return [
        f"{prompt_history_per_agent[i][0]}\nLast turn lengths: {lengths}.\n"
        f"Your last answer: {agent_completions[i]}\nTry again."
        for i in range(num_agents)
    ]
