"""Environment contract and registry. Environments live in `envs/` and register by name."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

from .errors import (
    BEFORE_RUN,
    RESUMABLE,
    ConfigError,
    EnvError,
    TimedOut,
    describe,
    qualified_name,
    timed_out,
    user_code,
    within,
)
from .registry import ENV_HINT, Registry


@dataclass(frozen=True)
class CompletionInfo:
    """What the env and feedback see of one agent's completion besides its text (score's
    `completion_info`, feedback's context["completion_info"])."""

    truncated: bool  # cut at generation.max_new_tokens (no EOS, no stop string of generation.stop)
    tool_calls: list = field(default_factory=list)  # the turn's calls, in order: {"name", "arguments", "output",
    # "error" (None, or a kind such as "timeout"), "seconds"} (docs/tools.md)


@dataclass
class Scored:
    """What the env says about one joint action."""

    reward: float
    outcomes: dict[str, float]  # named numbers for evaluation ("reward" among them; "passed" turns on pass@k)
    context: dict[str, Any] = field(default_factory=dict)  # handed to feedback functions as **context
    agent_rewards: list[float] | None = (
        None  # one reward per agent (reward stays the team's); mixed by reward.team_weight
    )
    done: bool | None = None  # True: the episode ends here, the branch is a leaf (None, False: it goes on)


