"""External feedback between turns: registry, user-function resolution, and the call contract.

A feedback function is called once per expanding branch as
    fn(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent, **context)
and returns one next-turn prompt per agent. Histories cover that branch only, up to and including
the current turn. `context` holds the problem's fields (dataset columns), what the env found when it
scored this joint action (for the code env: entry point, tests, execution results; it wins over a
column of the same name), `options` (the external.* switches) and `completion_info` (per agent: was the
completion truncated), so a mode never re-runs the env's work (feedback_context). A function that does
not take `**context` gets only the keys it names.

The trainer hands all expanding branches of a turn to `Feedback` at once: per-branch functions are
mapped over them in a thread pool (external.max_concurrency), and a `FeedbackMode` subclass (for
modes with state or I/O, like expert_edits) receives the whole list.
"""
from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .env import CompletionInfo, call_env
from .errors import (
    BEFORE_RUN,
    RESUMABLE,
    ConfigError,
    FeedbackError,
    TimedOut,
    describe,
    qualified_name,
    timed_out,
    user_code,
    valid_text,
    within,
)
from .plugins import import_module
from .registry import FEEDBACK_HINT, Registry

FeedbackFn = Callable[..., Sequence[str]]


@dataclass
class Branch:
    """One joint action that expands into a next-turn node."""

    prompt: str  # the problem statement
    agent_completions: list[str]  # this turn's chosen completion per agent
    prompt_history: list[list[str]]  # per agent: prompts up to and including this turn
    response_history: list[list[str]]  # per agent: completions up to and including this turn
    context: dict[str, Any] = field(default_factory=dict)  # the env's, from Scored.context
    problem: Mapping[str, Any] = field(default_factory=dict)  # the problem's fields (dataset columns)
    completion_info: list[CompletionInfo] = field(default_factory=list)  # per agent: this turn's completion


# The call's own arguments: a problem field or context key of one of these names is not passed again.
CALL_ORDER = ("prompt", "agent_completions", "num_agents", "prompt_history_per_agent", "response_history_per_agent")
CALL_ARGUMENTS = frozenset(CALL_ORDER)


def feedback_context(branch: Branch, options: Mapping[str, Any]) -> dict[str, Any]:
    """What feedback receives as **context, by precedence: the env's context over magrpo's `options`
    (the external.* switches) and `completion_info` (per agent, as a dict: context stays plain data
    that a function can log as JSON), those over the problem's fields; a name of the call's own
    arguments is left out (`prompt` is the argument already)."""
    merged = {**branch.problem, "options": options, "completion_info": [asdict(i) for i in branch.completion_info],
              **branch.context}
    return {k: v for k, v in merged.items() if k not in CALL_ARGUMENTS}


class FeedbackMode:
    """A feedback mode that needs configuration, start-up checks or batching across branches.
    Register the class itself; it is built once per run as cls(external_cfg, env)."""

    def __init__(self, external_cfg: Any, env: Any):
        self.cfg = external_cfg
        self.env = env

    def check(self) -> None:
        """Start-up checks (endpoints, keys), before any model loads: raise ConfigError."""

    def batch(self, branches: list[Branch]) -> list[list[str]]:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Numbers since the last call (reset on read), logged with the step.
        With torchrun, rank 0 logs one value per key, merged by its kind (magrpo.metrics): mark each
        number Counter (summed), Gauge (averaged; unmarked numbers too) or Maximum."""
        return {}


FeedbackTarget = FeedbackFn | type[FeedbackMode]  # what a mode name resolves to
FEEDBACK: Registry[FeedbackTarget] = Registry("feedback mode")


AUTO = "auto"  # external.mode's default: the env's own choice


def mode_for(mode: str, env: Any) -> str:
    """external.mode=auto: the mode the env names in `default_feedback`, else plain."""
    return (getattr(env, "default_feedback", None) or "plain") if mode == AUTO else mode


def resolve_feedback(mode: str) -> FeedbackTarget:
    """A registered name, or `package.module:name` for a user's own function (a module attribute, or
    a name the module registers with `@FEEDBACK.register` when imported)."""
    if ":" not in mode:
        if mode not in FEEDBACK:
            raise ConfigError(
                "external.mode",
                f"{mode!r} is not allowed; choose one of: {', '.join(FEEDBACK.names())}; {FEEDBACK_HINT}",
            )
        return FEEDBACK.get(mode)
    module_name, _, attr = mode.partition(":")
    module = import_module("external.mode", module_name)
    fn = getattr(module, attr, None)
    if fn is None and attr in FEEDBACK:
        fn = FEEDBACK.get(attr)
    if not callable(fn):
        raise ConfigError("external.mode", f"module {module_name!r} has no function {attr!r}")
    return fn


def accepted(fn: Callable) -> Callable[[dict], dict]:
    """Which context keys `fn` takes: all when it has **kwargs, else the ones it names."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return lambda context: context
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return lambda context: context
    names = {p.name for p in params}
    return lambda context: {k: v for k, v in context.items() if k in names}


