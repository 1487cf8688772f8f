"""User code that raises (issue 13, point 5): a feedback function or an env method stops the run with
one line naming it, the turn and the exception; the traceback goes to RUN_DIR/error.log (and to the
console with MAGRPO_DEBUG=1); the run dir stays resumable."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from magrpo.cli import main
from magrpo.config import ExternalConfig
from magrpo.envs.length_ratio import LengthRatioEnv
from magrpo.errors import FeedbackError, RewardError
from magrpo.feedback import Feedback, FeedbackMode
from magrpo.rollout import expand_trees
from tests.conftest import ROOT, SMALL
from tests.fakes import PROBLEMS, SAMPLING, FakeBackend, FakeEnv, tree_settings

CALLS = {"n": 0, "fail_after": 4}  # B=2, K=2 align: 4 expanding branches per step, so call 5 is in step 2


def boom(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    CALLS["n"] += 1
    if CALLS["n"] > CALLS["fail_after"]:
        raise ValueError("probe failure\nwith a second line")
    return [f"{prompt} again, agent {i}" for i in range(num_agents)]


@pytest.fixture
def run_main(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(CALLS, "n", 0)
    monkeypatch.delenv("MAGRPO_DEBUG", raising=False)

    def run(*overrides: str) -> tuple[int, list[str], str]:
        code = main([*SMALL, f"logging.run_dir={tmp_path / 'run'}", "eval.at_end=false", "external.max_concurrency=1",
                     *overrides])
        err = capsys.readouterr().err
        return code, [line for line in err.splitlines() if line.startswith("error")], err

    return run


def test_raising_feedback_is_one_line_with_a_logged_traceback_and_the_run_resumes(run_main, tmp_path, monkeypatch):
    run = tmp_path / "run"
    code, errors, err = run_main("external.mode=tests.test_user_code_errors:boom", "trainer.steps=2",
                                 "checkpoint.every=1")
    assert code == 1 and "Traceback" not in err, err
    assert errors == [f"error: feedback function 'tests.test_user_code_errors:boom' (tests.test_user_code_errors.boom) "
                      f"raised at turn 0: ValueError: probe failure (traceback in {run / 'error.log'}; "
                      f"MAGRPO_DEBUG=1 prints it)"]
    log = (run / "error.log").read_text()
    assert "Traceback" in log and "in boom" in log and "with a second line" in log
    assert (run / "checkpoints" / "step_000001" / "COMPLETE").exists()  # step 1 finished, step 2 raised

    monkeypatch.setitem(CALLS, "fail_after", 10**9)
    code, errors, err = run_main("external.mode=tests.test_user_code_errors:boom", "trainer.steps=2",
                                 "checkpoint.every=1", "resume=auto")
    assert code == 0 and not errors, err
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2]


def test_raising_env_method_during_a_step_is_named_with_its_turn(run_main, tmp_path, monkeypatch):
    def agent_prompts(self, problem):
        raise KeyError("topic")

    monkeypatch.setattr(LengthRatioEnv, "agent_prompts", agent_prompts)
    # limits.max_prompt_chars=0: no start-up measure of the prompts, so the step is the first to call it
    code, errors, err = run_main("trainer.steps=1", "limits.max_prompt_chars=0")
    assert code == 1 and "Traceback" not in err, err
    assert len(errors) == 1
    assert re.match(r"error: magrpo\.envs\.length_ratio\.LengthRatioEnv\.agent_prompts raised at turn 0 "
                    r"\(problem 'Write about \w+\.'\): KeyError: 'topic' \(traceback in .*error\.log; ",
                    errors[0]), errors
    code, errors, err = run_main("trainer.steps=1")  # by default it is called at start-up, before any model
    assert code == 1 and re.match(r"error: magrpo\.envs\.length_ratio\.LengthRatioEnv\.agent_prompts raised at "
                                  r"start-up \(train problem 0\): KeyError: 'topic'", errors[0]), errors


def test_raising_env_score_keeps_its_one_line_and_logs_the_traceback(run_main, tmp_path, monkeypatch):
    def rewards(self, problems, texts):
        return 1 / 0

    monkeypatch.setattr(LengthRatioEnv, "rewards", rewards)
    code, errors, err = run_main("trainer.steps=1")
    assert code == 1 and "Traceback" not in err, err
    assert len(errors) == 1
    assert errors[0].startswith(  # the method the env defines (rewards), not the default score that calls it
        "error: env LengthRatioEnv (tests.test_user_code_errors.test_raising_env_score_keeps_its_one_line_and_logs_the"
        "_traceback.<locals>.rewards) failed on joint action 0 of turn 0"
    ), errors
    assert "ZeroDivisionError: division by zero" in errors[0]
    assert "ZeroDivisionError" in (tmp_path / "run" / "error.log").read_text()


def _raise(error):
    def method(self, *args):
        raise error

    return method


@pytest.mark.parametrize(
    "method,error,line",
    [
        (
            "problems",
            OSError("the problem server is down"),
            "magrpo.envs.length_ratio.LengthRatioEnv.problems raised loading "
            "the train split: OSError: the problem server is down",
        ),
        (
            "__init__",
            FileNotFoundError("topics.txt"),
            "magrpo.envs.length_ratio.LengthRatioEnv.__init__ raised at start-up: FileNotFoundError: topics.txt",
        ),
    ],
)
def test_raising_env_at_start_up_is_one_line_and_no_run_dir(run_main, tmp_path, monkeypatch, method, error, line):
    monkeypatch.setattr(LengthRatioEnv, method, _raise(error))
    code, errors, err = run_main()
    assert code == 1 and "Traceback" not in err, err
    assert errors == [f"error: {line} (MAGRPO_DEBUG=1 prints the traceback)"]
    assert not (tmp_path / "run").exists()


def test_debug_switch_prints_the_traceback(run_main, monkeypatch):
    monkeypatch.setenv("MAGRPO_DEBUG", "1")
    monkeypatch.setitem(CALLS, "fail_after", 0)
    code, errors, err = run_main("external.mode=tests.test_user_code_errors:boom", "trainer.steps=1")
    assert code == 1 and len(errors) == 1
    assert "Traceback (most recent call last)" in err and 'raise ValueError("probe failure' in err
    assert err.rstrip().endswith("MAGRPO_DEBUG=1 prints it)")  # the one line still comes last


def test_a_second_signal_is_one_line_exit_130(run_main, monkeypatch):
    import magrpo.trainer

    def interrupted(cfg):
        raise KeyboardInterrupt  # Ctrl-C before the run installs its handlers (while the config composes)

    monkeypatch.setattr(magrpo.trainer, "train", interrupted)
    try:
        code, errors, err = run_main()
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main: a traceback for the user")
    assert code == 130 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "stopped: interrupted; resume=auto continues from the last complete checkpoint, if any"]


def test_raising_feedback_from_the_command_line_exits_1(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("MAGRPO_DEBUG", None)
    proc = subprocess.run([sys.executable, "train.py", *SMALL, f"logging.run_dir={tmp_path / 'run'}", "trainer.steps=1",
                           "external.mode=tests.feedback_probe:raises"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and "tests.feedback_probe.raises) raised at turn 0: RuntimeError: " in errors[0], errors


def test_an_error_that_is_not_ours_is_one_line_too(run_main, monkeypatch):
    import magrpo.update

    def broken(*args, **kwargs):
        raise IndexError("a bug deep in the update")

    monkeypatch.setattr(magrpo.update, "policy_loss", broken)
    code, errors, err = run_main("trainer.steps=1", "trainer.kl_coef=0.01")  # KL: every row trains
    assert code == 1 and "Traceback" not in err, err
    assert len(errors) == 1
    assert errors[0].startswith("error: unexpected IndexError: a bug deep in the update (traceback in ")


class BrokenMode(FeedbackMode):
    """A user's feedback mode whose start-up check or batch raises, as the test asks."""

    fail_in = "check"

    def check(self):
        if self.fail_in == "check":
            raise ConnectionError("no server")

    def batch(self, branches):
        raise TimeoutError("the expert took too long")


