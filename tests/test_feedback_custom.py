"""A user's feedback function named as `module:function` on the command line (magrpo.cli.main in-process)."""
from __future__ import annotations

import json

import pytest

from magrpo.cli import main
from tests.conftest import SMALL


@pytest.fixture
def run_train(tmp_path, monkeypatch, capsys):
    """run_train(*overrides) -> (exit code, stderr) of `train.py SMALL overrides`; the probe logs its calls."""
    monkeypatch.setenv("MAGRPO_PROBE_LOG", str(tmp_path / "calls.jsonl"))

    def run(*overrides: str) -> tuple[int, str]:
        code = main([*SMALL, f"logging.run_dir={tmp_path / 'run'}", *overrides])
        return code, capsys.readouterr().err

    return run


def test_custom_feedback_called_once_per_expanding_branch_with_documented_arguments(run_train, tmp_path):
    # 1 step, B=2 trees, K=2, align, T=3: expanding branches = B*K at turn 0 + B*K*K at turn 1 = 4 + 8.
    code, err = run_train("external.mode=tests.feedback_probe:record", "trainer.steps=1", "trainer.num_turns=3",
                          "eval.at_end=false")  # evaluation paths call feedback too; count training alone
    assert code == 0, err
    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    assert len(calls) == 2 * 2 + 2 * 2 * 2
    trees = [json.loads(line) for line in open(tmp_path / "run" / "rollouts.jsonl")]
    problem_prompts = {t["problem"]["prompt"] for t in trees}
    for call in calls:
        assert set(call) == {"prompt", "agent_completions", "num_agents", "prompt_history_per_agent",
                             "response_history_per_agent"}
        assert call["num_agents"] == 2 and len(call["agent_completions"]) == 2
        assert call["prompt"] in problem_prompts
        turn = len(call["prompt_history_per_agent"][0])  # 1 at turn 0, 2 at turn 1
        for i in range(2):
            # Histories: this branch only, up to and including the current turn.
            assert len(call["prompt_history_per_agent"][i]) == turn
            assert len(call["response_history_per_agent"][i]) == turn
            assert call["response_history_per_agent"][i][-1] == call["agent_completions"][i]
        if turn == 2:  # the turn-1 prompt is what this function returned one turn earlier
            assert call["prompt_history_per_agent"][1][1] == "probe turn 2 for agent 1"
    assert sorted(len(c["prompt_history_per_agent"][0]) for c in calls) == [1] * 4 + [2] * 8


def test_feedback_returning_wrong_count_names_the_function(run_train):
    code, err = run_train("external.mode=tests.feedback_probe:wrong_count", "trainer.steps=1")
    assert code != 0
    assert "tests.feedback_probe:wrong_count" in err and "2 prompt strings" in err


def test_custom_feedback_receives_the_code_env_context_and_branch_histories(run_train, tmp_path):
    from magrpo.envs.code.env import CodeEnv

    code, err = run_train("env=code", "model=tiny", "env.train_split='test[:2]'", "env.eval_split='test[2:3]'",
                          "external.mode=tests.feedback_probe:record_context", "external.history=true",
                          "generation.max_new_tokens=12", "trainer.steps=1", "eval.at_end=false")
    assert code == 0, err
    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    assert len(calls) == 2 * 2  # B=2 trees, K=2 align, T=2: turn 0 expands
    problems = [t["problem"] for t in map(json.loads, open(tmp_path / "run" / "rollouts.jsonl"))]
    for call in calls:
        context = call["context"]
        # the problem's fields (HumanEval's columns, prompt aside) under the env's context, options, completion_info
        assert set(context) == CodeEnv.context_keys | {"options", "completion_info"} | (set(problems[0]) - {"prompt"})
        assert [set(info) for info in context["completion_info"]] == [{"truncated", "tool_calls"}] * 2
        assert context["options"] == {"original_prompt": True, "history": True, "history_mode": "attempts",
                                      "show_partner": False}
        assert context["entry_point"] in call["prompt_history_per_agent"][1][0]
        assert context["total"] == len(context["tests"]) > 0
        for i in range(2):
            assert call["response_history_per_agent"][i] == [call["agent_completions"][i]]
