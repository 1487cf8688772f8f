"""bench/bench_logp_mismatch.py keeps working, and on a float32 model its figure is the float noise the docs
quote (docs/backends.md, "Train/inference mismatch"): below 1e-4 nats per token without top-p."""
from __future__ import annotations

import re

from tests.conftest import load_bench


def test_the_mismatch_bench_on_float32_is_float_noise_and_prints_each_variant(capsys):
    bench = load_bench("bench_logp_mismatch")
    assert bench.main(["--model", "tiny", "--dtype", "float32", "--prompts", "2", "--tokens", "8",
                       "--top-p", "1.0", "0.9", "--float32-head"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  top-p ")]
    assert len(lines) == 4 and sum("float32 head" in line for line in lines) == 2
    means = {line.split(":")[0]: float(re.search(r"mean ([0-9.e-]+)", line).group(1)) for line in lines}
    assert all(mean < 1e-4 for label, mean in means.items() if label.startswith("  top-p 1.0")), means
