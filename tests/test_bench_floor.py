"""bench/bench_floor.py keeps working: on a one-step toy run it records the decode calls and updates
and times their floor (the numbers themselves are the benchmark's business, not a test's)."""
from __future__ import annotations

from tests.conftest import load_bench


def test_the_floor_benchmark_measures_every_phase_of_a_step():
    bench = load_bench("bench_floor")
    result = bench.measure(["trainer.batch_size=1", "trainer.num_generations=2", "trainer.num_turns=2",
                            "generation.max_new_tokens=4"], steps=1)
    assert list(result) == ["generate", "score", "feedback", "update", "step"]
    assert result["generate"]["floor"] > 0 and result["update"]["floor"] > 0
    assert result["generate"]["bare"] > 0 and result["step"]["bare"] > 0
    assert result["score"]["floor"] is None and result["score"]["bare"] is None
    assert all(r["step"] >= 0 for r in result.values())
    text = bench.table(result)
    assert text.splitlines()[2].startswith("| generate |") and "| score |" in text
