"""It learns to use a tool (issue 31, point 4): on the tool-arithmetic env, the warm-started tiny model
(magrpo.envs.tool_arith_warm: it calls the calculator about 1 time in 5 and guesses otherwise) trained
with GRPO and tools=[calculator] calls the tool more often and answers right more often in its last
steps than in its first. Nothing rewards a call as such: the rate rises because calls earn the
rewards. With lr ~0 the rate stays flat (~0.2) and this fails. About 15 s with the warm start cached
($MAGRPO_CACHE, like the CI venvs); a machine's first run builds it (about 1.5 CPU-minutes, pinned).
The run is pinned to portable kernels (the `pinned_train` fixture); across CPU vendors its numbers still
differ in their last bits (magrpo.pinned), so the thresholds keep a margin."""
from __future__ import annotations

import json

import numpy as np
import pytest

from magrpo.envs.tool_arith_warm import warm_model_path

STEPS = 8
WINDOW = 3


def learning_run(pinned_train, seed: int, *extra: str) -> tuple[list[float], list[float]]:
    """(tools/call_rate, train/reward_mean) per step, pinned to portable kernels."""
    run = pinned_train(
        "env=tool_arith", "external=plain", f"model.name={warm_model_path()}", "tools=[calculator]",
        "tools.max_calls=1", "generation.max_new_tokens=72", "trainer.num_turns=1", f"trainer.steps={STEPS}",
        "trainer.batch_size=2", "trainer.num_generations=8", "trainer.lr=2e-3", f"trainer.seed={seed}",
        "logging.rollouts=false", "eval.at_end=false", *extra,
    )
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return [r["tools/call_rate"] for r in rows], [r["train/reward_mean"] for r in rows]


@pytest.mark.slow
def test_the_tiny_model_learns_to_call_the_calculator(pinned_train):
    rates, rewards = learning_run(pinned_train, seed=0)
    first_rate, last_rate = np.mean(rates[:WINDOW]), np.mean(rates[-WINDOW:])
    first_reward, last_reward = np.mean(rewards[:WINDOW]), np.mean(rewards[-WINDOW:])
    print(f"call rate {first_rate:.2f} -> {last_rate:.2f}, reward {first_reward:.2f} -> {last_reward:.2f}")
    assert last_rate > first_rate + 0.2, f"call rate: first {WINDOW} steps {first_rate:.2f}, last {last_rate:.2f}"
    assert last_reward > first_reward + 0.1, f"reward: first {WINDOW} steps {first_reward:.2f}, last {last_reward:.2f}"
