"""A second toy task for bench_vs_comlrl.py, written the way a user writes a plugin: an env and a
feedback function registered by name from a module of their own (`plugins=[keyword_task]`).

Keyword relay: agent 0 is given three target words and writes a line that uses them; agent 1 writes
a line reusing agent 0's words. Reward: half the share of target words agent 0 used, half the share
of agent 0's first words (up to 8) that agent 1 reused. The feedback names the missing words. Pure
string work, so scoring costs nothing next to the models (what the speed comparison wants).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from magrpo.env import ENVS, Environment
from magrpo.feedback import FEEDBACK

WORDS = [
    "return", "while", "import", "class", "yield", "lambda", "except", "global", "assert", "finally",
    "string", "buffer", "socket", "thread", "module", "object", "format", "encode", "parser", "stream",
]
REUSED = 8  # agent 0's first words that agent 1 is asked to reuse


def targets(prompt: str) -> list[str]:
    """The problem's target words: its prompt is them, space-separated."""
    return prompt.split()


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def given(first: list[str]) -> list[str]:
    """The words of agent 0 that agent 1 should reuse: its first REUSED distinct ones."""
    return list(dict.fromkeys(first))[:REUSED]


def relay_reward(prompt: str, texts: Sequence[str]) -> float:
    first, second = words(texts[0]), set(words(texts[1]))
    used = sum(w in first for w in targets(prompt)) / len(targets(prompt))
    given_words = given(first)
    reused = sum(w in second for w in given_words) / len(given_words) if given_words else 0.0
    return 0.5 * used + 0.5 * reused


@ENVS.register("keyword_relay")
class KeywordRelayEnv(Environment):
    @dataclass
    class Config:
        train_size: int = 64
        """Problems in the train split."""
        eval_size: int = 8
        """Problems in the eval split."""

    default_feedback = "keyword_relay"
    split_keys = {"train": "env.train_size", "eval": "env.eval_size"}

    @property
    def num_agents(self) -> int:
        return 2

    def problems(self, split: str) -> list[dict[str, Any]]:
        size, offset = (self.cfg.train_size, 0) if split == "train" else (self.cfg.eval_size, 5)
        out = []
        for i in range(size):
            chosen = [WORDS[(7 * (i + offset) + 3 * k) % len(WORDS)] for k in range(3)]
            out.append({"id": f"{split}-{i}", "prompt": " ".join(chosen)})
        return out

    def agent_prompts(self, problem: Mapping[str, Any]) -> list[str]:
        return [f"Write one line of code that uses the words: {problem['prompt']}.",
                "Write one line of code that reuses the words of the line before yours."]

    def rewards(self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]) -> list[float]:
        return [relay_reward(p["prompt"], texts) for p, texts in zip(problems, joint_completions)]


@FEEDBACK.register("keyword_relay")
def keyword_relay_feedback(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    """Agent 0 hears which target words it left out, agent 1 which of agent 0's words it did not reuse."""
    first = words(agent_completions[0])
    missing = [w for w in targets(prompt) if w not in first] or ["none"]
    second = set(words(agent_completions[1]))
    unused = [w for w in given(first) if w not in second] or ["none"]
    return [
        f"{prompt_history_per_agent[0][0]}\nMissing words: {' '.join(missing)}.\nTry again.",
        f"{prompt_history_per_agent[1][0]}\nThe line before yours: {agent_completions[0]}\n"
        f"Words you did not reuse: {' '.join(unused)}.\nTry again.",
    ]
