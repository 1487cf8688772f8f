"""bench/bench_decode_step.py keeps working: its `steps` probe times the three decode-step kinds and
compares their tokens (torch.compile replaced by the eager function here: compiling takes tens of
seconds, and what it costs is the benchmark's business, not a test's)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_decode_step.py"


def test_the_decode_step_probe_times_every_kind(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_decode_step", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    assert bench.main(["steps", "--rows", "2", "--steps", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 rows (compiling took" in out and "same tokens: yes" in out
    for kind in ("dynamic cache", "static cache", "static cache, compiled"):
        assert f"  {kind} " in out
