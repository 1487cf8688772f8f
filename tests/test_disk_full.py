"""A full disk (or any failed write) is one line naming the path and the OS error; nothing
half-written is left behind and the previous checkpoint stays intact. Fast cases fake the failure;
the slow one fills a real tmpfs (root in a mount namespace, skipped where that is not allowed)."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from magrpo import checkpoint
from magrpo.errors import TrainingError
from magrpo.run_io import RunWriter
from tests.conftest import ROOT, SMALL

FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
Usage = namedtuple("Usage", "total used free")
RESUME_HINT = "free space, then resume=auto continues from the last complete checkpoint"


class FakeAgent:
    adapter = "agent_0"

    def save(self, root):
        (root / self.adapter).mkdir(parents=True, exist_ok=True)
        (root / self.adapter / "adapter.bin").write_bytes(b"\0" * 4096)
        return root / self.adapter


UPDATER = SimpleNamespace(params=[torch.zeros(64)], optimizer=SimpleNamespace(state_dict=dict),
                          scheduler=SimpleNamespace(state_dict=dict))


def save(run_dir, step, keep=2):
    return checkpoint.save(run_dir, step, [FakeAgent()], [UPDATER], {"step": step}, {"seed": 0}, keep)


def leftovers(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_a_failed_checkpoint_write_is_one_line_and_leaves_no_temp_folder(tmp_path, monkeypatch):
    """It used to say `unexpected RuntimeError: [enforce fail at inline_container.cc:672]` and leave the
    temp folder filling the disk."""
    first = save(tmp_path, 1)
    monkeypatch.setattr(checkpoint.torch, "save", lambda *a, **k: (_ for _ in ()).throw(FULL))
    with pytest.raises(TrainingError) as e:
        save(tmp_path, 2)
    assert str(e.value) == (f"cannot write {checkpoint.folder_of(tmp_path, 2)}: [Errno 28] No space left on device; "
                            f"the checkpoint of step 1 is intact: {RESUME_HINT}")
    assert leftovers(tmp_path) == ["step_000001"]
    checkpoint.verify(first)


def test_torchs_own_error_for_a_full_disk_names_the_os_error(tmp_path, monkeypatch):
    def torch_full(*args, **kwargs):  # what torch.save raises when the disk fills under it
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpoint.torch, "save", torch_full)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(2**21, 2**21, 0))
    with pytest.raises(TrainingError, match=r"^cannot write .*step_000001: \[Errno 28\] No space left on device; free"):
        save(tmp_path, 1)
    assert leftovers(tmp_path) == []


def test_an_error_that_is_not_the_disks_is_not_called_one(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint.torch, "save", lambda *a, **k: (_ for _ in ()).throw(TypeError("a bug")))
    with pytest.raises(TypeError, match="a bug"):
        save(tmp_path, 1)
    assert leftovers(tmp_path) == []


def test_short_of_space_the_checkpoints_to_prune_go_first(tmp_path, monkeypatch, capsys):
    for step in (1, 2):
        save(tmp_path, step)
    size = checkpoint._size(checkpoint.folder_of(tmp_path, 2))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, size // 2))
    save(tmp_path, 3, keep=2)
    assert leftovers(tmp_path) == ["step_000002", "step_000003"]
    assert f"magrpo: removed {checkpoint.folder_of(tmp_path, 1)} before writing step 3's checkpoint to make room " \
           f"(checkpoint.keep=2)" in capsys.readouterr().err


def test_short_of_space_the_newest_checkpoint_is_never_removed_first(tmp_path, monkeypatch):
    """keep=1: making room would mean deleting the only checkpoint before the new one exists."""
    save(tmp_path, 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(0, 0, 1000))
    with pytest.raises(TrainingError, match=r"^not enough space for checkpoint step 2 in .*: 0\.0 MiB free, the last "
                                            r"checkpoint takes 0\.0 MiB; the checkpoint of step 1 is intact"):
        save(tmp_path, 2, keep=1)
    assert leftovers(tmp_path) == ["step_000001"]


def test_a_failed_log_write_names_the_file(tmp_path):
    writer = RunWriter(tmp_path, {"seed": 0}, SimpleNamespace(mode="disabled"))

    class Full:
        def write(self, text):
            raise FULL

        def close(self):
            raise FULL

    writer.metrics = Full()
    with pytest.raises(TrainingError) as e:
        writer.log_metrics(1, {"x": 1.0})
    assert str(e.value) == f"cannot write {tmp_path / 'metrics.jsonl'}: [Errno 28] No space left on device; " \
                           f"{RESUME_HINT}"
    writer.close()  # no second error at the end


def in_tmpfs(size: str, out, *overrides):
    """train.py with its run dir on a tmpfs of `size` (a mount namespace of its own); the run dir is
    copied to `out` before the namespace (and the tmpfs) goes."""
    mount = out / "mnt"
    mount.mkdir()
    args = " ".join([*SMALL, "trainer.steps=3", "checkpoint.every=1", "eval.at_end=false", *overrides])
    script = (f"mount -t tmpfs -o size={size} tmpfs {mount} || exit 99; {sys.executable} train.py {args} "
              f"logging.run_dir={mount}/run; echo $? > {out}/rc; cp -a {mount}/run {out}/run")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode == 99 or not (out / "rc").is_file():
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount namespaces): {proc.stderr.strip()[-200:]}")
    return int((out / "rc").read_text()), proc.stderr.strip().splitlines()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare command to make a mount namespace")
@pytest.mark.parametrize("size, intact", [("2m", None), ("4m", 1)])
def test_a_full_tmpfs_stops_with_one_line_and_the_run_dir_resumable(tmp_path, size, intact):
    """2 MB: the first checkpoint (about 2.9 MB) does not fit; 4 MB: the second does not fit beside the first
    (keep=1 never removes the newest before writing)."""
    code, err = in_tmpfs(size, tmp_path, "checkpoint.keep=1")
    assert code == 1, err
    mount = tmp_path / "mnt"
    if intact is None:
        assert err[-1].startswith(f"error: cannot write {mount}/run/checkpoints/step_000001: [Errno 28] No space left "
                                  f"on device; free space, then resume=auto"), err
    else:
        assert err[-1].startswith(f"error: not enough space for checkpoint step 2 in {mount}/run: "), err
        assert f"the checkpoint of step {intact} is intact" in err[-1]
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert steps == ([f"step_{intact:06d}"] if intact else [])  # no temp folder left
    if intact:
        checkpoint.verify(tmp_path / "run" / "checkpoints" / steps[0])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare command to make a mount namespace")
def test_on_a_tight_tmpfs_the_checkpoint_to_prune_goes_first_and_the_run_finishes(tmp_path):
    """8 MB holds two checkpoints (about 2.9 MB each) and the logs but not a third: with keep=2 the
    oldest, pruned after the write before, now goes first. Before, step 3's write failed."""
    code, err = in_tmpfs("8m", tmp_path, "checkpoint.keep=2")
    assert code == 0, err
    mount = tmp_path / "mnt"
    assert f"magrpo: removed {mount}/run/checkpoints/step_000001 before writing step 3's checkpoint to make room " \
           f"(checkpoint.keep=2)" in err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def test_an_error_log_that_cannot_be_written_is_not_left_empty(tmp_path, monkeypatch):
    """The audit's full disk left an empty error.log next to its one unhelpful line."""
    import magrpo.errors

    class FullFile:
        def __init__(self, path, mode):
            open(path, mode).close()  # created, as open() does, then the disk is full

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise FULL

    monkeypatch.setattr(magrpo.errors, "open", FullFile, raising=False)
    assert magrpo.errors.log_traceback(tmp_path, ValueError("x")) is None
    assert not (tmp_path / "error.log").exists()
