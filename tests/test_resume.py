"""Runs that survive: seeded runs repeat exactly, and a run killed at any point (SIGKILL, SIGTERM)
continues from its last complete checkpoint to the same rollouts and metrics as an uninterrupted run."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, SMALL

RUN = [*SMALL, "trainer.steps=4", "generation.max_new_tokens=12", "eval.every=2", "checkpoint.every=1",
       "checkpoint.keep=2", "logging.progress=false"]


def start(run_dir, *overrides):
    cmd = [sys.executable, "train.py", *RUN, f"logging.run_dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(run_dir, *overrides):
    proc = start(run_dir, *overrides)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return err


def comparable(run_dir):
    """rollouts.jsonl bytes, and metrics without wall-clock timings (perf/*)."""
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
               for line in open(run_dir / "metrics.jsonl")]
    return (run_dir / "rollouts.jsonl").read_bytes(), metrics


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    finish(run)
    return run


def test_two_seeded_runs_are_identical(reference, tmp_path):
    finish(tmp_path / "again")
    rollouts, metrics = comparable(reference)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert comparable(tmp_path / "again") == (rollouts, metrics)


def wait_for(path, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_sigkill_then_resume_auto_matches_the_uninterrupted_run(reference, tmp_path):
    run = tmp_path / "killed"
    proc = start(run)
    wait_for(run / "checkpoints" / "step_000002" / "COMPLETE", proc)
    proc.send_signal(signal.SIGKILL)  # wherever it is: mid-step 3, mid-write, ...
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    err = finish(run, "resume=auto")
    assert "resuming from" in err
    assert comparable(run) == comparable(reference)


def test_sigterm_writes_a_checkpoint_and_resume_continues(reference, tmp_path):
    run = tmp_path / "stopped"
    proc = start(run, "checkpoint.every=0")  # only the signal writes one
    wait_for(run / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in err and "resume=auto" in err
    (saved,) = (run / "checkpoints").glob("step_*")
    assert int(saved.name.split("_")[1]) < 4
    finish(run, "resume=auto", "checkpoint.every=0")
    assert comparable(run) == comparable(reference)


def test_resume_auto_skips_a_truncated_checkpoint(reference, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(reference, run)
    newest, older = sorted((run / "checkpoints").glob("step_*"), reverse=True)
    assert [newest.name, older.name] == ["step_000004", "step_000003"]  # keep=2
    trainer_state = newest / "trainer.pt"
    trainer_state.write_bytes(trainer_state.read_bytes()[: trainer_state.stat().st_size // 2])
    err = finish(run, "resume=auto")
    assert f"skipping checkpoint {newest}" in err and f"resuming from {older}" in err
    assert comparable(run) == comparable(reference)  # step 4 redone the same way


def test_half_written_checkpoint_is_never_picked(reference, tmp_path):
    from magrpo.checkpoint import candidates

    run = tmp_path / "copy"
    shutil.copytree(reference, run)
    partial = run / "checkpoints" / ".tmp-step_000005-123"  # a crash before the rename
    shutil.copytree(run / "checkpoints" / "step_000004", partial)
    incomplete = run / "checkpoints" / "step_000006"  # a folder without its COMPLETE marker
    shutil.copytree(run / "checkpoints" / "step_000004", incomplete)
    os.remove(incomplete / "COMPLETE")
    assert [p.name for p in candidates(run)] == ["step_000004", "step_000003"]
