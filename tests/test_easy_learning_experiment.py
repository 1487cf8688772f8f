"""experiments/easy_learning.py (issue 32's experiment) does not rot: every variant's settings compose
into a valid config on the easy dataset, and the report and its README headline read hand-made run
dirs right (seconds; no model)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.conftest import experiment_module


@pytest.fixture(scope="module")
def exp():
    yield from experiment_module("easy_learning")


def test_every_variant_composes_on_the_easy_splits_with_the_methods_budget(exp, tmp_path):
    from magrpo.cli import compose
    from magrpo.generation import StopStrings
    from magrpo.tree import tree_size

    sizes = exp.FULL
    for name in exp.VARIANT_NAMES:
        cfg = compose(exp.overrides(name, 1, sizes, tmp_path / name))
        v = exp.VARIANTS[name]
        assert (cfg.env["dataset"], cfg.env["train_split"], cfg.env["eval_split"]) == ("easy", "train", "heldout")
        assert (cfg.env["num_agents"], cfg.trainer.num_turns, cfg.trainer.seed) == (v.agents, v.turns, 1)
        assert StopStrings.of(cfg).of_agent(0) == ("\n```\n", "\n\ndef")  # the first code block or function
        per_step = tree_size("align", sizes.k, v.agents, v.turns)[1] * cfg.trainer.batch_size
        assert per_step >= tree_size("align", sizes.k, 2, 2)[1] * sizes.batch_size, name


def test_early_stop_is_the_method_plus_early_termination_and_is_not_run_by_default(exp, tmp_path):
    from magrpo.cli import compose

    method = exp.overrides(exp.METHOD, 0, exp.FULL, tmp_path)
    early = exp.overrides(exp.EARLY_STOP, 0, exp.FULL, tmp_path)
    assert sorted(early) == sorted(method + ["trainer.early_termination_threshold=2.1",
                                             "trainer.early_termination_return=repeat"])
    cfg = compose(early)
    assert (cfg.trainer.early_termination_threshold, cfg.trainer.early_termination_return) == (2.1, "repeat")
    assert exp.EARLY_STOP not in exp.GRID


def test_runs_are_seed_major_so_a_stopped_experiment_has_whole_seeds(exp):
    sizes = exp.Sizes("tiny", 1, 1, 2, 8, 1e-4, 2, 1, 0, seeds={"level_feedback": (0, 1), "one_turn": (0,)})
    assert sizes.runs == [("level_feedback", 0), ("one_turn", 0), ("level_feedback", 1)]


def write_run(out, variant: str, seed: int, turns: int, before: float, after: float) -> None:
    run = out / "runs" / variant / f"seed{seed}"
    run.mkdir(parents=True)
    key = f"eval/turn_{turns - 1}/pass@1_greedy"
    records = [{"step": 0, "perf/eval_s": 1.0, key: before},
               {"step": 1, "perf/step_s": 2.0, "train/turn_0/reward_mean": 0.5},
               {"step": 1, "perf/eval_s": 1.0, key: after}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    agents = 1 if variant == "single_agent" else 2
    (run / "experiment.json").write_text(json.dumps({
        "variant": variant, "seed": seed, "agents": agents, "turns": turns, "feedback": "level_feedback",
        "completions_per_step": 40, "sizes": {"steps": 1}, "overrides": ["model=tiny", f"trainer.seed={seed}",
                                                                          f"logging.run_dir='{run}'"],
        "date": "2026-11-25 12:00 UTC", "machine": "test machine", "seconds": 60.0}))


def test_report_headline_tables_and_exact_settings(exp, tmp_path):
    for seed, (before, after) in enumerate([(0.1, 0.3), (0.1, 0.25), (0.05, 0.3)]):
        write_run(tmp_path, "level_feedback", seed, 2, before, after)
    write_run(tmp_path, "single_agent", 0, 2, 0.1, 0.15)
    write_run(tmp_path, "one_turn", 0, 1, 0.1, 0.2)
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    headline = text.splitlines()[0]
    assert "0.083 ± 0.029 before -> 0.283 ± 0.029 after" in headline
    assert "change 0.200 ± 0.050, larger than its seed spread" in headline
    assert "the best baseline, one_turn, reaches 0.200 (1 seed(s))" in headline
    assert (tmp_path / "results.png").stat().st_size > 0
    assert "- one_turn: `model=tiny trainer.seed=0`" in text  # the run dir is left out of the settings
    assert "test machine" in text and "5 runs, 5 min" in text


def test_headline_says_when_the_rise_is_within_the_seed_spread(exp, tmp_path):
    for seed, (before, after) in enumerate([(0.1, 0.1), (0.1, 0.4), (0.1, 0.1)]):  # mean +0.1, sd 0.17
        write_run(tmp_path, "level_feedback", seed, 2, before, after)
    headline = exp.headline(exp.shared.load_runs(tmp_path))
    assert "not larger than its seed spread" in headline and "best baseline" not in headline
    for seed in range(3):  # the same run with its evaluation size recorded: the change in problems too
        record = tmp_path / "runs" / "level_feedback" / f"seed{seed}" / "experiment.json"
        record.write_text(json.dumps({**json.loads(record.read_text()), "sizes": {"eval_problems": 30}}))
    assert "not larger than its seed spread; +3.0 of 30 problems)" in exp.headline(exp.shared.load_runs(tmp_path))
    assert exp.headline({}) == "No finished run of the method (level_feedback) yet."


def test_a_kept_run_counts_whatever_its_micro_batch_but_not_with_other_settings(exp, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    kept = exp.overrides("level_feedback", 0, exp.FULL, run)
    (run / "experiment.json").write_text(json.dumps({"overrides": kept}))
    smaller = exp.overrides("level_feedback", 0, exp.replace(exp.FULL, micro_batch_size=8), run)
    assert "trainer.micro_batch_size=8" in smaller
    exp.check_same_overrides(run, smaller)  # the same update, in less memory
    with pytest.raises(SystemExit, match="trainer.lr"):
        exp.check_same_overrides(run, exp.overrides("level_feedback", 0, exp.replace(exp.FULL, lr=1e-3), run))


def test_the_selection_keeps_problems_sometimes_passed_and_trains_on_exactly_those_rows(exp, tmp_path):
    from magrpo.cli import compose
    from magrpo.envs.code.problems import load_problems

    assert exp.keep({"a": 0.0, "b": 0.5, "c": 1.0, "d": 0.25}) == ["b", "d"]  # a group on a or c has no pass spread
    chosen = ["Easy/train/9", "Easy/train/5", "Easy/train/3", "Easy/train/4"]
    spec = exp.split_of(chosen)
    assert spec == "train[3:6]+train[9:10]"  # dataset order, neighbours merged
    assert [r["task_id"] for r in load_problems("easy", spec)] == sorted(chosen, key=lambda t: int(t.split("/")[-1]))
    cfg = compose(exp.overrides("level_feedback", 0, exp.FULL, tmp_path, spec))
    assert (cfg.env["train_split"], cfg.env["eval_split"]) == (spec, "heldout")  # held-out is never narrowed
    with pytest.raises(SystemExit, match="Easy/heldout/0"):
        exp.split_of(["Easy/heldout/0"])
    # --train-split train_reach: rows of that split, which keeps train's task ids
    reach = [r["task_id"] for r in load_problems("easy", "train_reach")]
    picked = [reach[7], reach[2], reach[1]]
    spec = exp.split_of(picked, "train_reach")
    assert spec == "train_reach[1:3]+train_reach[7:8]"
    assert [r["task_id"] for r in load_problems("easy", spec)] == [reach[1], reach[2], reach[7]]
    with pytest.raises(SystemExit, match="train_reach"):
        exp.split_of([next(t for t in chosen if t not in reach)], "train_reach")
    tuned = replace(exp.FULL, train_split="train_reach")
    assert compose(exp.overrides("one_turn", 0, tuned, tmp_path, tuned.train_split)).env["train_split"] == "train_reach"
    assert "env.train_split=train_reach" in exp.select_settings(tuned)
    from magrpo.trainer import prepare

    prepare(compose(exp.select_settings(exp.FULL)))  # the real model's config evaluates by default: a valid eval split


@pytest.mark.slow
def test_select_then_run_on_the_tiny_model(exp, tmp_path):
    """`select` samples the untrained team on the candidates and records every rate; `run` trains on
    the kept rows only, and refuses a selection sampled with other settings. The tiny model passes
    nothing, so the kept list is edited by hand, as a real selection would have kept them."""
    sizes = exp.replace(exp.SMOKE, select_candidates=2, select_samples=2,
                        seeds={"level_feedback": (0,), "single_agent": (), "one_turn": ()})
    selection = exp.select(sizes, tmp_path)
    assert sorted(selection["rates"]) == ["Easy/train/0", "Easy/train/1"] and selection["selected"] == []
    saved = json.loads((tmp_path / "selection.json").read_text())
    saved["selected"] = ["Easy/train/1"]
    (tmp_path / "selection.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="other settings"):
        exp.run(exp.replace(sizes, select_samples=3), tmp_path, ["level_feedback"])
    (run_dir,) = exp.run(sizes, tmp_path, ["level_feedback"])
    assert json.loads((run_dir / "config.json").read_text())["env"]["train_split"] == "train[1:2]"
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    assert "Training problems: 1 of the first 2 train problems" in text
