"""The code-collaboration environment: agents 0..N-2 each write one helper (`aux`, `aux2`, ...),
agent N-1 the entry point that may call them (one agent: the entry point alone). Programs run in the
sandbox, never in-process."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from magrpo.distributed import is_main_process
from magrpo.env import ENVS, Environment, Scored
from magrpo.errors import valid_text
from magrpo.metrics import Counter, Gauge

from . import cgroups, isolation
from .examples import visible_examples
from .isolation import MODES, SandboxUnavailable
from .judge import unsupported_reason
from .problems import DatasetError, extract_tests, load_problems, parse_signature, prompt_context, wrap_case
from .reward import USAGES, Analysis, RewardWeights, analyze, helper_names, score, strip_fences, syntax_error
from .sandbox import Program, RunResult, SandboxLimits, run_many
from .tools import tool_limits  # also registers the tools run_python and run_tests

HELPER_PROMPT = """You are agent {agent} of {num_agents} solving a Python problem together.

Problem:
{prompt}
Write a helper function named `{helper}` that does a useful part of the work for `{name}({params})`.
{others} Output only the code of `def {helper}(...)`,
with a return statement and no docstring."""

MAIN_PROMPT = """You are agent {agent} of {num_agents} solving a Python problem together.

Problem:
{prompt}
{helpers} Implement
{signature}
Output only the code of `def {name}(...)`, with a return statement and no docstring."""

SINGLE_PROMPT = """Solve this Python problem.

