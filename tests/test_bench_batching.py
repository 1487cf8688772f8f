"""bench/bench_batching.py keeps working: each batch size of a model and mode in turn, a table of seconds
per prompt with its parts, and the factor from the smallest batch to the largest."""
from __future__ import annotations

import pytest

from tests.conftest import load_bench


def test_the_script_prints_per_prompt_times_and_the_factor_for_the_tiny_model(capsys):
    load_bench("bench_batching").main(["--models", "tiny", "--modes", "align", "--prompts", "2",
                                       "--batches", "1", "2", "--no-warmup"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny ") and "->" in line]
    assert [row[2] for row in rows[:2]] == ["1", "2"]  # model, mode, batch, each round's figure -> median, ...
    assert "batch 1 -> 2: per-prompt time falls" in out


def test_a_batch_that_does_not_divide_the_prompts_is_refused():
    with pytest.raises(SystemExit):
        load_bench("bench_batching").main(["--prompts", "3", "--batches", "1", "2"])
