"""It learns: on the length-ratio toy env, the tiny model's mean reward over the last steps beats the
first steps, for 3 seeds. Two agents, two turns, align. A broken gradient sign, mask or credit
assignment leaves the reward flat (about 0.5) and fails this test. The runs are pinned to portable
kernels (the `pinned_train` fixture), and the threshold has a margin: across CPU vendors the pinned
numbers differ in their last bits (magrpo.pinned)."""
from __future__ import annotations

import json

import numpy as np
import pytest

STEPS = 25
WINDOW = 5


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_reward_improves(pinned_train, seed):
    run = pinned_train(
        f"trainer.steps={STEPS}", "trainer.batch_size=4", "trainer.num_generations=4", "trainer.num_turns=2",
        "trainer.lr=3e-2", "trainer.micro_batch_size=160", "generation.max_new_tokens=8",
        f"trainer.seed={seed}", "logging.rollouts=false",
    )
    rewards = [json.loads(line)["train/reward_mean"] for line in open(run / "metrics.jsonl")]
    first, last = np.mean(rewards[:WINDOW]), np.mean(rewards[-WINDOW:])
    print(f"seed {seed}: first {first:.3f} last {last:.3f}")
    assert last > first + 0.05, f"no learning: first {WINDOW} steps {first:.3f}, last {WINDOW} steps {last:.3f}"
