"""The toy length-ratio task with remote-service latency, for bench_overlap.py: a plugin env and
feedback function registered by name (`plugins=[latency_task] env=slow_length_ratio
external.mode=slow_length_ratio`).

Scoring waits `env.score_ms` per joint action (a sandbox running each program in turn, or a reward
model behind HTTP: the wait grows with the work, however a turn is cut into parts) and the feedback
waits `env.feedback_ms` per branch (an expert behind HTTP; branches run `external.max_concurrency`
at once). Waiting is `time.sleep`, which frees the
CPU and the GIL as a network wait does, so what overlap can hide is exactly that latency.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from magrpo.env import ENVS, Scored
from magrpo.envs.length_ratio import LengthRatioEnv, length_ratio_feedback
from magrpo.feedback import FEEDBACK


@ENVS.register("slow_length_ratio")
class SlowLengthRatioEnv(LengthRatioEnv):
    @dataclass
    class Config(LengthRatioEnv.Config):
        score_ms: float = 0.0
        """Milliseconds scoring waits per joint action."""
        feedback_ms: float = 0.0
        """Milliseconds the feedback function waits per branch."""

    default_feedback = "slow_length_ratio"
    context_keys = frozenset({"feedback_ms"})

    def score(self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]) -> list[Scored]:
        time.sleep(self.cfg.score_ms / 1000 * len(joint_completions))
        return [Scored(s.reward, s.outcomes, {"feedback_ms": self.cfg.feedback_ms})
                for s in super().score(problems, joint_completions)]


@FEEDBACK.register("slow_length_ratio")
def slow_length_ratio_feedback(prompt, agent_completions, num_agents, prompt_history_per_agent,
                               response_history_per_agent, feedback_ms: float = 0.0):
    """length_ratio's feedback after a wait of feedback_ms."""
    time.sleep(feedback_ms / 1000)
    return length_ratio_feedback(prompt, agent_completions, num_agents, prompt_history_per_agent,
                                 response_history_per_agent)