class Environment:
    """A cooperative task for `num_agents` agents.

    Subclasses define a nested dataclass `Config` (its fields are the `env.*` keys) and register with
    `@ENVS.register("name")`. Problems are plain dicts with at least a "prompt" key (the problem
    statement handed to feedback functions as `prompt`).
    """

    Config: ClassVar[type]
    default_feedback: ClassVar[str | None] = None  # the mode external.mode=auto (the default) picks; None: plain
    context_keys: ClassVar[frozenset[str]] = frozenset()  # keys score() puts in every feedback context
    split_keys: ClassVar[dict[str, str]] = {}  # "train"/"eval" -> the env.* key that picks it (named in errors)
    # Said once at start-up and kept in the run's config.json under "warnings" (e.g. an unsafe sandbox).
    warnings: tuple[str, ...] = ()

    def __init__(self, cfg: Any):
        self.cfg = cfg

    @property
    def num_agents(self) -> int:
        raise NotImplementedError

    def problems(self, split: str) -> Sequence[Mapping[str, Any]]:
        """The problems of a split ("train" or "eval")."""
        raise NotImplementedError

    def agent_prompts(self, problem: Mapping[str, Any]) -> list[str]:
        """Turn-0 prompt of every agent."""
        raise NotImplementedError

    def rewards(self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]) -> list[float]:
        """One scalar per joint action; called once per tree level with every joint action of it."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Counters the env keeps (cumulative), logged with every step under their own names.
        With torchrun, rank 0 logs one value per key, merged by its kind (magrpo.metrics): mark each
        number Counter (summed), Gauge (averaged; unmarked numbers too) or Maximum."""
        return {}

    def state(self) -> dict[str, Any]:
        """What a checkpoint must keep for metrics() to continue exactly after a resume."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def outcomes(
        self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]
    ) -> list[dict[str, float]]:
        """Evaluation: named numbers per joint action, "reward" among them. A "passed" key (0/1)
        turns on pass@k. Default: the reward alone."""
        return [{"reward": r} for r in self.rewards(problems, joint_completions)]

    def score(self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]) -> list[Scored]:
        """Reward, outcomes and feedback context per joint action, in one pass (the trainer calls
        only this). Override it when feedback needs what scoring found (test results, errors), so
        feedback never re-runs the work, or to end episodes (Scored.done). An override that takes a
        `completion_info` keyword also gets, per joint action, one CompletionInfo per agent (was it
        truncated). Default: outcomes() with an empty context."""
        return [Scored(o["reward"], o) for o in self.outcomes(problems, joint_completions)]

    def tool_context(self, problem: Mapping[str, Any]) -> Mapping[str, Any]:
        """What tools called inside a turn on `problem` see of it (`ToolContext.problem`, docs/tools.md).
        Override it to hand tools less (nothing the agents must not read, e.g. hidden tests) or more
        (per-problem settings); called for every node, so return a cached object. Default: the problem."""
        return problem


ENVS: Registry[type[Environment]] = Registry("env")


def check_problem_prompts(env: Environment, problems: Sequence[Any], split: str) -> None:
    """Every problem is a mapping with a "prompt" (feedback's `prompt`): an EnvError naming the env's
    problems() and the first problem without one, at start-up rather than mid-run."""
    for i, problem in enumerate(problems):
        if not isinstance(problem, Mapping) or "prompt" not in problem:
            keys = ", ".join(map(str, problem)) if isinstance(problem, Mapping) else type(problem).__name__
            raise EnvError(f"{qualified_name(type(env))}.problems({split!r}) returned problem {i} without a 'prompt' "
                           f"key (it has: {keys or 'nothing'}); every problem needs its statement under 'prompt'")


def check_prompt_sizes(env: Environment, problems: Sequence[Any], split: str, max_chars: int,
                       timeout_s: float = 0) -> None:
    """Every turn-0 prompt the env writes has at most max_chars characters (limits.max_prompt_chars; 0: no
    limit): a small record can still make a huge prompt. A ConfigError naming the env's agent_prompts."""
    for i, problem in enumerate(problems if max_chars else []):
        prompts = call_env(env, "agent_prompts", problem, where=f"at start-up ({split} problem {i})",
                           timeout_s=timeout_s, tail=BEFORE_RUN)
        sizes = [len(p) if isinstance(p, str) else 0 for p in prompts]
        if max(sizes, default=0) > max_chars:
            agent = sizes.index(max(sizes))
            raise ConfigError("limits.max_prompt_chars",
                              f"{qualified_name(type(env))}.agent_prompts wrote {max(sizes):,} characters for agent "
                              f"{agent} on {split} problem {i}, more than {max_chars:,}; shorten the problem, or "
                              f"raise the limit (0 = none)")


def call_env(env: Environment, method: str, *args: Any, where: str, timeout_s: float = 0,
             tail: str = RESUMABLE) -> Any:
    """env.method(*args), given at most timeout_s seconds (limits.user_code_timeout_s; 0: no limit): a raise
    becomes an EnvError naming the method and `where` (the turn), a timeout a TimedOut ending with `tail`.
    ConfigError passes: bad input found while loading data is reported as such."""
    name = f"{qualified_name(type(env))}.{method}"
    with user_code(lambda e: EnvError(f"{name} raised {where}: {describe(e)}"), keep=(TimedOut,)):
        return within(timeout_s, lambda: timed_out(name, f" {where}", timeout_s, tail), getattr(env, method), *args)


def make_env(env_cfg: Mapping[str, Any], timeout_s: float = 0) -> Environment:
    """Build the env named by `env_cfg["name"]`, checking the other keys against its Config; its __init__ is
    given at most timeout_s seconds (limits.user_code_timeout_s; 0: no limit)."""
    values = dict(env_cfg)
    name = values.pop("name", None)
    if name not in ENVS:
        raise ConfigError("env.name", f"{name!r} is not allowed; choose one of: {', '.join(ENVS.names())}; {ENV_HINT}")
    cls = ENVS.get(name)
    own = [f.name for f in dataclasses.fields(cls.Config)]
    stray = [k for k in values if k not in own and any(k in _keys(ENVS.get(n)) for n in ENVS.names())]
    if stray:  # env.name changed inside a config file: the previous env's keys are still there
        raise ConfigError(
            f"env.{stray[0]}",
            f"a key of another env, not of env {name!r} (allowed: {', '.join(own)}); "
            f"select the env with env={name} (or env.name={name} on the command line): it replaces the whole env node",
        )
    config = _build(cls.Config, values, "env", f"env {name!r}")
    name = f"{qualified_name(cls)}.__init__"
    with user_code(lambda e: EnvError(f"{name} raised at start-up: {describe(e)}"), keep=(TimedOut,)):
        return within(timeout_s, lambda: timed_out(name, " at start-up", timeout_s, BEFORE_RUN), cls, config)


def _keys(cls: type[Environment]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls.Config)}


def _build(schema: type, values: Mapping[str, Any], prefix: str, owner: str) -> Any:
    """A dataclass instance from plain values; nested dataclass fields come from nested mappings."""
    hints = typing.get_type_hints(schema)  # resolves `from __future__` string annotations
    names = [f.name for f in dataclasses.fields(schema)]
    out = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{prefix}.{key}", f"unknown key for {owner}; allowed: {', '.join(names)}")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{prefix}.{key}",
                    f"expected a mapping with keys {', '.join(f.name for f in dataclasses.fields(kind))}",
                )
            out[key] = _build(kind, value, f"{prefix}.{key}", owner)
        else:
            out[key] = _coerce(f"{prefix}.{key}", value, kind)
    return schema(**out)


def _coerce(key: str, value: Any, kind: Any) -> Any:
    if not isinstance(kind, type) or isinstance(value, kind):
        return value  # unions/optionals are not checked here
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(key, f"expected {kind.__name__}, got {value!r}")