@pytest.mark.parametrize("fail_in,line", [
    ("check", "error: feedback function 'tests.test_user_code_errors:BrokenMode' "
              "(tests.test_user_code_errors.BrokenMode.check) raised at start-up: ConnectionError: no server "
              "(MAGRPO_DEBUG=1 prints the traceback)"),
    ("batch", "error: feedback function 'tests.test_user_code_errors:BrokenMode' "
              "(tests.test_user_code_errors.BrokenMode.batch) raised at turn 0: TimeoutError: the expert took too long "
              "(traceback in {run}/error.log; MAGRPO_DEBUG=1 prints it)"),
])
def test_raising_feedback_mode_is_one_line(run_main, tmp_path, monkeypatch, fail_in, line):
    monkeypatch.setattr(BrokenMode, "fail_in", fail_in)
    code, errors, err = run_main("external.mode=tests.test_user_code_errors:BrokenMode", "trainer.steps=1")
    assert code == 1 and "Traceback" not in err, err
    assert errors == [line.format(run=tmp_path / "run")]
    assert (tmp_path / "run").exists() == (fail_in == "batch")  # start-up errors come before the run dir


class OneRewardEnv(FakeEnv):
    """Returns one reward however many joint actions it is given."""

    def rewards(self, problems, joint_completions):
        return [1.0]


def test_an_env_returning_too_few_rewards_is_named_with_the_counts():
    """It used to stop with `unexpected ValueError: cannot reshape array of size 1 into shape (1,2)`."""
    env = OneRewardEnv(2)
    settings = tree_settings(num_generations=2, num_turns=1, joint_mode="align")
    with pytest.raises(RewardError) as e:
        expand_trees(PROBLEMS[:1], env, FakeBackend(), Feedback(ExternalConfig(), env, lambda **kw: ["x", "y"]),
                     settings, SAMPLING)
    assert str(e.value) == ("env OneRewardEnv (tests.test_user_code_errors.OneRewardEnv.rewards) returned 1 score(s) "
                            "for 2 joint actions of turn 0; return one per joint action, in order")


@pytest.mark.parametrize("returned,says", [
    ([1, None], "got a list whose item 0 is int 1 (2 items are not strings)"),
    (["ok", b"bytes"], "got a list whose item 1 is bytes b'bytes'"),
    (["only one"], "got a list of length 1"),
    ("a string", "got str 'a string'"),
])
def test_feedback_returning_wrong_items_says_which_item_and_its_type(returned, says):
    """`[1, None]` used to be told "got list of length 2": the length was right, the items were not strings."""
    from magrpo.feedback import check_prompts

    def mine(**kw):
        return returned

    with pytest.raises(FeedbackError) as e:
        check_prompts(returned, 2, "mine", mine)
    assert str(e.value) == ("feedback function 'mine' (tests.test_user_code_errors."
                            "test_feedback_returning_wrong_items_says_which_item_and_its_type.<locals>.mine) must "
                            f"return a list of 2 prompt strings (one per agent), {says}")
