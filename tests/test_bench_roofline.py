"""bench/bench_roofline.py keeps working and counts what its docstring says: bytes and FLOPs of a decode
step and an update pass, checked by hand on a made-up shape, and the script's table on the tiny model."""
from __future__ import annotations

import pytest

from tests.conftest import load_bench


def test_the_costs_are_the_documented_sums():
    bench = load_bench("bench_roofline")
    shape = {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8}
    counts = {"linear": 1000, "head": 200, "lora_per_agent": 10, "weight_bytes": 4000}
    moved, flops = bench.decode_cost(shape, counts, rows=3, context=5, dtype_bytes=4)
    assert moved == 4000 + 3 * (2 * 2 * 2 * 8 * 5 * 4)  # weights once + each row's keys and values
    assert flops == 3 * (2 * 1010 + 4 * 2 * 4 * 8 * 5)
    moved, flops = bench.update_cost(shape, counts, rows=3, prompt=6, tokens=2)
    attention = 12 * 2 * 4 * 8
    assert moved == 8000
    assert flops == pytest.approx(6 * (4 * 810 + attention * 3) + 3 * 2 * (4 * 1010 + attention * 7))


def test_the_script_prints_its_table_for_the_tiny_model(capsys):
    load_bench("bench_roofline").main(["--rows", "4", "--prompt", "16", "--tokens", "4", "--steps", "2", "4",
                                       "--attention", "sdpa", "magrpo_sdpa"])
    out = capsys.readouterr().out
    assert "copy bandwidth" in out and "matmul" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("decode, ", "update pass"))]
    assert [row[1] for row in rows] == ["sdpa", "magrpo_sdpa", "pass"]  # each implementation in turn, then the update
    assert all(row[-1].endswith("%") for row in rows)
