"""Every start and every stop is clean (issue 45): hung user code is stopped by its time limit or by
a second signal, and a signal during start-up says so in one line and leaves nothing behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from magrpo.cli import main
from magrpo.console import StopSignals
from tests import stop_probe
from tests.conftest import ROOT, SMALL, wait_for


@pytest.fixture
def released():
    """The hung calls of an in-process test return at its end (their daemon threads then finish)."""
    stop_probe.RELEASE.clear()
    yield
    stop_probe.RELEASE.set()


def test_a_hung_feedback_function_stops_at_its_time_limit_and_the_run_resumes(tmp_path, capsys, monkeypatch,
                                                                              released):
    """A feedback function that never returned held the run forever: no limit, and the pool's workers
    were joined on the way out. Now the run stops after limits.user_code_timeout_s with one line naming
    the function, and its checkpoint is intact."""
    monkeypatch.delenv("MAGRPO_DEBUG", raising=False)
    run = tmp_path / "run"
    args = [*SMALL, f"logging.run_dir={run}", "eval.at_end=false", "trainer.steps=2", "checkpoint.every=1"]
    monkeypatch.setitem(stop_probe.CALLS, "n", 0)
    monkeypatch.setitem(stop_probe.CALLS, "hang_after", 4)  # step 1's four branches, then step 2 hangs
    args += ["external.mode=tests.stop_probe:hang", "limits.user_code_timeout_s=0.5"]
    start = time.monotonic()
    code = main(args)
    err = capsys.readouterr().err
    assert time.monotonic() - start < 60
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "error: feedback function 'tests.stop_probe:hang' (tests.stop_probe.hang) did not return within "
        "limits.user_code_timeout_s=0.5 s at turn 0; make it faster or raise the limit (0 = none); the run dir is "
        f"resumable from its last checkpoint with resume=auto (traceback in {run / 'error.log'}; MAGRPO_DEBUG=1 "
        "prints it)")
    assert (run / "checkpoints" / "step_000001" / "COMPLETE").exists()  # step 1 finished, step 2 hung
    stop_probe.RELEASE.set()  # the function is fixed: the run goes on from its checkpoint
    code = main([*args, "resume=auto"])
    err = capsys.readouterr().err
    assert code == 0 and "resuming from" in err, err


def test_a_hung_env_score_stops_at_its_time_limit(make_cfg, monkeypatch, released):
    from magrpo.envs.length_ratio import LengthRatioEnv
    from magrpo.errors import TimedOut
    from magrpo.trainer import train

    def score(self, *args, **kwargs):
        stop_probe.RELEASE.wait(3600)
        return []

    monkeypatch.setattr(LengthRatioEnv, "score", score)
    with pytest.raises(TimedOut, match=r"^env LengthRatioEnv \(tests\.test_clean_stops\.[\w.<>]+\.score\) "
                                       r"did not return within limits\.user_code_timeout_s=0\.5 s scoring turn 0; "):
        train(make_cfg("limits.user_code_timeout_s=0.5", "eval.at_end=false"))


def test_user_code_timeout_is_checked(run_cli):
    code, lines = run_cli(*SMALL, "limits.user_code_timeout_s=-1")
    assert (code, lines) == (2, ["config error: limits.user_code_timeout_s: must be >= 0, got -1.0 (0 = no limit)"])


def start(tmp_path: Path, *overrides: str, stall: str | None = None, hook: str | None = None) -> subprocess.Popen:
    """train.py in a child process; `stall`, `hook`: tests/stop_probe.py's MAGRPO_TEST_STALL, MAGRPO_TEST_HOOK."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", MAGRPO_TEST_GATE=str(tmp_path))
    env.pop("MAGRPO_DEBUG", None)
    env.update({name: value for name, value in (("MAGRPO_TEST_STALL", stall), ("MAGRPO_TEST_HOOK", hook)) if value})
    return subprocess.Popen([sys.executable, "train.py", *SMALL, f"logging.run_dir={tmp_path / 'run'}", *overrides],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM)])
