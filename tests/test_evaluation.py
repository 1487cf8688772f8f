"""Evaluation paths (K=1 through all turns): greedy and sampled, per-turn outcomes, pass@k."""
from __future__ import annotations

import pytest

from magrpo.config import ExternalConfig
from magrpo.evaluation import evaluate
from magrpo.feedback import Feedback
from magrpo.generation import SamplingParams
from tests.fakes import AlternatingBackend, PassEnv


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

    fb = Feedback(ExternalConfig(), None, feedback)
    out = evaluate(RewardOnly(None), AlternatingBackend(), fb, [{"prompt": "p"}], num_turns=1,
                   sampling=SamplingParams(max_new_tokens=4), num_samples=3)
    assert out["eval/turn_0/reward_mean"] == 2.0 and out["eval/turn_0/greedy_reward_mean"] == 2.0
    assert not any("pass@" in key for key in out)


def test_paths_stop_early_as_in_training_and_keep_their_answer():
    """Threshold 1.0: a passing joint action ends its path. Greedy paths all pass at turn 0 (no turn-1
    generation); sampled rows [p0, p0, p1, p1] write pass, fail, pass, fail, and only the two failing
    ones go on: "pass" (p0) and "fail" (p1) at turn 1."""
    backend = AlternatingBackend()
    problems = [{"prompt": "p0"}, {"prompt": "p1"}]
    out = evaluate(PassEnv(None), backend, Feedback(ExternalConfig(), None, feedback), problems, num_turns=2,
                   sampling=SamplingParams(max_new_tokens=4), num_samples=2, early_termination_threshold=1.0)
    assert backend.generate_calls == 3 and backend.greedy_calls == 1
    assert out["eval/turn_1/pass@1_greedy"] == 1.0  # carried from turn 0
    assert out["eval/turn_0/pass@1"] == pytest.approx(0.5)
    assert out["eval/turn_1/pass@1"] == pytest.approx((2 / 2 + 1 / 2) / 2)
    assert out["eval/turn_1/reward_mean"] == pytest.approx(3 / 4)


def test_training_evaluation_honours_early_termination(make_cfg):
    """Every joint action reaches the threshold: training and evaluation both stop after turn 0, so
    turn 1's eval numbers are turn 0's answers (they used to come from a second, revised turn)."""
    import json

    from magrpo.trainer import train

    run = train(make_cfg("trainer.early_termination_threshold=-1000", "trainer.steps=1", "eval.num_samples=2"))
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["eval/turn_1/greedy_reward_mean"] == last["eval/turn_0/greedy_reward_mean"]
    assert last["eval/turn_1/reward_mean"] == last["eval/turn_0/reward_mean"]


def test_the_console_names_the_eval_turn_as_its_metric_keys_do(make_cfg, capsys):
    """Turns count from 0 in metric keys (eval/turn_1/... is the second turn): the console line says
    turn_1 too (it said "eval turn 2" for the numbers logged under eval/turn_1)."""
    import json
    import re

    from magrpo.trainer import train

    run = train(make_cfg("trainer.steps=1", "trainer.num_turns=2", "eval.num_samples=0", "logging.progress=true"))
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("magrpo: eval turn")]
    named = re.match(r"magrpo: eval (turn_\d+) \(last turn\): greedy_reward_mean (\S+)", line)
    assert named and named.groups() == ("turn_1", f"{last['eval/turn_1/greedy_reward_mean']:.3f}"), line
