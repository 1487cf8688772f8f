"""env=reasoning_gym (issue 48): any procedural task of the reasoning-gym library by name
(`env.task`, its config in `env.task_config`), scored by the task's own verifier (`score_answer`) on
the answer the library's `extract_answer` reads: the last `<answer>...</answer>` of a reply.

Roles: with one agent it is plain GRPO on the task. With N >= 2, agents 0..N-2 are solvers and agent
N-1 is the checker, whose answer is the team's (the reward). Agents of one turn write side by side,
so the checker sees the solvers' work from the second turn on, through feedback (`reasoning_gym`
mode, envs/reasoning/feedback.py): it has to check that work, since the verifier's verdicts on the
solvers' answers are never shown to it. Each solver's own score is its per-agent reward
(Scored.agent_rewards), paid with reward.team_weight < 1.

Splits: the train problems come from `env.train_seed`, the held-out ones from `env.eval_seed`, and a
held-out problem whose question is also a train question, or an earlier held-out one, is skipped: the
splits never share one, and the held-out split asks each question once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from magrpo.env import ENVS, Environment, Scored
from magrpo.errors import ConfigError
from magrpo.metrics import Counter

from . import tasks

HELDOUT_DRAWS = 4  # held-out entries drawn per one wanted: room for those a train question rules out


def roles(num_agents: int) -> list[str]:
    return ["solver"] * (num_agents - 1) + ["checker"] if num_agents > 1 else ["solver"]


def role_intro(agent: int, num_agents: int) -> str:
    """What agent `agent` is told of its role in its first prompt ("" alone)."""
    if num_agents == 1:
        return ""
    if agent < num_agents - 1:
        return (f"You are agent {agent} of {num_agents}, a solver: work the problem out step by step. Agent "
                f"{num_agents - 1}, the checker, reads your work and gives the team's final answer.")
    return (f"You are agent {agent} of {num_agents}, the checker: your answer is the team's answer. After each "
            f"turn you see the solvers' work; check it step by step and correct it. This turn, solve the "
            f"problem yourself.")


@ENVS.register("reasoning_gym")
class ReasoningGymEnv(Environment):
    @dataclass
    class Config:
        task: str = "basic_arithmetic"
        """reasoning-gym task (dataset) name, e.g. basic_arithmetic, chain_sum, countdown; composite: several,
        listed in env.task_config.datasets."""
        task_config: dict = field(default_factory=dict)
        """The task's own config keys (its config dataclass in reasoning-gym), e.g. max_terms=3; seed and size are
        the env's. New keys need Hydra's +: +env.task_config.max_terms=3."""
        num_agents: int = 2
        """1: plain GRPO; N >= 2: agents 0..N-2 solve, agent N-1 checks their work and gives the team's answer."""
        train_size: int = 256
        """Problems in the train split."""
        eval_size: int = 32
        """Problems in the held-out split: distinct questions, none of them a train question."""
        train_seed: int = 0
        """Seed of the train split."""
        eval_seed: int = 1_000_000
        """Seed of the held-out split; must differ from train_seed."""
        prompt_style: str = "default"
        """Which of reasoning-gym's answer-format instructions opens every first prompt: default, simple, direct,
        chain_of_draft, DeepSeekZero (the library's SYSTEM_PROMPTS)."""
        answer_reading: str = "tags"
        """How an answer is read from a reply: tags (the library's: the last <answer>...</answer>; none = no answer) |
        tag_or_last_number (the tag, else the reply's last number: for numeric tasks and models that write no tags,
        e.g. SmolLM2-135M, docs/results/reasoning_sizing.md)."""

    default_feedback = "reasoning_gym"
    split_keys = {"train": "env.train_size", "eval": "env.eval_size"}
    context_keys = frozenset({"answers", "scores", "roles"})

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        from magrpo.config import at_least, choice

        at_least("env.num_agents", cfg.num_agents, 1)
        at_least("env.train_size", cfg.train_size, 1)
        at_least("env.eval_size", cfg.eval_size, 0)
        if cfg.eval_seed == cfg.train_seed:
            raise ConfigError("env.eval_seed", f"must differ from env.train_seed ({cfg.train_seed}): the held-out "
                                               "split needs problems of its own")
        self.rg = tasks.library()
        choice("env.prompt_style", cfg.prompt_style, sorted(self.rg.utils.SYSTEM_PROMPTS))
        choice("env.answer_reading", cfg.answer_reading, list(tasks.ANSWER_READINGS))
        self.read = tasks.reader(self.rg, cfg.answer_reading)
        self.kwargs = tasks.task_kwargs(self.rg, cfg.task, cfg.task_config)
        # The train split's dataset also scores every answer: the verifier is the task's, whatever the seed.
        self.dataset = tasks.make_dataset(self.rg, cfg.task, self.kwargs, cfg.train_seed, cfg.train_size)
        self.roles = roles(cfg.num_agents)
        self.verifier_errors = 0
        self._problems: dict[str, list[dict[str, Any]]] = {}
        self._tool_views: dict[str, Mapping[str, Any]] = {}

    @property
    def num_agents(self) -> int:
        return self.cfg.num_agents

    def problems(self, split: str) -> list[dict[str, Any]]:
        if split not in self._problems:
            self._problems[split] = [self._problem(split, i, e) for i, e in enumerate(self._entries(split))]
        return self._problems[split]

    def _entries(self, split: str) -> list[dict[str, Any]]:
        if split == "train":
            return tasks.draw(self.dataset, self.cfg.task, self.cfg.train_size, set())
        if not self.cfg.eval_size:
            return []
        drawn = HELDOUT_DRAWS * self.cfg.eval_size
        heldout = tasks.make_dataset(self.rg, self.cfg.task, self.kwargs, self.cfg.eval_seed, drawn)
        train = {p["prompt"] for p in self.problems("train")}
        # distinct: a question drawn twice would count twice in an accuracy whose error assumes n problems
        entries = tasks.draw(heldout, self.cfg.task, self.cfg.eval_size, train, distinct=True)
        if len(entries) < self.cfg.eval_size:
            raise ConfigError("env.eval_size", f"task {self.cfg.task!r} gave {len(entries)} held-out problems that are "
                                               f"not train problems ({drawn} drawn); lower env.eval_size or "
                                               f"env.train_size, or widen the task (env.task_config)")
        return entries

    @staticmethod
    def _problem(split: str, i: int, entry: Mapping[str, Any]) -> dict[str, Any]:
        """A problem: the question as `prompt`, the library's answer and metadata as they are (feedback
        functions get them as context; the agents and tools never see them)."""
        return {"id": f"{split}-{i}", "prompt": entry["question"], "answer": entry["answer"],
                "metadata": entry["metadata"]}

    def agent_prompts(self, problem: Mapping[str, Any]) -> list[str]:
        style = self.rg.utils.SYSTEM_PROMPTS[self.cfg.prompt_style].strip()
        out = []
        for agent in range(self.num_agents):
            parts = [style, role_intro(agent, self.num_agents), f"Question: {problem['prompt']}"]
            out.append("\n\n".join(p for p in parts if p))
        return out

    def score(self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]) -> list[Scored]:
        """The team's reward is the last agent's score (the checker's; alone, the solver's). Context:
        per agent the answer read (env.answer_reading; None: none found) and its score, and the roles."""
        out = []
        for problem, texts in zip(problems, joint_completions):
            answers = [self.read(text) for text in texts]
            scores = [self.verify(answer, problem) for answer in answers]
            team = scores[-1]
            outcomes = {"reward": team, "passed": float(team >= 1.0)}
            if self.num_agents > 1:
                outcomes["solver_score"] = sum(scores[:-1]) / (self.num_agents - 1)
            context = {"answers": answers, "scores": scores, "roles": self.roles}
            out.append(Scored(team, outcomes, context, agent_rewards=scores if self.num_agents > 1 else None))
        return out

    def verify(self, answer: str | None, problem: Mapping[str, Any]) -> float:
        """The task's score_answer on one extracted answer; a verifier that raises on it scores 0 (counted)."""
        entry = {"question": problem["prompt"], "answer": problem["answer"], "metadata": problem["metadata"]}
        try:
            return float(self.dataset.score_answer(answer, entry))
        except Exception:  # noqa: BLE001  (the verifier on a model's text: a raise is a wrong answer)
            self.verifier_errors += 1
            return 0.0

    def tool_context(self, problem: Mapping[str, Any]) -> Mapping[str, Any]:
        """Tools see the question, never the answer or the metadata (which may hold a solution)."""
        if problem["id"] not in self._tool_views:
            self._tool_views[problem["id"]] = {"id": problem["id"], "prompt": problem["prompt"]}
        return self._tool_views[problem["id"]]

    def metrics(self) -> dict[str, float]:
        return {"env/verifier_errors": Counter(self.verifier_errors)}

    def state(self) -> dict[str, Any]:
        return {"verifier_errors": self.verifier_errors}
