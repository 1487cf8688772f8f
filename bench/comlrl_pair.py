"""What magrpo and the reference CoMLRL (comlrl==1.4.3) share when they run one task side by side: the
task (env, prompts, reward, between-turn feedback, tiny model), the tree and sampling settings,
magrpo's overrides for them, and CoMLRL's trainer for them, built as its docs build one (a model and
a tokenizer per agent, per-agent formatters, a reward function, an external transition).

Used by bench/bench_vs_comlrl.py (speed) and experiments/parity.py (learning curves). Neither library
is imported at module level, so CoMLRL's own venv (scripts/setup_comlrl.sh) loads this file too.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

COMLRL_MODE = {"align": "aligned", "cross": "cross"}  # magrpo's joint mode -> CoMLRL's spelling


@dataclass(frozen=True)
class Task:
    """An env, its between-turn feedback and a tiny model, the same for both libraries."""

    about: str
    env: str  # registered env name
    module: str  # where the env and its feedback function live
    feedback: str  # the feedback function's name in that module
    marker: str  # text every feedback prompt contains (to count comlrl's feedback prompts)
    hidden_size: int = 128  # the tiny model (magrpo.tiny.TinySpec)
    layers: int = 2
    overrides: tuple[str, ...] = ()  # magrpo overrides beyond the shared ones

    def spec(self):
        from magrpo.tiny import TinySpec
        return TinySpec(hidden_size=self.hidden_size, num_hidden_layers=self.layers)

    def environment(self, **config: Any):
        """The env with its Config's defaults, but for `config` (e.g. train_size)."""
        from magrpo.env import ENVS
        importlib.import_module(self.module)
        cls = ENVS.get(self.env)
        return cls(cls.Config(**config))

    def feedback_fn(self):
        return getattr(importlib.import_module(self.module), self.feedback)


TASKS = {
    "length_ratio": Task("length-ratio env, tiny model (hidden 128, 2 layers)", "length_ratio",
                         "magrpo.envs.length_ratio", "length_ratio_feedback", "Last turn lengths",
                         overrides=("env.num_agents=2",)),
    # A user's plugin env on another tiny model: deeper and narrower, so more per-token overhead.
    "keyword_relay": Task("keyword-relay plugin env (bench/keyword_task.py), tiny model (hidden 64, 4 layers)",
                          "keyword_relay", "keyword_task", "keyword_relay_feedback", "Try again.",
                          hidden_size=64, layers=4, overrides=("plugins=[keyword_task]",)),
}


@dataclass(frozen=True)
class Tree:
    """What both libraries sample at every prompt: N agents, K completions per agent and node, T turns
    (no early termination), tokens and sampling. top_k is off in both (CoMLRL passes top_k=0, which
    transformers' generate treats as no filter; its default 50 would add one magrpo does not apply)."""

    num_agents: int = 2
    k: int = 4
    turns: int = 2
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0

    def joint_actions(self, mode: str) -> int:
        """Joint actions (reward calls) per node: K aligned, K^N crossed."""
        return self.k if mode == "align" else self.k ** self.num_agents

    def nodes(self, mode: str) -> int:
        """Nodes per tree: 1 + J + J^2 + ... (T terms); each node is K samples from every agent."""
        return sum(self.joint_actions(mode) ** t for t in range(self.turns))


def magrpo_overrides(task: Task, tree: Tree, mode: str, prompts: int, batch_size: int, seed: int,
                     model: str | None = None) -> list[str]:
    """magrpo overrides for this task and tree: `prompts` problems in steps of `batch_size` trees. `model`: a
    configs/model group (e.g. smollm2-135m) instead of the task's tiny model (magrpo only: CoMLRL's side
    loads the tiny model)."""
    models = [f"model={model}"] if model else [
        "model=tiny", f"model.tiny_hidden_size={task.hidden_size}", f"model.tiny_layers={task.layers}"]
    return [
        f"env={task.env}",
        *models,
        *task.overrides,
        f"env.train_size={prompts}",
        f"external.mode={task.env}",
        f"trainer.num_generations={tree.k}",
        f"trainer.num_turns={tree.turns}",
        f"trainer.joint_mode={mode}",
        "trainer.early_termination_threshold=null",
        f"trainer.batch_size={batch_size}",
        f"trainer.steps={prompts // batch_size}",
        f"trainer.seed={seed}",
        f"generation.max_new_tokens={tree.max_new_tokens}",
        f"generation.temperature={tree.temperature}",
        f"generation.top_p={tree.top_p}",
        "generation.top_k=0",
    ]


def comlrl_trainer(task: Task, tree: Tree, mode: str, problems: list[dict],
                   on_reward: Callable[[dict, list[str], float], None] | None = None, **config: Any):
    """CoMLRL's MAGRPOTrainer on `problems` (trained in this order, one epoch unless `config` says
    otherwise), one model and tokenizer per agent from the task's tiny model folder. `config`: more
    MAGRPOConfig fields (e.g. agent_learning_rate). `on_reward(problem, texts, reward)` sees every
    scored joint action."""
    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from magrpo.tiny import tiny_model_path

    env = task.environment()
    path = str(tiny_model_path(task.spec()))

    def formatter(i: int):
        # comlrl passes external_prompts (the feedback text) on turns after the first; without this
        # parameter it would silently re-send the turn-0 prompt on every turn.
        def fmt(item, external_prompts=None):
            return external_prompts if external_prompts is not None else env.agent_prompts(item)[i]
        return fmt

    def reward(*agent_completions, batch_items=None):
        # comlrl calls this with one list of one completion per agent and batch_items=[problem].
        texts = [c[0] for c in agent_completions]
        r = env.rewards([batch_items[0]], [texts])[0]
        if on_reward is not None:
            on_reward(batch_items[0], texts, r)
        return [r]

    args = MAGRPOConfig(**{
        "num_train_epochs": 1,
        "num_agents": tree.num_agents,
        "num_generations": tree.k,
        "max_new_tokens": tree.max_new_tokens,
        "temperature": tree.temperature,
        "top_p": tree.top_p,
        "top_k": 0,
        "num_turns": tree.turns,
        "joint_mode": COMLRL_MODE[mode],
        "early_termination_threshold": None,  # its default -0.2 ends every tree after turn 1 here
        "eval_interval": 0,
        "agent_devices": "cpu",
        **config,
    })
    return MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(path) for _ in range(tree.num_agents)],
        num_agents=tree.num_agents,
        tokenizer=[AutoTokenizer.from_pretrained(path) for _ in range(tree.num_agents)],
        train_dataset=Dataset.from_list(problems),
        reward_func=reward,
        formatters=[formatter(i) for i in range(tree.num_agents)],
        external_transition=task.feedback_fn() if tree.turns > 1 else None,
        wandb_config=None,
        args=args,
    )
