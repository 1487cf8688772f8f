"""Each producer marks its numbers with their kind (magrpo.metrics), so torchrun sums what each
process counted and averages what they share: checked on the built-in env and expert."""
from __future__ import annotations

from magrpo.config import ExternalConfig
from magrpo.envs.code.env import CodeEnv
from magrpo.feedback import Branch, Feedback
from magrpo.metrics import Counter, Gauge


def test_the_code_env_counts_sandbox_runs_and_shares_dataset_facts(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = CodeEnv(CodeEnv.Config(train_split="test[:1]", eval_split="test[1:2]"))
    problem = env.problems("train")[0]
    env.score([problem], [["def aux(x):\n    return x\n", problem["prompt"] + problem["canonical_solution"]]])
    m = env.metrics()
    assert type(m["env/sandbox_runs"]) is Counter and m["env/sandbox_runs"] >= 1
    assert type(m["env/sandbox_timeouts"]) is Counter
    for shared in ("env/skipped_problems", "env/unsupported_cases", "perf/sandbox_runs_per_s"):
        assert type(m[shared]) is Gauge, shared


def test_the_expert_counts_calls_and_averages_latency(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = CodeEnv(CodeEnv.Config(train_split="test[:1]", eval_split="test[1:2]"))
    problem = env.problems("train")[0]
    completions = ["def aux(x):\n    return x\n", f"def {problem['entry_point']}(*a):\n    return None\n"]
    scored = env.score([problem], [completions])[0]
    fb = Feedback(ExternalConfig(mode="expert_edits"), env)
    fb([Branch(problem["prompt"], completions, [[p] for p in env.agent_prompts(problem)],
               [[c] for c in completions], dict(scored.context))])
    m = fb.metrics()
    for counted in ("expert/calls", "expert/cache_hits", "expert/failures", "expert/retries", "expert/fallbacks",
                    "expert/breaker_open", "expert/late"):
        assert type(m[counted]) is Counter, counted
    assert m["expert/calls"] == 1
    assert type(m["expert/latency_s"]) is Gauge and type(m["expert/reference"]) is Gauge
