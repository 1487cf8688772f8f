"""The CoMLRL side of experiments/parity.py: runs in CoMLRL's own venv (scripts/setup_comlrl.sh), which
parity.py starts as a subprocess:

    ~/.cache/magrpo/comlrl-venv/bin/python experiments/parity_comlrl.py SPEC.json OUT.json

SPEC (written by parity.py): task, mode, tree, seed, the train problems' indices in the order magrpo
draws them for that seed, and more MAGRPOConfig fields (learning rate ...). CoMLRL trains on exactly
those problems, in that order, one epoch (its data loader walks the dataset one prompt at a time,
unshuffled). OUT: one record per prompt: the rewards of each turn, the seconds the prompt took (its
tree, and the updates its buffered samples triggered), optimizer steps per agent, and the tokens
CoMLRL generated and trained on. Nothing in CoMLRL is changed: its trainer's methods are wrapped on
the instance to time and count, and run unchanged.
"""
from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "bench"):  # this checkout's magrpo (envs, tiny model) and bench/comlrl_pair.py
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from comlrl_pair import TASKS, Tree, comlrl_trainer  # noqa: E402


def turn_order(joint: int, turns: int, turn: int = 0) -> list[int]:
    """The turn of each reward call of one tree, in CoMLRL's order: a node scores its `joint` joint
    actions, then builds its children depth first (pre-order). Needs every node expanded (no early
    termination)."""
    if turn == turns - 1:
        return [turn] * joint
    return [turn] * joint + [t for _ in range(joint) for t in turn_order(joint, turns, turn + 1)]


def per_turn(rewards: list[float], order: list[int], turns: int) -> list[list[float]]:
    """One tree's rewards (in call order) grouped by turn."""
    if len(rewards) != len(order):
        raise SystemExit(f"parity_comlrl: a tree made {len(rewards)} reward calls, expected {len(order)} "
                         "(early termination on, or CoMLRL expands trees differently from 1.4.3)")
    return [[r for r, t in zip(rewards, order) if t == turn] for turn in range(turns)]


class Probe:
    """Wraps one trainer instance's methods to record, per prompt, rewards, seconds, optimizer steps
    and tokens. The wrapped methods run unchanged."""

    def __init__(self, trainer, tree: Tree, mode: str):
        self.tree, self.order = tree, turn_order(tree.joint_actions(mode), tree.turns)
        self.rewards: list[float] = []
        self.sample: list[str] = []
        self.counts = self._zero()
        self.records: list[dict] = []
        trainer._generate_completions = self._timed(trainer._generate_completions, "gen_s", self._count_tokens)
        trainer._update_from_samples = self._timed(trainer._update_from_samples, "update_s")
        trainer._train_step_returns = self._per_prompt(trainer._train_step_returns)
        for agent, optimizer in enumerate(trainer.optimizers):
            optimizer.step = self._counted(optimizer.step, agent)

    def _zero(self) -> dict:
        return {"gen_s": 0.0, "update_s": 0.0, "optimizer_steps": [0] * self.tree.num_agents,
                "response_tokens": 0, "trained_tokens": 0}

    def _timed(self, fn, key: str, after=None):
        def wrapped(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            self.counts[key] += time.perf_counter() - start
            if after is not None:
                after(out)
            return out
        return wrapped

    def _count_tokens(self, out: dict) -> None:
        # response_lens: tokens up to the first pad (what the decoded text holds). trained_tokens: the
        # rows' width, whose positions CoMLRL's loss reads, pads included, all but each row's last
        # (comlrl 1.4.3 magrpo.py 1251, 1662, 1673).
        self.counts["response_tokens"] += sum(out["response_lens"])
        self.counts["trained_tokens"] += sum(len(t) for t in out["completion_input_ids"][0])

    def _counted(self, fn, agent: int):
        def wrapped(*a, **kw):
            self.counts["optimizer_steps"][agent] += 1
            return fn(*a, **kw)
        return wrapped

    def _per_prompt(self, fn):
        def wrapped(batch_item, **kw):
            start = time.perf_counter()
            fn(batch_item, **kw)
            self.finish(batch_item["id"], time.perf_counter() - start)
        return wrapped

    def reward(self, _problem: dict, texts: list[str], reward: float) -> None:
        if not self.rewards:  # the tree's first joint action: a sample of what the agents write
            self.sample = texts
        self.rewards.append(reward)

    def finish(self, problem_id: str, seconds: float) -> None:
        self.records.append({"step": len(self.records) + 1, "problem": problem_id, "seconds": seconds,
                             "turn_rewards": per_turn(self.rewards, self.order, self.tree.turns),
                             "sample": self.sample, **self.counts})
        self.rewards, self.counts = [], self._zero()


def seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(spec: dict) -> dict:
    import transformers

    task, tree, mode = TASKS[spec["task"]], Tree(**spec["tree"]), spec["mode"]
    train = task.environment(train_size=len(spec["problems"])).problems("train")  # magrpo's env.train_size
    problems = [train[i] for i in spec["problems"]]
    probe: Probe | None = None
    transformers.utils.logging.disable_progress_bar()  # a "Loading weights" bar per model otherwise
    seed_all(spec["seed"])
    start = time.perf_counter()
    trainer = comlrl_trainer(task, tree, mode, problems, on_reward=lambda *a: probe.reward(*a), **spec["config"])
    load_s = time.perf_counter() - start
    trainer.verbose = False  # no tqdm bar (comlrl reads verbosity from a wandb config, which is not passed)
    probe = Probe(trainer, tree, mode)
    seed_all(spec["seed"])
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    # What the last prompts left in the rollout buffers trains after the epoch: counted apart.
    drain = {k: v for k, v in probe.counts.items() if k in ("update_s", "optimizer_steps")}
    versions = {name: version(name) for name in ("comlrl", "torch", "transformers")}
    return {"library": "comlrl", "task": spec["task"], "mode": mode, "seed": spec["seed"], "tree": asdict(tree),
            "config": spec["config"], "load_s": load_s, "train_s": train_s, "steps": probe.records,
            "after_last_prompt": drain, "versions": versions}


def main(argv: list[str]) -> int:
    spec_path, out_path = map(Path, argv)
    result = run(json.loads(spec_path.read_text()))
    out_path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
