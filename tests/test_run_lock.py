"""One writer per run dir: a second run (or a `resume=auto` while the first is live) stops before
loading anything, naming the holder; a lock left by a dead process is taken over."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from magrpo.errors import ConfigError
from magrpo.run_lock import LOCK, acquire


def test_a_second_writer_is_refused_with_the_holders_pid_and_host(tmp_path):
    first = acquire(tmp_path)
    with pytest.raises(ConfigError) as e:
        acquire(tmp_path)
    first.release()
    assert e.value.key == "logging.run_dir" and "\n" not in str(e.value)
    assert f"in use by another run (pid {os.getpid()} on host {socket.gethostname()}, since " in str(e.value)
    assert not (tmp_path / LOCK).exists()  # released: the file goes with it
    acquire(tmp_path).release()


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    """kill -9 leaves run.lock with the dead holder's record; the kernel dropped its flock."""
    holder = subprocess.run([sys.executable, "-c", "import sys; from magrpo.run_lock import acquire; "
                             "acquire(__import__('pathlib').Path(sys.argv[1])); import os; os._exit(0)",
                             str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert holder.returncode == 0, holder.stderr
    dead = json.loads((tmp_path / LOCK).read_text())["pid"]
    lock = acquire(tmp_path)
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid() != dead
    lock.release()


@pytest.mark.parametrize("resume", [[], ["resume=auto"]])
def test_a_run_on_a_live_run_dir_stops_before_loading_a_model(run_cli, tmp_path, resume):
    """Two runs on one dir used to both finish with exit 0, their files mixed (config and metrics of
    one, checkpoints of the other). run_cli fails the test if a model loads."""
    from tests.conftest import SMALL

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    live = acquire(run_dir)
    try:
        code, err = run_cli(*SMALL, f"logging.run_dir={run_dir}", *resume)
        assert os.listdir(run_dir) == [LOCK]  # nothing written by the refused run
    finally:
        live.release()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"config error: logging.run_dir: {run_dir} is in use by another run (pid {os.getpid()} "
                             f"on host {socket.gethostname()}, since ")


def test_a_run_dir_made_for_a_run_that_stops_before_writing_is_removed(run_cli, tmp_path):
    """The run dir is made (and locked) before the resume decision; a refusal there leaves no empty dir."""
    from tests.conftest import SMALL

    torn = tmp_path / "step_000001"  # a checkpoint whose trainer.pt is gone
    torn.mkdir()
    (torn / "COMPLETE").write_text(json.dumps({"step": 1, "sha256": {"trainer.pt": "0"}}))
    code, err = run_cli(*SMALL, f"logging.run_dir={tmp_path / 'new'}", f"resume={torn}")
    assert code == 2 and err == [f"config error: resume: checkpoint {torn} is unreadable (trainer.pt is missing); give "
                                 f"another checkpoint folder or resume=auto; nothing was changed"], err
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_resume_started_while_the_run_is_live_stops_and_the_run_finishes_alone(tmp_path):
    """The audit's case: a `resume=auto` on a live run dir used to run too, both exiting 0 with their
    files mixed. Now it stops with one line naming the live run; the live run finishes unmixed. The
    live run waits at its first feedback call (tests/gated_feedback.py) until the second has exited:
    timing alone let a fast machine finish all 4 steps before the second process started."""
    from tests.conftest import ROOT, SMALL

    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    gate.mkdir()
    args = [sys.executable, "train.py", *SMALL, f"logging.run_dir={run_dir}", "trainer.steps=4", "checkpoint.every=1",
            "generation.max_new_tokens=12", "external.mode=tests.gated_feedback:gated"]
    live = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MAGRPO_TEST_GATE": str(gate)})
    try:
        while not (gate / "entered").is_file():
            assert live.poll() is None, live.communicate()[1]
            time.sleep(0.1)
        second = subprocess.run([*args, "resume=auto"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        (gate / "open").touch()
        _, err = live.communicate(timeout=300)
    assert live.returncode == 0, err
    assert second.returncode == 2 and second.stderr.strip().startswith(
        f"config error: logging.run_dir: {run_dir} is in use by another run (pid {live.pid} on host "
        f"{socket.gethostname()}, since "), second.stderr
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not list(run_dir.glob("*.before-*")) and not (run_dir / LOCK).exists()