def test_a_second_signal_stops_a_hung_feedback_function_at_once(tmp_path, first, second):
    """Ctrl-C, then Ctrl-C again: still running 90 s later (the pool's workers, stuck in the function,
    were joined); one SIGTERM never ended it. Now the second signal ends the process within seconds,
    with one line and 128 + its number."""
    stopped_twice(tmp_path, start(tmp_path, "external.mode=tests.stop_probe:hang", "external.max_concurrency=4"),
                  first, second)


@pytest.mark.slow
def test_a_second_signal_stops_a_hung_plugin_hook_at_once(tmp_path):
    """A plugin's hook runs in a worker thread under its time limit while the main thread waits for it:
    the second signal still ends the process at once."""
    proc = start(tmp_path, "plugins=[tests.stop_probe]", "trainer.baseline=stuck", hook="baseline")
    stopped_twice(tmp_path, proc, signal.SIGTERM, signal.SIGINT)


def stopped_twice(tmp_path: Path, proc: subprocess.Popen, first: signal.Signals, second: signal.Signals) -> None:
    """Once the run is inside the hung call: `first`, then `second` ends it within 5 s, with one line."""
    try:
        wait_for(tmp_path / "entered", proc)
        proc.send_signal(first)
        line = proc.stderr.readline()
        while line and "finishing this step" not in line:
            line = proc.stderr.readline()
        assert f"magrpo: {first.name}: finishing this step" in line
        time.sleep(StopSignals.REPEAT_S + 0.2)  # a later signal, not torchrun's forwarded copy of the first
        proc.send_signal(second)
        _, err = proc.communicate(timeout=5)
    finally:
        proc.kill()
    assert proc.returncode == 128 + second, err
    assert err.strip().splitlines() == [f"stopped: {second.name} again: stopped at once, without a checkpoint; "
                                        "resume=auto continues from the last complete checkpoint, if any"], err


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["load_agents", "startup_line"])
def test_sigterm_during_start_up_is_one_line_and_leaves_nothing(tmp_path, stage):
    """A SIGTERM while weights loaded killed the run silently and left run.lock (and after the logs
    were made, config.json and empty logs) in the run dir: the handler came after the model."""
    err = sigterm_at(tmp_path, stage)
    assert err.strip().splitlines()[-1] == ("stopped: SIGTERM during start-up, before the first step: nothing "
                                            "trained, the run dir it made is removed"), err
    assert not (tmp_path / "run").exists()


