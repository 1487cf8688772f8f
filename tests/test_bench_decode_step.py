"""bench/bench_decode_step.py keeps working: its `steps` probe times the three decode-step kinds and
compares their tokens (torch.compile replaced by the eager function here: compiling takes tens of
seconds, and what it costs is the benchmark's business, not a test's)."""
from __future__ import annotations

import torch

from tests.conftest import load_bench


def test_the_decode_step_probe_times_every_kind(capsys, monkeypatch):
    bench = load_bench("bench_decode_step")
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    assert bench.main(["steps", "--rows", "2", "--steps", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 rows (compiling took" in out and "same tokens: yes" in out
    for kind in ("dynamic cache", "static cache", "static cache, compiled"):
        assert f"  {kind} " in out


def test_the_lora_prefill_probe_times_both_kinds_and_compares_their_logits(capsys):
    bench = load_bench("bench_decode_step")
    assert bench.main(["lora-prefill", "--model", "tiny", "--prompts", "2", "--length", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "reused buffers" in out and "fresh tensors" in out and "same logits: yes" in out


def test_the_split_prefill_probe_times_both_kinds_and_compares_their_tokens(capsys):
    bench = load_bench("bench_decode_step")
    assert bench.main(["split-prefill", "--model", "tiny", "--prompts", "4", "--length", "120",
                       "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "split into groups" in out and "one prefill" in out and "same tokens: yes" in out


def test_the_products_probe_times_packed_and_plain_products_in_layer_order_and_repeated(capsys):
    bench = load_bench("bench_decode_step")
    assert bench.main(["products", "--model", "tiny", "--rows", "1", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "MB of weights; reading them (a sum over each):" in out
    for rows in (1, 3):
        line = next(line for line in out.splitlines() if line.startswith(f"    {rows} rows: "))
        assert "packed: in layer order" in line and "plain: in layer order" in line and "repeated" in line


def test_the_small_ops_probe_times_a_norm_alone_and_after_the_caches_are_evicted(capsys):
    bench = load_bench("bench_decode_step")
    assert bench.main(["small-ops", "--rows", "2", "--repeats", "1"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("    2 rows: "))
    assert "alone" in line and "after a 24 MB read" in line
