"""model.cpu_memory=keep (opt-in): large CPU tensors come from memory the process freed before, not
from fresh pages (magrpo/host_memory.py). Checked by where a tensor's memory lies, not by time. Each case
runs in its own process, since the setting is process-wide."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from magrpo.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent

# Where a 256 MB tensor's memory lies, and whether the heap still holds it once the tensor is freed: from the
# heap (between the program's data and the break, sbrk(0)) and kept, or from a mapping of its own (glibc's
# default for blocks this large; unmapped on free, so the next such tensor gets fresh pages that fault).
# Addresses, not page faults: glibc's aligned allocations leave freed blocks that the next request of the same
# size does not fit for a few rounds, so faults settle at zero only after a varying number of them.
PLACE = """
import ctypes, sys, torch
sys.path.insert(0, {root!r})
if {keep}:
    from magrpo import host_memory
    assert host_memory.keep()
libc = ctypes.CDLL("libc.so.6")
libc.sbrk.restype = ctypes.c_void_p
start = libc.sbrk(0)
t = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)
end = t.data_ptr() + t.nbytes
on_heap = end <= libc.sbrk(0)
del t
print(on_heap, libc.sbrk(0) >= end)
"""


def placement(keep: bool) -> tuple[bool, bool]:
    """(the tensor came from the heap, the heap still held its memory after it was freed)"""
    out = subprocess.run([sys.executable, "-c", PLACE.format(root=str(ROOT), keep=keep)], capture_output=True,
                         text=True, timeout=120, check=True)
    on_heap, kept = out.stdout.split()[-2:]
    return on_heap == "True", kept == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_large_tensors_come_from_the_heap_and_stay_there_once_freed():
    assert placement(keep=False) == (False, False)  # glibc's defaults: a mapping of its own, unmapped on free
    assert placement(keep=True) == (True, True)


def test_glibc_s_own_settings_are_the_default():
    # keep once was the default: a 432-row greedy evaluation of SmolLM2-135M then grew past 24 GB (OOM-killed)
    assert TrainConfig().model.cpu_memory == "system"


def test_loading_on_a_cpu_applies_the_setting_and_system_leaves_malloc_alone(make_cfg, monkeypatch):
    from magrpo import host_memory, models

    calls = []
    monkeypatch.setattr(host_memory, "keep", lambda: calls.append(1) or True)
    models.load_agents(make_cfg("model.device=cpu"), 1)
    assert calls == []
    models.load_agents(make_cfg("model.device=cpu", "model.cpu_memory=keep"), 1)
    assert calls == [1]


def test_a_bad_value_is_one_line_naming_the_allowed_values(run_cli):
    from tests.conftest import SMALL

    code, lines = run_cli(*SMALL, "model.cpu_memory=forever")
    assert code == 2 and lines == ["config error: model.cpu_memory: 'forever' is not allowed; choose one of: keep, "
                                   "system"]


def test_a_run_resumes_with_the_other_setting(make_cfg):
    # a run killed for memory under keep must be able to go on under system: the setting never changes a number
    import copy
    from dataclasses import asdict

    from magrpo.checkpoint import check_config

    current = asdict(make_cfg())
    stored = copy.deepcopy(current)
    stored["model"]["cpu_memory"] = "keep"
    check_config("ckpt", stored, current)  # no ConfigError
