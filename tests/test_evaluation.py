"""Evaluation paths (K=1 through all turns): greedy and sampled, per-turn outcomes, pass@k."""
from __future__ import annotations

import pytest

from magrpo.config import ExternalConfig
from magrpo.env import Environment
from magrpo.feedback import Feedback
from magrpo.evaluation import evaluate
from magrpo.generation import SamplingParams
from magrpo.tree import Completion


class AlternatingBackend:
    """Greedy rows always write "pass"; sampled rows alternate pass, fail, pass, ... in call order."""

    def __init__(self):
        self.generate_calls = 0
        self.greedy_calls = 0
        self.counter = 0

    def generate(self, requests, params):
        self.generate_calls += 1
        self.greedy_calls += params.greedy
        out = []
        for r in requests:
            assert r.n == 1  # evaluation paths: one completion per agent per node
            if params.greedy:
                text = "pass"
            else:
                text = "pass" if self.counter % 2 == 0 else "fail"
                self.counter += 1
            out.append([Completion([1], text, [2], True)])
        return out

    def sync_weights(self):
        pass


class PassEnv(Environment):
    num_agents = 1

    def agent_prompts(self, problem):
        return [problem["prompt"]]

    def outcomes(self, problems, joint_completions):
        return [{"reward": float(t[0] == "pass"), "passed": float(t[0] == "pass")} for t in joint_completions]


def feedback(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    return ["again"] * num_agents


def test_greedy_and_sampled_paths_by_hand():
    backend = AlternatingBackend()
    problems = [{"prompt": "p0"}, {"prompt": "p1"}]
    out = evaluate(PassEnv(None), backend, Feedback(ExternalConfig(), None, feedback), problems, num_turns=2,
                   sampling=SamplingParams(max_new_tokens=4), num_samples=2)
    assert backend.generate_calls == 4 and backend.greedy_calls == 2  # (greedy + sampled) x 2 turns
    for turn in (0, 1):
        assert out[f"eval/turn_{turn}/pass@1_greedy"] == 1.0
        # rows [p0, p0, p1, p1] -> pass, fail, pass, fail: each problem 1 of 2 samples passes
        assert out[f"eval/turn_{turn}/pass@1"] == pytest.approx(0.5)
        assert out[f"eval/turn_{turn}/pass@2"] == pytest.approx(1.0)
        assert out[f"eval/turn_{turn}/reward_mean"] == pytest.approx(0.5)
    assert out["eval/improvement/pass@1"] == 0.0 and out["eval/improvement/pass@1_greedy"] == 0.0


def test_envs_without_passed_report_reward_only():
    class RewardOnly(PassEnv):
        def outcomes(self, problems, joint_completions):
            return [{"reward": 2.0} for _ in joint_completions]

    out = evaluate(RewardOnly(None), AlternatingBackend(), Feedback(ExternalConfig(), None, feedback), [{"prompt": "p"}], num_turns=1,
                   sampling=SamplingParams(max_new_tokens=4), num_samples=3)
    assert out["eval/turn_0/reward_mean"] == 2.0 and out["eval/turn_0/greedy_reward_mean"] == 2.0
    assert not any("pass@" in key for key in out)
