"""bench/bench_vs_comlrl.py's magrpo side keeps composing and training as the benchmark describes
(the toy env, the tiny model): it broke silently once the default run became the code env with
SmolLM2. CoMLRL itself is not needed here."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "bench_vs_comlrl.py"


def test_the_magrpo_side_of_the_comparison_runs_on_the_toy_env():
    spec = importlib.util.spec_from_file_location("bench_vs_comlrl", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.run_magrpo("align", prompts=2, batch_size=2, turns=2, seed=0, quiet=True)
    assert out["prompts"] == 2 and len(out["step_s"]) == 1
    assert out["nodes"] == 2 * (1 + bench.K)  # align, T=2: a root and K children per prompt
