"""Every piece of user code the trainer calls runs under limits.user_code_timeout_s (issue 45): a plugin's
registered hooks (baselines, credit rules, scales, groupings, estimators, loss aggregations, ratio levels,
joint modes), the env's methods and a feedback mode's. Past the limit the run stops with one line naming
the function and its registry name, and its checkpoints stay intact; magrpo's own math is called as is."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from magrpo.advantage import BASELINES, CREDITS, ESTIMATORS, GROUP_BY, SCALES, mean_baseline
from magrpo.cli import main
from magrpo.errors import PluginError, TimedOut
from magrpo.loss import LOSS_AGGS, RATIO_LEVELS
from magrpo.registry import builtin
from magrpo.tree import JOINT_MODES
from tests import stop_probe
from tests.conftest import SMALL

# (the key that picks it, its registry): every registry of hooks the trainer calls in a step or at start-up
HOOKS = [("trainer.baseline", BASELINES), ("trainer.advantage_scale", SCALES), ("trainer.cross_credit", CREDITS),
         ("trainer.group_by", GROUP_BY), ("trainer.advantage_estimator", ESTIMATORS), ("trainer.loss_agg", LOSS_AGGS),
         ("trainer.ratio_level", RATIO_LEVELS), ("trainer.joint_mode", JOINT_MODES)]


@pytest.fixture
def released(monkeypatch):
    """Hung calls give up after 10 s (without a limit the test fails then, not never) and return at the
    test's end (their daemon threads then finish)."""
    stop_probe.RELEASE.clear()
    monkeypatch.setitem(stop_probe.CALLS, "hang_s", 10)
    yield
    stop_probe.RELEASE.set()


@pytest.mark.parametrize("key, registry", HOOKS, ids=[key for key, _ in HOOKS])
def test_a_hung_plugin_hook_stops_at_the_time_limit_naming_it(make_cfg, monkeypatch, released, key, registry):
    """A plugin's hook that never returned held the run forever: only feedback and scoring had a limit."""
    from magrpo.trainer import train

    monkeypatch.setitem(registry._items, "stuck", stop_probe.stuck)
    with pytest.raises(TimedOut) as caught:
        train(make_cfg(f"{key}=stuck", "limits.user_code_timeout_s=0.5", "eval.at_end=false"))
    at_start = key == "trainer.joint_mode"  # the tree's size is checked at start-up, before any run dir
    tail = "nothing was trained or written" if at_start else \
        "the run dir is resumable from its last checkpoint with resume=auto"
    assert str(caught.value) == (f"{registry.kind} 'stuck' (tests.stop_probe.stuck) did not return within "
                                 f"limits.user_code_timeout_s=0.5 s; make it faster or raise the limit (0 = none); "
                                 f"{tail}")


@pytest.mark.parametrize("key, registry", HOOKS[:2], ids=[key for key, _ in HOOKS[:2]])
def test_a_raising_plugin_hook_is_named(make_cfg, monkeypatch, key, registry):
    """It read `unexpected ValueError: probe failure`, like a bug of magrpo's."""
    from magrpo.trainer import train

    monkeypatch.setitem(registry._items, "fails", stop_probe.fails)
    with pytest.raises(PluginError, match=rf"^{registry.kind} 'fails' \(tests\.stop_probe\.fails\) raised: "
                                          r"ValueError: probe failure(\n|$)"):  # one line, then the note
        train(make_cfg(f"{key}=fails", "eval.at_end=false"))


def test_magrpo_s_own_hooks_are_called_as_they_are():
    """Built-in math runs in the caller's thread: no thread per call, nothing to time."""
    assert BASELINES.hook("mean", 5) is mean_baseline
    assert BASELINES.hook("mean", 0) is mean_baseline
    own = [(r, name) for _, r in HOOKS for name in r.names() if builtin(r.get(name))]  # a test's plugins aside
    assert len(own) >= 18 and all(r.hook(name, 5) is r.get(name) for r, name in own)


def test_a_plugin_hook_without_a_limit_is_called_in_place(monkeypatch):
    """limits.user_code_timeout_s=0: the hook runs in the caller's thread, any raise still named."""
    seen = []
    monkeypatch.setitem(BASELINES._items, "mine", lambda values: seen.append(threading.current_thread()) or values)
    assert BASELINES.hook("mine", 0)(np.ones(2)).tolist() == [1.0, 1.0]
    assert seen == [threading.main_thread()]


CALLS = {"n": 0, "hang_after": 10**9}
_count = threading.Lock()