def call_feedback(fn: FeedbackFn, name: str, branch: Branch, select: Callable[[dict], dict] | None = None,
                  timeout_s: float = 0) -> list[str]:
    """fn on one branch, given at most timeout_s seconds (limits.user_code_timeout_s; 0: no limit)."""
    num_agents = len(branch.agent_completions)
    select = select or accepted(fn)
    when = f"at turn {turn_of([branch])}"
    with user_code(lambda e: raised(name, fn, when, e), keep=(TimedOut,)):
        # Copies: the tree keeps these lists, and a function that edits its arguments must not corrupt it.
        prompts = within(
            timeout_s, lambda: late(name, fn, when, timeout_s), fn,
            prompt=branch.prompt,
            agent_completions=list(branch.agent_completions),
            num_agents=num_agents,
            prompt_history_per_agent=[list(h) for h in branch.prompt_history],
            response_history_per_agent=[list(h) for h in branch.response_history],
            **select(dict(branch.context)),
        )
    return check_prompts(prompts, num_agents, name, fn)


def turn_of(branches: list[Branch]) -> int | str:
    """The turn being expanded: the histories hold one prompt per turn up to and including it."""
    return len(branches[0].prompt_history[0]) - 1 if branches and branches[0].prompt_history else "?"


def raised(name: str, fn: Any, when: str, error: Exception) -> FeedbackError:
    """The one-line error for a feedback function or mode that raised: its name, when, the error."""
    return FeedbackError(f"feedback function {name!r} ({qualified_name(fn)}) raised {when}: {describe(error)}")


def late(name: str, fn: Any, when: str, timeout_s: float) -> TimedOut:
    """The one-line error for a feedback function or mode that ran past limits.user_code_timeout_s."""
    tail = BEFORE_RUN if when == "at start-up" else RESUMABLE
    return timed_out(f"feedback function {name!r} ({qualified_name(fn)})", f" {when}", timeout_s, tail)


def call_mode(name: str, fn: Callable[..., Any], when: str, timeout_s: float, *args: Any) -> Any:
    """fn(*args), a mode's method (or its class), as the trainer calls user code: a raise or a timeout
    is one line naming it and `when`."""
    with user_code(lambda e: raised(name, fn, when, e), keep=(FeedbackError, TimedOut)):
        return within(timeout_s, lambda: late(name, fn, when, timeout_s), fn, *args)


def check_prompts(prompts: Any, num_agents: int, name: str, fn: Any = None) -> list[str]:
    """The prompts as valid text (an expert's reply or a program's error in them may hold lone
    surrogates, which no tokenizer takes); a FeedbackError when they are not one string per agent."""
    wrong = _wrong_prompts(prompts, num_agents)
    if wrong:
        where = f" ({qualified_name(fn)})" if fn is not None else ""
        raise FeedbackError(f"feedback function {name!r}{where} must return a list of {num_agents} prompt strings "
                            f"(one per agent), got {wrong}")
    return [valid_text(p) for p in prompts]


def _wrong_prompts(prompts: Any, num_agents: int) -> str | None:
    """What is wrong with a feedback function's return value, in words (None: nothing)."""
    if not isinstance(prompts, (list, tuple)):
        return f"{type(prompts).__name__} {_short(prompts)}"
    if len(prompts) != num_agents:
        return f"a {type(prompts).__name__} of length {len(prompts)}"
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        return (f"a {type(prompts).__name__} whose item {bad[0]} is {type(prompts[bad[0]]).__name__} "
                f"{_short(prompts[bad[0]])}" + (f" ({len(bad)} items are not strings)" if len(bad) > 1 else ""))
    return None


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else text[:37] + "..."


def options_of(external_cfg: Any) -> dict[str, Any]:
    """The external.* switches every mode may read from context["options"]."""
    # "history" stays a bool (earlier attempts listed, as before it had modes); "history_mode" is the setting
    return {"original_prompt": external_cfg.original_prompt, "history": external_cfg.history == "attempts",
            "history_mode": external_cfg.history,
            "show_partner": external_cfg.show_partner}


