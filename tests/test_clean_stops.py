"""Every start and every stop is clean (issue 45): hung user code is stopped by its time limit."""
from __future__ import annotations

import time

import pytest

from magrpo.cli import main
from tests import stop_probe
from tests.conftest import SMALL


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
