"""trainer.update_every=turn (issue 47, parity with CoMLRL's per-turn steps): each agent takes one
optimizer step per turn of the batch's trees, on that turn's nodes only; a turn no tree reached takes
no step; the logged numbers combine the turn steps as documented."""
from __future__ import annotations

import json

import pytest
import torch

from magrpo.trainer import mean_of_steps
from tests.test_resume import cli

RUN = ["trainer.steps=2", "eval.every=0", "checkpoint.every=1", "trainer.batch_size=2"]


def adam_steps(run_dir, step: int) -> set[int]:
    """The AdamW step count of every parameter of every agent at checkpoint `step`."""
    counts = set()
    for part in sorted((run_dir / "checkpoints" / f"step_{step:06d}").glob("agent_*/train.pt")):
        state = torch.load(part, weights_only=False)["optimizer"]["state"]
        counts |= {int(s["step"]) for s in state.values()}
    return counts


@pytest.mark.parametrize("every, threshold, steps", [
    ("batch", "null", {1: {1}, 2: {2}}),  # one step per batch
    ("turn", "null", {1: {2}, 2: {4}}),  # T=2: two per batch
    ("turn", "-1.0", {1: {1}, 2: {2}}),  # every joint action stops early: no turn-2 node, no turn-2 step
])
def test_optimizer_steps_per_batch(tmp_path, capsys, every, threshold, steps):
    code, err = cli(capsys, tmp_path / "run", *RUN, f"trainer.update_every={every}",
                    f"trainer.early_termination_threshold={threshold}")
    assert code == 0, err
    assert {s: adam_steps(tmp_path / "run", s) for s in (1, 2)} == steps
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["train/agent_0/trained_seqs"] > 0 for m in metrics)


def test_turn_steps_train_the_same_sequences_as_one_batch_step(tmp_path, capsys):
    """The same trees (step 1 samples before any update), split into turns: the same rows train."""
    seqs = {}
    for every in ("batch", "turn"):
        code, err = cli(capsys, tmp_path / every, *RUN, "trainer.steps=1", f"trainer.update_every={every}")
        assert code == 0, err
        seqs[every] = json.loads((tmp_path / every / "metrics.jsonl").read_text().splitlines()[0])
    for agent in (0, 1):
        key = f"train/agent_{agent}/trained_seqs"
        assert seqs["turn"][key] == seqs["batch"][key]


def test_mean_of_steps_combines_as_documented():
    steps = [{"loss": 1.0, "grad_norm": 2.0, "lr": 0.1, "trained_seqs": 4.0, "skipped_updates": 0.0, "kl": 0.2},
             {"loss": 3.0, "grad_norm": 5.0, "lr": 0.2, "trained_seqs": 6.0, "skipped_updates": 1.0}]
    assert mean_of_steps(steps) == {"loss": 2.0, "grad_norm": 5.0, "lr": 0.1, "trained_seqs": 10.0,
                                    "skipped_updates": 1.0, "kl": 0.2}


def test_a_bad_value_is_one_line(tmp_path, capsys):
    code, err = cli(capsys, tmp_path / "run", "trainer.update_every=node")
    assert code == 2 and err == ["config error: trainer.update_every: 'node' is not allowed; choose one of: batch, "
                                 "turn"]
