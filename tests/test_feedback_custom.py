"""A user's feedback function named as `module:function` on the command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT, SMALL


def run_train(tmp_path, *overrides):
    env = dict(os.environ, MAGRPO_PROBE_LOG=str(tmp_path / "calls.jsonl"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "train.py", *SMALL, f"logging.run_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_custom_feedback_called_once_per_expanding_branch_with_documented_arguments(tmp_path):
    # 1 step, B=2 trees, K=2, align, T=3: expanding branches = B*K at turn 0 + B*K*K at turn 1 = 4 + 8.
    proc = run_train(tmp_path, "external.mode=tests.feedback_probe:record", "trainer.steps=1", "trainer.num_turns=3",
                     "eval.at_end=false")  # evaluation paths call feedback too; count training alone
    assert proc.returncode == 0, proc.stderr
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


def test_feedback_returning_wrong_count_names_the_function(tmp_path):
    proc = run_train(tmp_path, "external.mode=tests.feedback_probe:wrong_count", "trainer.steps=1")
    assert proc.returncode != 0
    assert "tests.feedback_probe:wrong_count" in proc.stderr and "2 prompt strings" in proc.stderr


def test_custom_feedback_receives_the_code_env_context_and_branch_histories(tmp_path):
    from magrpo.envs.code.env import CodeEnv

    proc = run_train(tmp_path, "env=code", "model=tiny", "env.train_split='test[:2]'", "env.eval_split='test[2:3]'",
                     "external.mode=tests.feedback_probe:record_context", "external.history=true",
                     "generation.max_new_tokens=12", "trainer.steps=1", "eval.at_end=false")
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    assert len(calls) == 2 * 2  # B=2 trees, K=2 align, T=2: turn 0 expands
    for call in calls:
        context = call["context"]
        assert set(context) == CodeEnv.context_keys | {"options"}
        assert context["options"] == {"original_prompt": True, "history": True, "show_partner": False}
        assert context["entry_point"] in call["prompt_history_per_agent"][1][0]
        assert context["total"] == len(context["tests"]) > 0
        for i in range(2):
            assert call["response_history_per_agent"][i] == [call["agent_completions"][i]]
