"""Runs that survive: seeded runs repeat exactly, a run killed at any point (SIGKILL, SIGTERM)
continues from its last complete checkpoint to the same rollouts, metrics and adapters as an
uninterrupted run, and a resume that does not match the run changes nothing in its run dir."""
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


def adapters(run_dir):
    """The final adapters' tensors, every agent."""
    from safetensors.torch import load_file

    return {p.parent.name: load_file(p) for p in sorted((run_dir / "adapters").glob("*/*.safetensors"))}


def same_adapters(a, b):
    return a.keys() == b.keys() and all(
        x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x) for x, y in zip(a.values(), b.values()))


def snapshot(folder):
    """Every path under folder, with the bytes of each file."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def copy_of(reference, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(reference, run)
    return run


def cli(capsys, run_dir, *overrides):
    """train.py in this process (no start-up cost): exit code and stderr lines."""
    from magrpo.cli import main

    capsys.readouterr()
    code = main([*RUN, f"logging.run_dir={run_dir}", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


def flip_a_bit(path, at=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    finish(run)
    return run


@pytest.mark.slow
def test_two_seeded_runs_are_identical(reference, tmp_path):
    finish(tmp_path / "again")
    rollouts, metrics = comparable(reference)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert comparable(tmp_path / "again") == (rollouts, metrics)


def wait_for(path, proc, timeout=300, written=False):
    """Until `path` exists (with `written`: holds something; the run creates metrics.jsonl empty at
    start-up, before its SIGTERM handler is installed, and writes its first record after that)."""
    deadline = time.monotonic() + timeout
    while not path.exists() or (written and path.stat().st_size == 0):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
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


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_resume_continues(reference, tmp_path):
    run = tmp_path / "stopped"
    proc = start(run, "checkpoint.every=0")  # only the signal writes one
    wait_for(run / "metrics.jsonl", proc, written=True)  # a signal before the handler would just kill it
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err  # not 0: a scheduler must not read it as done
    assert err.splitlines()[-1].startswith("stopped: SIGTERM after step ") and "resume=auto" in err
    (saved,) = (run / "checkpoints").glob("step_*")
    assert int(saved.name.split("_")[1]) < 4
    finish(run, "resume=auto", "checkpoint.every=0")
    assert comparable(run) == comparable(reference)


@pytest.mark.slow
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


def kill_at(run_dir, point, step, *overrides):
    """A run that SIGKILLs itself at `point` of `step` (tests/kill_at.py)."""
    cmd = [sys.executable, "-m", "tests.kill_at", point, str(step), *RUN, f"logging.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return proc.stderr


@pytest.mark.slow
def test_kill_9_at_three_points_then_resume_auto_matches_the_uninterrupted_run(reference, tmp_path):
    """One run, killed three times (mid-checkpoint-write, mid-rollouts-line after the step's metrics,
    between a checkpoint's rename and the pruning of older ones), each time resumed with resume=auto."""
    run, steps = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    kill_at(run, "checkpoint", 2)
    assert [p.name for p in steps.glob(".tmp-step_000002-*")] and not (steps / "step_000002").exists()
    err = kill_at(run, "rollouts", 3, "resume=auto")
    assert f"resuming from {steps / 'step_000001'}" in err
    assert not list(steps.glob(".tmp-*"))  # the dead writer's temp folder is gone
    err = kill_at(run, "prune", 3, "resume=auto")
    assert f"resuming from {steps / 'step_000002'}" in err and "rollouts.jsonl: line(s) 5 " in err
    assert sorted(p.name for p in steps.iterdir()) == ["step_000001", "step_000002", "step_000003"]
    err = finish(run, "resume=auto")
    assert f"resuming from {steps / 'step_000003'}" in err
    assert comparable(run) == comparable(reference)
    assert same_adapters(adapters(run), adapters(reference))
    assert sorted(p.name for p in steps.iterdir()) == ["step_000003", "step_000004"]


CHANGES = {  # override on resume -> the key and values the error names
    "model.tiny_layers=3": "model.tiny_layers (2 -> 3)",
    "lora.r=8": "lora.r (16 -> 8)",
    "trainer.lr=0.5": "trainer.lr (0.02 -> 0.5)",
    "env.num_agents=3": "env.num_agents (2 -> 3)",
    "trainer.joint_mode=cross": "trainer.joint_mode (\"align\" -> \"cross\")",
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_config_change_on_resume_stops_with_one_line_and_changes_nothing(reference, tmp_path, capsys, change):
    run = copy_of(reference, tmp_path)
    before = snapshot(run)
    code, err = cli(capsys, run, "resume=auto", change)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("config error: resume: the config differs from checkpoint") and CHANGES[change] in err[0]
    assert f"resume_force=[{CHANGES[change].split()[0]}]" in err[0] and "logging.run_dir" in err[0]
    assert snapshot(run) == before


def test_a_forced_shape_change_is_one_line_too(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    before = snapshot(run)
    code, err = cli(capsys, run, "resume=auto", "lora.r=8", "resume_force=[lora.r]")
    assert code == 2 and err[-1].startswith("config error: resume:") and "does not fit" in err[-1], err
    assert snapshot(run) == before


def test_resume_force_continues_with_the_new_value(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    code, err = cli(capsys, run, "resume=auto", "trainer.steps=5", "trainer.lr=0.01", "resume_force=[trainer.lr]")
    assert code == 0, err
    assert any("resuming with changed trainer.lr (0.02 -> 0.01) (resume_force)" in line for line in err)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 5 and last["train/agent_0/lr"] == 0.01  # the optimizer took the new lr


def test_safe_keys_may_change_on_resume(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    code, err = cli(capsys, run, "resume=auto", "eval.every=0", "checkpoint.keep=3", "trainer.micro_batch_size=4")
    assert code == 0 and f"magrpo: resuming from {run / 'checkpoints' / 'step_000004'}" in err, err


def test_every_checkpoint_unreadable_stops_with_one_line_and_changes_nothing(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    for folder in (run / "checkpoints").glob("step_*"):
        flip_a_bit(folder / "trainer.pt")
    before = snapshot(run)
    code, err = cli(capsys, run, "resume=auto")
    assert code == 2 and err[-1].startswith("config error: resume: no checkpoint under") and len(err) == 3, err
    assert all(line.startswith("magrpo: skipping checkpoint") for line in err[:-1])
    assert snapshot(run) == before


def test_a_fresh_start_in_a_run_dir_with_checkpoints_is_refused(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    before = snapshot(run)
    code, err = cli(capsys, run)
    assert code == 2 and err == [f"config error: logging.run_dir: {run} holds checkpoints of an earlier run; continue "
                                 f"it with resume=auto, or pick another logging.run_dir; nothing was changed"]
    assert snapshot(run) == before


def test_an_unreadable_explicit_checkpoint_is_one_line(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    newest = run / "checkpoints" / "step_000004"
    flip_a_bit(newest / "agent_0" / "train.pt")
    before = snapshot(run)
    code, err = cli(capsys, run, f"resume={newest}")
    assert code == 2 and err == [f"config error: resume: checkpoint {newest} is unreadable (agent_0/train.pt does not "
                                 f"match its sha256 in COMPLETE); give another checkpoint folder or resume=auto; "
                                 f"nothing was changed"], err
    assert snapshot(run) == before


def test_a_flipped_bit_falls_back_to_the_previous_checkpoint(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    newest, older = sorted((run / "checkpoints").glob("step_*"), reverse=True)
    flip_a_bit(newest / "agent_1" / "train.pt", at=0.9)  # a tensor's last bits: torch.load would not notice
    code, err = cli(capsys, run, "resume=auto")
    assert code == 0
    assert f"magrpo: skipping checkpoint {newest}: agent_1/train.pt does not match its sha256 in COMPLETE" in err
    assert f"magrpo: resuming from {older}" in err
    assert comparable(run) == comparable(reference)  # step 4 redone the same way
    assert same_adapters(adapters(run), adapters(reference))


def test_a_checkpoint_from_before_checksums_loads_unverified_and_shapes_are_still_checked(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    newest = run / "checkpoints" / "step_000004"
    (newest / "COMPLETE").write_text(json.dumps({"step": 4}))  # what older magrpo wrote
    (newest / "config.json").unlink()
    before = snapshot(run)
    code, err = cli(capsys, run, "resume=auto", "lora.r=8")
    assert code == 2 and err[-1].startswith(f"config error: resume: {newest}/agent_0 does not fit this config's "
                                            f"adapters (tensor 0: [16, "), err
    assert snapshot(run) == before
    code, err = cli(capsys, run, "resume=auto")
    assert code == 0 and "written by an older magrpo): loading it unverified" in " ".join(err)
    assert f"magrpo: resuming from {newest}" in err


def test_logs_keep_every_valid_line_and_the_step_after_the_checkpoint_is_rewritten(reference, tmp_path, capsys):
    """Garbage in the middle of both logs is moved aside, the lines after it are kept, and a torn last
    line of the step after the checkpoint leaves no gap."""
    run = copy_of(reference, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_000004")  # resume from step 3: step 4 is redone
    metrics = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    garbled = [*metrics[:1], "{\"step\": 2, \"train/rew\x00\n", *metrics[1:3], metrics[3][:40]]  # step 4 torn
    (run / "metrics.jsonl").write_text("".join(garbled))
    rollouts = (run / "rollouts.jsonl").read_text().splitlines(keepends=True)
    (run / "rollouts.jsonl").write_text("".join([*rollouts[:3], "not json\n", *rollouts[3:]]))
    code, err = cli(capsys, run, "resume=auto")
    assert code == 0, err
    assert f"magrpo: {run / 'metrics.jsonl'}: line(s) 2, 5 are not valid JSON records (torn or garbled); moved to " \
           f"metrics.jsonl.corrupt" in err
    assert f"magrpo: {run / 'rollouts.jsonl'}: line(s) 4 are not valid JSON records (torn or garbled); moved to " \
           f"rollouts.jsonl.corrupt" in err
    assert comparable(run) == comparable(reference)
    assert (run / "metrics.jsonl.corrupt").read_text() == garbled[1] + metrics[3][:40] + "\n"
    assert (run / "rollouts.jsonl.corrupt").read_text() == "not json\n"


def test_repair_log_keeps_valid_lines_up_to_the_step(tmp_path, capsys):
    from magrpo.run_io import repair_log

    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b'{"step": 1}\n{"step": 2, "x": [1,\n[3]\n{"step": 2}\n{"step": 3}\n\xff\xfe\n{"step": 2}\n'
                    b'{"step": 4, "y"')
    repair_log(log, 2)
    assert log.read_bytes() == b'{"step": 1}\n{"step": 2}\n{"step": 2}\n'
    corrupt = b'{"step": 2, "x": [1,\n[3]\n\xff\xfe\n{"step": 4, "y"\n'
    assert (tmp_path / "metrics.jsonl.corrupt").read_bytes() == corrupt
    assert "line(s) 2, 3, 6, 8 are not valid JSON records" in capsys.readouterr().err


def test_an_error_on_rank_0_is_raised_on_every_rank():
    """Rank 0 reads the checkpoint; its one-line error reaches the other ranks instead of a hang."""
    from magrpo.checkpoint import on_main
    from magrpo.config import ConfigError

    class Rank1:
        is_main, size = False, 2

        def broadcast(self, obj):
            assert obj is None  # rank 1 sends nothing, gets rank 0's outcome
            return {"config_error": ("resume", "no checkpoint under X can be read")}

    with pytest.raises(ConfigError, match="^resume: no checkpoint under X can be read$"):
        on_main(Rank1(), lambda: pytest.fail("only rank 0 reads"))


def test_a_file_where_a_checkpoint_folder_should_be_is_skipped_and_renamed(reference, tmp_path, capsys):
    """It used to stop every resume with `unexpected NotADirectoryError`, after redoing the step."""
    run = copy_of(reference, tmp_path)
    newest = run / "checkpoints" / "step_000004"
    shutil.rmtree(newest)
    newest.write_text("not a checkpoint")
    code, err = cli(capsys, run, "resume=auto")
    assert code == 0, err
    assert f"magrpo: skipping checkpoint {newest}: not a folder" in err
    assert f"magrpo: resuming from {run / 'checkpoints' / 'step_000003'}" in err
    (aside,) = (run / "checkpoints").glob("step_000004.before-*")
    assert f"magrpo: {newest} is not a checkpoint folder: renamed to {aside.name}" in err
    assert aside.read_text() == "not a checkpoint" and (newest / "COMPLETE").is_file()
    assert comparable(run) == comparable(reference)


def test_a_deleted_complete_marker_is_said_before_falling_back(reference, tmp_path, capsys):
    """It used to fall back to the checkpoint before silently."""
    run = copy_of(reference, tmp_path)
    newest = run / "checkpoints" / "step_000004"
    (newest / "COMPLETE").unlink()
    code, err = cli(capsys, run, "resume=auto")
    assert code == 0, err
    assert f"magrpo: skipping checkpoint {newest}: no COMPLETE marker (it is written last: the write did not " \
           f"finish, or it was deleted)" in err
    assert f"magrpo: resuming from {run / 'checkpoints' / 'step_000003'}" in err
    assert "magrpo: metrics.jsonl: step(s) 4 were logged after checkpoint step 3: dropped, the resumed run logs " \
           "them again" in err
    assert comparable(run) == comparable(reference)


def test_deleted_logs_and_a_changed_config_are_said_on_resume(reference, tmp_path, capsys):
    """Deleted metrics and rollouts resumed with no word that steps 1-4 were gone, and a resume with
    other trainer.steps overwrote config.json."""
    run = copy_of(reference, tmp_path)
    (run / "metrics.jsonl").unlink()
    rollouts = (run / "rollouts.jsonl").read_text().splitlines(keepends=True)
    (run / "rollouts.jsonl").write_text("".join(rollouts[4:]))  # B=2 trees a step: steps 1 and 2 gone
    first_config = (run / "config.json").read_text()
    code, err = cli(capsys, run, "resume=auto", "trainer.steps=5")
    assert code == 0, err
    assert "magrpo: metrics.jsonl: step(s) 1-4 are missing (the file is gone); the resumed run logs from step 5 on" \
           in err
    assert "magrpo: rollouts.jsonl: step(s) 1-2 are missing (deleted or moved from the file); the resumed run logs " \
           "from step 5 on" in err
    (aside,) = run.glob("config.json.before-*")
    assert f"magrpo: {run / 'config.json'} kept as {aside.name}: this start's config differs in logging.run_dir, " \
           f"trainer.steps" in err  # the copy's run dir, the new steps; not resume (null -> auto)
    assert aside.read_text() == first_config and json.loads((run / "config.json").read_text())["trainer"]["steps"] == 5


def test_resuming_with_fewer_steps_says_there_is_nothing_left(reference, tmp_path, capsys):
    run = copy_of(reference, tmp_path)
    code, err = cli(capsys, run, "resume=auto", "trainer.steps=2")
    assert code == 0, err
    assert "magrpo: the checkpoint is at step 4, trainer.steps=2: no step left to train; raise trainer.steps to go " \
           "on" in err
    assert json.loads(next(run.glob("config.json.before-*")).read_text())["trainer"]["steps"] == 4


def test_an_unchanged_config_json_is_left_alone(tmp_path):
    from magrpo.run_io import write_config

    write_config(tmp_path, {"a": 1, "resume": None})
    write_config(tmp_path, {"a": 1, "resume": "auto"})  # how a start began is no change
    write_config(tmp_path, {"a": 2, "resume": "auto"})
    assert sorted(p.name for p in tmp_path.iterdir())[0] == "config.json" and len(list(tmp_path.iterdir())) == 2


def test_resume_auto_without_a_checkpoint_says_it_starts_from_step_1(tmp_path, capsys):
    from magrpo.checkpoint import choose

    assert choose("auto", str(tmp_path), {}) is None
    assert capsys.readouterr().err == f"magrpo: resume=auto: no checkpoint in {tmp_path}; starting from step 1\n"