Problem:
{prompt}
Implement
{signature}
Output only the code of `def {name}(...)`, with a return statement and no docstring."""


@ENVS.register("code")
class CodeEnv(Environment):
    @dataclass
    class Config:
        dataset: str = "humaneval"
        """humaneval | coophumaneval | mbpp | easy (generated; splits train, heldout, train_reach) | path/to/file.jsonl
        (records: task_id, prompt, test, entry_point)."""
        train_split: str = "test[:132]"
        """Hugging Face split syntax for training problems."""
        eval_split: str = "test[132:]"
        """Hugging Face split syntax for evaluation problems."""
        num_agents: int = 2
        """N >= 2: agents 0..N-2 write helpers `aux`, `aux2`, ..., agent N-1 the entry point;
        1: the entry point alone."""
        timeout_s: float = 5.0
        """Wall-clock limit for one program with all its test cases."""
        workers: int = 0
        """Sandbox processes in parallel; 0 = one per CPU core."""
        sandbox: str = "bwrap"
        """bwrap: every program in its own bubblewrap sandbox (package `bubblewrap`; the run stops at
        start-up, saying why, if none can start) | unsafe: plain child processes with rlimits only, for
        machines without bubblewrap: a program can then read the tests, forge its reward and leave
        processes behind (warned in the console, config.json and metric env/sandbox_unsafe)."""
        tool_timeout_s: float = 2.0
        """Wall-clock limit of one call of the tools run_python and run_tests (tools=[run_tests]; docs/tools.md)."""
        reward: RewardWeights = field(default_factory=RewardWeights)
        """Level weights, shift and scale (envs/code/reward.py)."""

    default_feedback = "plain"
    split_keys = {"train": "env.train_split", "eval": "env.eval_split"}
    context_keys = frozenset({
        "task_id", "entry_point", "params", "signature", "tests", "canonical_solution", "roles", "functions", "code",
        "aux_defined", "helper_defined", "main_defined", "syntax_ok", "syntax_errors", "ran", "passed", "total",
        "timed_out", "first_failure", "aux_usage", "helper_usage", "is_wrapper", "program", "reward", "reward_parts",
    })

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        from magrpo.config import ConfigError, above, at_least, choice

        at_least("env.num_agents", cfg.num_agents, 1,
                 "1: the entry point alone; N >= 2: N-1 helper writers + the entry point")
        above("env.timeout_s", cfg.timeout_s, 0)  # 0 or less: every program, correct ones too, times out
        above("env.tool_timeout_s", cfg.tool_timeout_s, 0)
        at_least("env.workers", cfg.workers, 0)
        choice("env.sandbox", cfg.sandbox, list(MODES))
        try:
            isolation.check(cfg.sandbox)
        except SandboxUnavailable as e:
            raise ConfigError("env.sandbox", str(e)) from None
        self.limits = SandboxLimits(timeout_s=cfg.timeout_s, mode=cfg.sandbox)
        # Said by the trainer at start-up and kept in config.json: what confines programs less than it should
        limits, all_hold = cgroups.describe(self.limits.memory_mb, self.limits.max_processes)
        self.warnings = (*((isolation.UNSAFE_WARNING,) if cfg.sandbox == "unsafe" else ()),
                         *(() if all_hold else (limits,)))
        self.weights = cfg.reward
        self.sandbox_runs = 0
        self.timeouts = 0
        self.sandbox_s = 0.0
        self.skipped = 0
        self.unsupported = 0  # test cases the judge cannot run through proxies (they fail closed)
        self._splits: dict[str, list[dict]] = {}
        self._parsed: dict[str, tuple] = {}  # task_id -> (Signature, TestSuite, prompt context)
        self._tool_contexts: dict[str, Mapping[str, Any]] = {}

    @property
    def num_agents(self) -> int:
        return self.cfg.num_agents

    def problems(self, split: str) -> list[dict[str, Any]]:
        if split not in self._splits:
            self._splits[split] = self._prepare(self._load(split), split)
        return self._splits[split]

    def _load(self, split: str) -> list[dict]:
        """The split's records; bad input as a ConfigError naming env.dataset or the split key."""
        from magrpo.config import ConfigError

        spec = self.cfg.train_split if split == "train" else self.cfg.eval_split
        try:
            return load_problems(self.cfg.dataset, spec)
        except DatasetError as e:
            raise ConfigError("env.dataset", str(e)) from None
        except ValueError as e:  # the split spec
            raise ConfigError(self.split_keys[split], str(e)) from None

    def _prepare(self, records: list[dict], split: str) -> list[dict]:
        """Parse every problem once; a problem whose signature or tests cannot be parsed is skipped
        (never sent to a model as an error string)."""
        out = []
        for record in records:
            try:
                signature = parse_signature(record["prompt"], record["entry_point"])
                suite = extract_tests(record["test"], record["entry_point"], prompt=record["prompt"])
            except ValueError:
                continue
            self._parsed[record["task_id"]] = (
                signature,
                suite,
                prompt_context(record["prompt"], record["entry_point"]),
            )
            self.unsupported += sum(unsupported_reason(case, {"candidate", record["entry_point"]}) is not None
                                    for case in suite.cases)
            out.append(record)
        self.skipped += len(records) - len(out)
        if len(out) < len(records) and is_main_process():
            print(f"code env: skipped {len(records) - len(out)} of {len(records)} {split} problems whose "
                  f"signature or tests could not be parsed", file=sys.stderr)
        if self.unsupported and is_main_process():
            print(f"code env: {self.unsupported} test case(s) use the candidate other than by calling it; "
                  f"the judge fails them (env/unsupported_cases)", file=sys.stderr)
        return out

    def metrics(self) -> dict[str, float]:
        return {
            "env/sandbox_runs": Counter(self.sandbox_runs),
            "env/sandbox_timeouts": Counter(self.timeouts),
            "env/skipped_problems": Gauge(self.skipped),  # every process loads the same data
            "env/unsupported_cases": Gauge(self.unsupported),
            "perf/sandbox_runs_per_s": Gauge(self.sandbox_runs / self.sandbox_s if self.sandbox_s else 0.0),
            "env/sandbox_unsafe": Gauge(float(self.limits.mode == "unsafe")),  # every step: never lost in a log
        }

    def state(self) -> dict[str, Any]:
        return {"sandbox_runs": self.sandbox_runs, "timeouts": self.timeouts, "sandbox_s": self.sandbox_s}

    def agent_prompts(self, problem: Mapping[str, Any]) -> list[str]:
        sig = self._parsed[problem["task_id"]][0]
        values = dict(prompt=problem["prompt"].strip(), name=sig.name, params=", ".join(sig.params),
                      signature=sig.source, num_agents=self.num_agents)
        if self.num_agents == 1:
            return [SINGLE_PROMPT.format(**values)]
        helpers = helper_names(self.num_agents - 1)
        main = MAIN_PROMPT.format(**values, agent=len(helpers), helpers=_helpers_line(helpers))
        return [HELPER_PROMPT.format(**values, agent=k, helper=h, others=_others_line(helpers, h, sig.name))
                for k, h in enumerate(helpers)] + [main]

    def tool_context(self, problem: Mapping[str, Any]) -> Mapping[str, Any]:
        """What tools see of a problem: its statement, entry point, the statement's imports and helpers
        (`preamble`), its visible examples and the tools' sandbox limits; never its tests or solution."""
        task = problem["task_id"]
        if task not in self._tool_contexts:
            prompt, entry = problem["prompt"], problem["entry_point"]
            self._tool_contexts[task] = MappingProxyType({
                "task_id": task, "prompt": prompt, "entry_point": entry, "preamble": self._parsed[task][2],
                "examples": visible_examples(prompt, entry),
                "tool_limits": tool_limits(self.limits, self.cfg.tool_timeout_s)})
        return self._tool_contexts[task]

    def rewards(self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]) -> list[float]:
        return [s.reward for s in self.score(problems, joint_completions)]

    def outcomes(
        self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]
    ) -> list[dict[str, float]]:
        return [s.outcomes for s in self.score(problems, joint_completions)]

    def score(self, problems: Sequence[Mapping[str, Any]], joint_completions: Sequence[Sequence[str]]) -> list[Scored]:
        """Static levels with `ast`, then every program that parses runs in the sandbox, in parallel.
        Outcomes per joint action: reward, passed (all cases), syntax_ok, aux_used (fraction of the
        helpers the entry point calls), timeout, aux_defined (every helper; 0 with one agent),
        main_defined; the context carries the diagnostics feedback modes show (see `feedback_context`)."""
        analyses = []
        for problem, texts in zip(problems, joint_completions):
            context = self._parsed[problem["task_id"]][2]
            analyses.append(analyze(texts[:-1], texts[-1], problem["entry_point"], imports=context))
        to_run = [i for i, a in enumerate(analyses) if a.main_defined and a.parses]
        programs = [self._program(problems[i], analyses[i].program) for i in to_run]
        start = time.perf_counter()
        results = run_many(programs, self.limits, workers=self.cfg.workers or None)
        self.sandbox_s += time.perf_counter() - start
        self.sandbox_runs += len(results)
        self.timeouts += sum(r.timed_out for r in results)
        ran = dict(zip(to_run, results))
        out = []
        for i, a in enumerate(analyses):
            r = ran.get(i)
            passed, total = (r.passed, len(r.cases)) if r is not None else (0, 1)
            reward, parts = score(a, passed, total, self.weights)
            outcomes = {
                "reward": reward,
                "passed": float(r is not None and total > 0 and passed == total),
                "syntax_ok": float(a.parses),
                "aux_used": sum(h.used for h in a.helpers) / len(a.helpers) if a.helpers else 0.0,
                "timeout": float(r is not None and r.timed_out),
                # the first two reward levels, so eval reports the rate of every level
                "aux_defined": float(a.aux_defined) if a.helpers else 0.0,
                "main_defined": float(a.main_defined),
            }
            out.append(
                Scored(reward, outcomes, self.feedback_context(problems[i], joint_completions[i], a, r, reward, parts))
            )
        return out

    def feedback_context(self, problem: Mapping[str, Any], texts: Sequence[str], a: Analysis,
                         result: RunResult | None, reward: float, parts: dict[str, float]) -> dict[str, Any]:
        """What feedback modes may show about one joint action (documented in docs/feedback.md)."""
        sig, suite, _ = self._parsed[problem["task_id"]]
        first_failure = None
        if result is not None:
            for case, case_result in zip(suite.cases, result.cases):
                if not case_result.passed:  # the error is the program's text: `raise ValueError(chr(0xD800))`
                    first_failure = {"case": case, "error": valid_text(case_result.error or "failed")}
                    break
        helpers = helper_names(self.num_agents - 1)
        return {
            "task_id": problem["task_id"],
            "entry_point": problem["entry_point"],
            "params": list(sig.params),
            "signature": sig.source,
            "tests": list(suite.cases),
            "canonical_solution": problem.get("canonical_solution") or None,
            "roles": [*helpers, "main"],
            "functions": [*helpers, problem["entry_point"]],
            # each agent's code as the checks saw it: its function when found, else the fence-less text
            "code": [src if src is not None else strip_fences(text).strip()
                     for src, text in zip([*(h.source for h in a.helpers), a.main_source], texts)],
            "aux_defined": a.aux_defined,  # every helper
            "helper_defined": [h.defined for h in a.helpers],
            "main_defined": a.main_defined,
            "syntax_ok": a.parses,
            "syntax_errors": [syntax_error(text) for text in texts],
            "ran": result is not None,
            "passed": result.passed if result is not None else 0,
            "total": len(result.cases) if result is not None else len(suite.cases),
            "timed_out": bool(result is not None and result.timed_out),
            "first_failure": first_failure,
            "aux_usage": min((h.usage for h in a.helpers), key=USAGES.index, default="no_aux"),  # the worst one
            "helper_usage": [h.usage for h in a.helpers],
            "is_wrapper": a.is_wrapper,
            "program": a.program,
            "reward": reward,
            "reward_parts": dict(parts),
        }

    def _program(self, problem: Mapping[str, Any], program: str) -> Program:
        suite = self._parsed[problem["task_id"]][1]
        entry = problem["entry_point"]
        # The program already starts with the prompt's imports and helpers; the test preamble (the
        # prompt's code again, plus the test's own module level) runs in the judge only.
        return Program(code=f"{program}\n", preamble=suite.preamble,
                       cases=[wrap_case(case, entry) for case in suite.cases], entry_point=entry)


def _listing(names: Sequence[str]) -> str:
    """`a`, `b` and `c`."""
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _others_line(helpers: Sequence[str], own: str, entry: str) -> str:
    """What a helper writer is told about the other agents (the two-agent sentence when alone)."""
    others = [h for h in helpers if h != own]
    if not others:
        return f"Another agent writes `{entry}` and will call your `{own}`."
    return f"Other agents write {_listing([*others, entry])}; `{entry}` will call your `{own}`."


def _helpers_line(helpers: Sequence[str]) -> str:
    if len(helpers) == 1:
        return f"Another agent writes a helper function `{helpers[0]}` that you may call."
    return f"Other agents write the helper functions {_listing(helpers)}, which you may call."
