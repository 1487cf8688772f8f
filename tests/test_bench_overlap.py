"""bench/bench_overlap.py keeps working: its latency plugin waits and still gives the toy task's
reward and feedback, and a one-step run per chunk count prints a row each with the rollouts
byte-identical to one chunk's (the timings are the benchmark's business, not a test's)."""
from __future__ import annotations

import time

from tests.conftest import load_bench


def test_the_latency_plugin_waits_and_keeps_the_toy_task():
    task = load_bench("latency_task")
    from magrpo.envs.length_ratio import LengthRatioEnv, length_ratio_feedback

    env = task.SlowLengthRatioEnv(task.SlowLengthRatioEnv.Config(score_ms=30, feedback_ms=7))
    problem = env.problems("train")[0]
    joint = [["a" * 10, "b" * 20], ["a" * 10, "b" * 5]]
    start = time.perf_counter()
    scored = env.score([problem, problem], joint)
    assert time.perf_counter() - start >= 0.06  # 30 ms per joint action
    plain = LengthRatioEnv(LengthRatioEnv.Config()).rewards([problem, problem], joint)
    assert [s.reward for s in scored] == plain == [1.0, 0.25]
    assert all(s.context == {"feedback_ms": 7} for s in scored)

    history = [[p] for p in env.agent_prompts(problem)]
    args = (problem["prompt"], joint[1], 2, history, [[c] for c in joint[1]])
    start = time.perf_counter()
    assert task.slow_length_ratio_feedback(*args, feedback_ms=50) == length_ratio_feedback(*args)
    assert time.perf_counter() - start >= 0.05


def test_the_overlap_benchmark_compares_chunk_counts(capsys):
    bench = load_bench("bench_overlap")
    assert bench.main(["--chunks", "2", "--steps", "1", "--batch-size", "2", "--k", "2", "--max-new-tokens", "4",
                       "--score-ms", "1", "--feedback-ms", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"]  # one chunk, the baseline, is always run
    assert all(row[-1] == "yes" for row in rows)  # overlap changes no rollout
    assert all(float(x) >= 0 for row in rows for x in row[1:-1])