class Feedback:
    """The configured mode, applied to every expanding branch of a turn in one call."""

    def __init__(self, external_cfg: Any, env: Any, target: FeedbackTarget | None = None, max_prompt_chars: int = 0,
                 timeout_s: float = 0):
        """`target` overrides external_cfg.mode with a function or mode class (tests, notebooks);
        `max_prompt_chars`: limits.max_prompt_chars, `timeout_s`: limits.user_code_timeout_s (0: no limit)."""
        self.max_prompt_chars, self.timeout_s = max_prompt_chars, timeout_s
        self.name = mode_for(external_cfg.mode, env) if target is None else getattr(target, "__name__", "custom")
        self.max_concurrency = external_cfg.max_concurrency
        self.options = options_of(external_cfg)
        target = target or resolve_feedback(self.name)
        is_mode = isinstance(target, type) and issubclass(target, FeedbackMode)
        self.mode = call_mode(self.name, target, "at start-up", timeout_s, external_cfg, env) if is_mode else None
        self.fn = None if self.mode is not None else target
        self._select = accepted(self.fn) if self.fn is not None else None
        self.env = env

    def check(self) -> None:
        """Start-up: the env provides the context the mode reads; the mode's own checks."""
        needed = getattr(self.mode if self.mode is not None else self.fn, "requires_context", frozenset())
        missing = sorted(set(needed) - set(getattr(self.env, "context_keys", ())))
        if missing:
            raise ConfigError(
                "external.mode",
                f"{self.name!r} reads feedback context that env "
                f"{type(self.env).__name__} does not provide ({', '.join(missing)}); use it with env=code "
                f"or pick a generic mode such as plain",
            )
        if self.mode is not None:
            call_mode(self.name, self.mode.check, "at start-up", self.timeout_s)
        else:
            self.check_signature()

    def check_signature(self) -> None:
        """A function that cannot take the call stops here, not at the first turn after the model loaded:
        each of the call's own arguments by keyword, and every required parameter given by the call or a
        context key the env declares (its context_keys; unchecked when it declares none) or a problem field."""
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):  # a builtin or C callable: nothing to read
            return
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        declared = set(getattr(self.env, "context_keys", ()))
        problems = call_env(self.env, "problems", "train", where="at start-up", timeout_s=self.timeout_s,
                            tail=BEFORE_RUN)  # loaded (and cached) by prepare already
        given = {*CALL_ARGUMENTS, "options", "completion_info", *declared, *(problems[0] if problems else ())}
        wrong = next((f"it does not take the argument {a!r}" for a in sorted(CALL_ARGUMENTS)
                      if a not in params and not takes_all), None)
        for p in params.values():
            if wrong:
                break
            if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty:
                wrong = f"its parameter {p.name!r} is positional-only (every argument is passed by keyword)"
            elif p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) \
                    and p.default is inspect.Parameter.empty and p.name not in given and declared:
                wrong = (f"it needs {p.name!r}, which neither the call nor the context gives (env "
                         f"{type(self.env).__name__}'s context: {', '.join(sorted(declared))}); give it a default")
        if wrong:
            raise ConfigError("external.mode", f"feedback function {self.name!r} ({qualified_name(self.fn)}) cannot "
                                               f"be called as fn({', '.join(CALL_ORDER)}, **context): {wrong}")

    def __call__(self, branches: list[Branch]) -> list[list[str]]:
        for branch in branches:
            branch.context = feedback_context(branch, self.options)
        if self.mode is not None:
            out = call_mode(self.name, self.mode.batch, f"at turn {turn_of(branches)}", self.timeout_s, branches)
            if len(out) != len(branches):
                raise FeedbackError(
                    f"feedback mode {self.name!r} returned {len(out)} prompt lists for {len(branches)} branches"
                )
            prompts = [check_prompts(p, len(b.agent_completions), self.name, self.mode.batch)
                       for p, b in zip(out, branches)]
            return [self.sized(p, self.mode.batch) for p in prompts]
        if self.max_concurrency <= 1 or len(branches) <= 1:
            prompts = [call_feedback(self.fn, self.name, b, self._select, self.timeout_s) for b in branches]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(branches))) as pool:
                prompts = list(pool.map(lambda b: call_feedback(self.fn, self.name, b, self._select, self.timeout_s),
                                        branches))
        return [self.sized(p, self.fn) for p in prompts]

    def sized(self, prompts: list[str], fn: Any) -> list[str]:
        """prompts, when none is longer than limits.max_prompt_chars; else a FeedbackError naming fn."""
        long = [(a, len(p)) for a, p in enumerate(prompts) if self.max_prompt_chars and len(p) > self.max_prompt_chars]
        if long:
            agent, size = long[0]
            raise FeedbackError(f"feedback function {self.name!r} ({qualified_name(fn)}) returned a prompt of "
                                f"{size:,} characters for agent {agent}, more than limits.max_prompt_chars="
                                f"{self.max_prompt_chars:,}; return shorter prompts, or raise the limit (0 = none)")
        return prompts

    def metrics(self) -> dict[str, float]:
        if self.mode is None:
            return {}
        return call_mode(self.name, self.mode.metrics, "reading its metrics", self.timeout_s)
