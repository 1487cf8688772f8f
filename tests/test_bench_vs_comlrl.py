"""bench/bench_vs_comlrl.py's magrpo side keeps composing and training as the benchmark describes
(each task: its env, feedback and tiny model): it broke silently once the default run became the
code env with SmolLM2. CoMLRL itself is not needed here."""
from __future__ import annotations

import pytest

from tests.conftest import load_bench


@pytest.mark.parametrize("task", ["length_ratio", "keyword_relay"])
def test_the_magrpo_side_of_the_comparison_runs_on_each_task(task):
    bench = load_bench("bench_vs_comlrl")
    out = bench.run_magrpo(bench.TASKS[task], "align", prompts=2, batch_size=2, turns=2, seed=0, quiet=True)
    assert out["prompts"] == 2 and len(out["step_s"]) == 1
    assert out["nodes"] == 2 * (1 + bench.K)  # align, T=2: a root and K children per prompt


def test_the_keyword_relay_task_scores_and_feeds_back_what_its_docstring_says():
    bench = load_bench("bench_vs_comlrl")
    task = bench.TASKS["keyword_relay"]
    env = task.environment()
    problem = env.problems("train")[0]
    want = problem["prompt"].split()
    assert len(set(want)) == 3 and env.agent_prompts(problem)[0].endswith(f"{problem['prompt']}.")
    first = f"x = {want[0]} {want[1]} other"  # 2 of 3 targets; its words: x, want0, want1, other
    assert env.rewards([problem], [[first, f"{want[0]} and x"]]) == [0.5 * 2 / 3 + 0.5 * 2 / 4]
    assert env.rewards([problem], [["", "anything"]]) == [0.0]
    history = [[p] for p in env.agent_prompts(problem)]
    prompts = task.feedback_fn()(problem["prompt"], [first, f"{want[0]} and x"], 2, history, [[], []])
    assert f"Missing words: {want[2]}." in prompts[0] and prompts[0].startswith(history[0][0])
    assert f"Words you did not reuse: {want[1]} other." in prompts[1] and task.marker in prompts[1]