def late_baseline(values):
    """The mean baseline, until it hangs at call CALLS["hang_after"] + 1."""
    with _count:
        CALLS["n"] += 1
        hangs = CALLS["n"] > CALLS["hang_after"]
    if hangs:
        stop_probe.stuck()
    return mean_baseline(values)


def test_a_hook_that_hangs_in_step_2_leaves_step_1_s_checkpoint_and_the_run_resumes(tmp_path, capsys, monkeypatch,
                                                                                   released):
    monkeypatch.delenv("MAGRPO_DEBUG", raising=False)
    monkeypatch.setitem(BASELINES._items, "late", late_baseline)
    monkeypatch.setitem(CALLS, "n", 0)
    run = tmp_path / "run"
    args = [*SMALL, f"logging.run_dir={run}", "eval.at_end=false", "checkpoint.every=1", "trainer.baseline=late",
            "limits.user_code_timeout_s=0.5"]
    assert main([*args, "trainer.steps=1", f"logging.run_dir={tmp_path / 'count'}"]) == 0  # step 1's calls
    monkeypatch.setitem(CALLS, "hang_after", CALLS["n"])
    monkeypatch.setitem(CALLS, "n", 0)
    capsys.readouterr()
    code = main([*args, "trainer.steps=2"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "error: baseline 'late' (tests.test_hook_limits.late_baseline) did not return within "
        "limits.user_code_timeout_s=0.5 s; make it faster or raise the limit (0 = none); the run dir is resumable "
        f"from its last checkpoint with resume=auto (traceback in {run / 'error.log'}; MAGRPO_DEBUG=1 prints it)")
    assert (run / "checkpoints" / "step_000001" / "COMPLETE").exists()  # step 1 finished, step 2 hung
    monkeypatch.setitem(CALLS, "hang_after", 10**9)  # the hook is fixed: the run goes on from its checkpoint
    code = main([*args, "trainer.steps=2", "resume=auto"])
    err = capsys.readouterr().err
    assert code == 0 and "resuming from" in err, err


# Every env method the trainer calls in a run but score (tested in test_clean_stops) and load_state (below)
ENV_METHODS = ["problems", "agent_prompts", "tool_context", "metrics", "state"]


@pytest.mark.parametrize("method", ENV_METHODS)
def test_a_hung_env_method_stops_at_the_time_limit_naming_it(make_cfg, monkeypatch, released, method):
    """Only the env's scoring had a limit: an env that hung loading its data or writing its state did not stop."""
    from magrpo.envs.length_ratio import LengthRatioEnv
    from magrpo.trainer import train

    monkeypatch.setattr(LengthRatioEnv, method, stop_probe.stuck)
    with pytest.raises(TimedOut, match=rf"^magrpo\.envs\.length_ratio\.LengthRatioEnv\.{method} did not return "
                                       r"within limits\.user_code_timeout_s=0\.5 s (at|after|writing|loading) "):
        train(make_cfg("limits.user_code_timeout_s=0.5", "eval.at_end=false", "trainer.steps=1"))


def test_a_hung_env_load_state_stops_a_resume(make_cfg, monkeypatch, released):
    from magrpo.envs.length_ratio import LengthRatioEnv
    from magrpo.trainer import train

    train(make_cfg("eval.at_end=false", "trainer.steps=1"))
    monkeypatch.setattr(LengthRatioEnv, "load_state", stop_probe.stuck)
    with pytest.raises(TimedOut, match=r"^magrpo\.envs\.length_ratio\.LengthRatioEnv\.load_state did not return "
                                       r"within limits\.user_code_timeout_s=0\.5 s resuming; "):
        train(make_cfg("limits.user_code_timeout_s=0.5", "eval.at_end=false", "trainer.steps=2", "resume=auto"))


@pytest.mark.parametrize("method", ["__init__", "check", "metrics"])
def test_a_hung_feedback_mode_method_stops_at_the_time_limit(make_cfg, monkeypatch, released, method):
    """A mode's batch had a limit; its construction, start-up check and metrics did not."""
    from magrpo.feedback import FeedbackMode
    from magrpo.trainer import train

    class Again(FeedbackMode):
        def batch(self, branches):
            return [[b.prompt] * len(b.agent_completions) for b in branches]

    def hung(self, *args):
        stop_probe.stuck()

    setattr(Again, method, hung)
    with pytest.raises(TimedOut, match=r"^feedback function 'Again' \(tests\.test_hook_limits\.[\w.<>]+\) did not "
                                       r"return within limits\.user_code_timeout_s=0\.5 s "):
        train(make_cfg("limits.user_code_timeout_s=0.5", "eval.at_end=false", "trainer.steps=1"), feedback=Again)