def sigterm_at(tmp_path: Path, stage: str, *overrides: str) -> str:
    """A run stalled at `stage` of start-up (tests/stop_probe.py), sent SIGTERM there: its stderr, once it
    ended by that signal's code."""
    proc = start(tmp_path, "plugins=[tests.stop_probe]", *overrides, stall=stage)
    try:
        wait_for(tmp_path / stage, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    return err


@pytest.mark.slow
def test_sigterm_during_start_up_leaves_a_run_dir_it_did_not_make_as_it_was(tmp_path):
    """A run dir that existed with no checkpoint (the logs of a run stopped before its first step): a stop
    during start-up left this start's config.json and empty logs, and the earlier log renamed to
    metrics.jsonl.before-<time>; every such stop added another set."""
    run = tmp_path / "run"
    run.mkdir()
    earlier = '{"step": 0, "eval/turn_1/greedy_reward_mean": 0.5}\n'
    (run / "metrics.jsonl").write_text(earlier)
    err = sigterm_at(tmp_path, "startup_line", "resume=auto")  # after start-up wrote config.json and the logs
    assert "the earlier metrics.jsonl renamed to metrics.jsonl.before-" in err, err
    assert err.strip().splitlines()[-1] == ("stopped: SIGTERM during start-up, before the first step: nothing "
                                            "trained, what it wrote in the run dir is removed"), err
    assert [p.name for p in run.iterdir()] == ["metrics.jsonl"]
    assert (run / "metrics.jsonl").read_text() == earlier


def test_put_back_renames_what_a_start_set_aside_and_removes_only_the_run_s_files(tmp_path):
    from magrpo.run_io import put_back, top_level

    (tmp_path / "metrics.jsonl").write_text("earlier\n")
    (tmp_path / "notes.txt").write_text("the user's")
    before = top_level(tmp_path)
    os.replace(tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.before-20261128-120000")  # set_aside_logs
    for name in ("metrics.jsonl", "rollouts.jsonl", "config.json"):
        (tmp_path / name).write_text("")
    (tmp_path / "wandb").mkdir()
    (tmp_path / "other.txt").write_text("not the run's")  # written by someone else meanwhile: left
    put_back(tmp_path, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "notes.txt", "other.txt"]
    assert (tmp_path / "metrics.jsonl").read_text() == "earlier\n"


def test_an_evaluation_says_how_far_it_got(tmp_path, capsys):
    """An evaluation printed one line before and one after: minutes of silence on a big eval split."""
    code = main([*SMALL, "logging.progress=true", f"logging.run_dir={tmp_path / 'run'}", "trainer.steps=1"])
    err = capsys.readouterr().err
    assert code == 0, err
    for paths in ("greedy", "sampled"):
        for turn in (1, 2):
            assert f"magrpo: eval (step 1): {paths} paths, turn {turn}/2 done (" in err, err


def test_a_stop_says_how_far_the_step_it_waits_for_got(tmp_path, capsys, monkeypatch):
    """After `finishing this step`, nothing was said until the checkpoint: a step can take minutes."""
    monkeypatch.setitem(stop_probe.CALLS, "n", 0)
    code = main([*SMALL, "logging.progress=true", f"logging.run_dir={tmp_path / 'run'}", "trainer.steps=2",
                 "eval.at_end=false", "external.mode=tests.stop_probe:signals"])
    err = capsys.readouterr().err
    assert code == 143, err
    lines = [line.strip() for line in err.replace("\r", "\n").splitlines() if line.startswith("magrpo: SIGTERM")]
    assert lines == ["magrpo: SIGTERM: finishing this step, then writing a checkpoint",
                     "magrpo: SIGTERM: step 1: turn 1/2 done; then the update and a checkpoint",
                     "magrpo: SIGTERM: step 1: turn 2/2 done; then the update and a checkpoint",
                     "magrpo: SIGTERM: step 1: update done; writing a checkpoint"], err


def test_a_slow_checkpoint_write_says_how_far_it_got(tmp_path, capsys, monkeypatch):
    """A checkpoint write (big adapters and optimizer states, a slow disk) took minutes in silence."""
    import magrpo.trainer

    monkeypatch.setattr(magrpo.trainer, "SLOW_WRITE_S", 0)  # every write counts as slow: nothing here is timed
    run = tmp_path / "run"
    code = main([*SMALL, "logging.progress=true", f"logging.run_dir={run}", "trainer.steps=1", "eval.at_end=false"])
    err = capsys.readouterr().err
    assert code == 0, err
    lines = [re.sub(r" \(\d+ s\)$", "", line.strip()) for line in err.replace("\r", "\n").splitlines()
             if line.startswith("magrpo: writing checkpoint")]
    assert lines == ["magrpo: writing checkpoint step 1: agent 1/2 written",
                     "magrpo: writing checkpoint step 1: agent 2/2 written",
                     "magrpo: writing checkpoint step 1: checksums written",
                     f"magrpo: writing checkpoint step 1: done, {run / 'checkpoints' / 'step_000001'}"], err


def test_a_quick_phase_says_nothing():
    """Only a write that has taken SLOW_WRITE_S says how far it got: a quick one keeps the console as it was."""
    from magrpo.console import phase_lines

    said = []

    class Bar:
        def write(self, s, file=None):
            said.append(s)

    phase_lines(Bar(), True, "writing checkpoint step 1", quiet_s=3600)("agent 1/2 written")
    phase_lines(Bar(), False, "writing checkpoint step 1")("agent 1/2 written")  # not rank 0
    assert said == []
    phase_lines(Bar(), True, "writing checkpoint step 1")("agent 1/2 written")
    assert said == ["magrpo: writing checkpoint step 1: agent 1/2 written (0 s)"]
