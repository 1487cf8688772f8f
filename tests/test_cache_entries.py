"""Builds that cannot leave debris, cache entries that are verified (issue 45): a build killed in its
temp folder, or a sandbox's private copy killed with its run, is swept by the next start once its owner
is dead; a cache entry with truncated weights, files missing or bytes changed is built again; a cache
that cannot be written is one line naming MAGRPO_CACHE and the folder."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from magrpo.paths import COMPLETE, owned_folder, sweep
from magrpo.tiny import TinySpec, tiny_model_path
from tests.conftest import ROOT, SMALL, wait_for


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The default tiny model, built once into a cache of this module's own."""
    return tiny_model_path(TinySpec(), cache_dir=tmp_path_factory.mktemp("cache"))


def copied(built: Path, tmp_path: Path) -> Path:
    """A cache holding a copy of the built entry (as a cache written before markers existed: no marker)."""
    entry = tmp_path / "cache" / "tiny" / built.name
    shutil.copytree(built, entry, ignore=shutil.ignore_patterns(COMPLETE))
    return entry


@pytest.mark.slow
def test_a_build_killed_mid_way_is_swept_by_the_next_one(tmp_path, capfd):
    """kill -9 during the first build left its `.NAME.*.tmp` folder in $MAGRPO_CACHE forever."""
    cache = tmp_path / "cache"
    env = dict(os.environ, HF_HUB_OFFLINE="1", MAGRPO_CACHE=str(cache), MAGRPO_TEST_GATE=str(tmp_path),
               MAGRPO_TEST_STALL="build")
    proc = subprocess.Popen([sys.executable, "train.py", *SMALL, f"logging.run_dir={tmp_path / 'run'}",
                             "plugins=[tests.stop_probe]"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(tmp_path / "build", proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    (left,) = (cache / "tiny").glob(".*.tmp")
    entry = tiny_model_path(TinySpec(), cache_dir=cache)
    assert not left.exists() and not list(entry.parent.glob(".*.tmp"))
    assert f"magrpo: removed {left}, left by a build that did not finish" in capfd.readouterr().err
    assert (entry / COMPLETE).is_file()


def test_a_private_copy_of_a_killed_run_is_swept(tmp_path):
    """A SIGKILLed run left its /tmp/magrpo-judge-* copy (removed only atexit) for good."""
    code = ("import sys, time; from magrpo.envs.code import isolation; "
            "print(isolation.private_copy('magrpo-judge-', ('judge.py', 'wire.py'), sys.executable, 0o500), "
            "flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        left = Path(proc.stdout.readline().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert left.is_dir() and left.parent == Path(tempfile.gettempdir())
    mine, lock = owned_folder(tempfile.gettempdir(), "magrpo-judge-")  # a live owner's: kept
    try:
        assert left in sweep(tempfile.gettempdir(), "magrpo-judge-")
        assert not left.exists() and mine.is_dir()
    finally:
        shutil.rmtree(mine)
        os.close(lock)


@pytest.mark.parametrize("damage, why", [
    (lambda e: (e / "model.safetensors").write_bytes((e / "model.safetensors").read_bytes()[:5000]),
     "model.safetensors holds 5,000 bytes, "),
    (lambda e: [p.unlink() for p in e.iterdir() if p.name != "config.json"], "it holds no weights"),
    (lambda e: flip_last_byte(e / "model.safetensors"),
     "model.safetensors does not match its sha256 from when it was built"),
])
def test_a_broken_cache_entry_is_built_again(built, tmp_path, capfd, damage, why):
    """A cached folder with only config.json, or truncated weights: `unexpected SafetensorError`, exit
    1, never rebuilt. Now it is said and built again."""
    entry = copied(built, tmp_path)
    assert tiny_model_path(TinySpec(), cache_dir=tmp_path / "cache") == entry  # checked by its shape, then sealed
    assert (entry / COMPLETE).is_file()
    damage(entry)
    assert tiny_model_path(TinySpec(), cache_dir=tmp_path / "cache") == entry
    err = capfd.readouterr().err
    assert f"magrpo: the cached tiny model {entry} is broken ({why}" in err, err
    assert (entry / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    assert not list(entry.parent.glob(".*.tmp"))


def flip_last_byte(path: Path) -> None:
    """Bytes changed in place, the size kept (a disk's error, a program writing into the file)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_marker_from_before_checksums_gets_them(built, tmp_path):
    """An entry sealed with sizes only is checked by its shape and sizes, then sealed with checksums."""
    import json

    entry = copied(built, tmp_path)
    sizes = {p.name: p.stat().st_size for p in entry.iterdir()}
    (entry / COMPLETE).write_text(json.dumps({"files": sizes}))
    assert tiny_model_path(TinySpec(), cache_dir=tmp_path / "cache") == entry
    marker = json.loads((entry / COMPLETE).read_text())
    assert marker["files"] == sizes and sorted(marker["sha256"]) == sorted(sizes)


def test_truncated_weights_without_a_marker_are_found_by_their_header(built, tmp_path, capfd):
    entry = copied(built, tmp_path)
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    tiny_model_path(TinySpec(), cache_dir=tmp_path / "cache")
    assert "model.safetensors holds " in capfd.readouterr().err
    assert weights.read_bytes() == (built / "model.safetensors").read_bytes()


def test_a_cache_that_cannot_be_written_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """A file as MAGRPO_CACHE was `error: unexpected FileExistsError` (or NotADirectoryError)."""
    import re

    from magrpo.cli import main

    cache = tmp_path / "not-a-folder"
    cache.write_text("")
    monkeypatch.setenv("MAGRPO_CACHE", str(cache))
    code = main([*SMALL, f"logging.run_dir={tmp_path / 'run'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert re.fullmatch(rf"config error: MAGRPO_CACHE: cannot write the tiny model to {cache}/tiny/\w+ "
                        rf"\((FileExistsError|NotADirectoryError): [^)]+\); make {cache}/tiny writable, delete "
                        rf"{cache}/tiny/\w+, or point MAGRPO_CACHE at a writable folder", lines[-1]), lines
    assert not (tmp_path / "run").exists()
