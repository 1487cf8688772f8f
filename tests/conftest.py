"""Shared fixtures: a composed, shrunk config for end-to-end tests on the tiny model (CPU, seconds)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `tests.feedback_probe` and train.py's packages import from the root
    sys.path.insert(0, str(ROOT))

import magrpo.envs  # noqa: E402,F401  (fills the env registry)
import magrpo.external  # noqa: E402,F401  (fills the feedback registry)
from magrpo.cli import compose  # noqa: E402
from tests.openai_server import server  # noqa: E402,F401  (fixture: an OpenAI-compatible HTTP server)

SMALL = [
    "env=length_ratio",  # the fast toy env and tiny model, not the SmolLM2 code-env default
    "model=tiny",
    "external=length_ratio",
    "logging.progress=false",
    "trainer.steps=2",
    "trainer.batch_size=2",
    "trainer.num_generations=2",
    "generation.max_new_tokens=6",
    "eval.max_problems=2",
    "eval.num_samples=2",
    "logging.wandb.mode=disabled",  # tests that check wandb turn it on
]


@pytest.fixture
def make_cfg(tmp_path):
    """make_cfg("trainer.joint_mode=cross", ...) -> TrainConfig writing into tmp_path/run."""

    def make(*overrides: str):
        return compose([*SMALL, f"logging.run_dir={tmp_path / 'run'}", *overrides])

    return make


@pytest.fixture(scope="module")
def truncate_env():
    """The code env whose train split is HumanEval/2 (`truncate_number`, 3 test cases), shipped copy."""
    from magrpo.envs.code.env import CodeEnv

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")  # the shipped copy, never the hub
    yield CodeEnv(CodeEnv.Config(train_split="test[2:3]", eval_split="test[3:4]"))
    mp.undo()
