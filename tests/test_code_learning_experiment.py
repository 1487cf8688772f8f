"""experiments/code_learning.py (issue 17's CPU learning experiment) does not rot: the problem
selection, the budget matching, the data split and the report on hand-made run dirs (seconds), and
the whole select -> run -> report pipeline on the tiny model (--smoke, slow)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import experiment_module


@pytest.fixture(scope="module")
def exp():
    yield from experiment_module("code_learning")


def test_selection_keeps_problems_whose_sampled_rewards_differ(exp):
    # 3 problems x 4 samples, in the order run_paths returns them (index into the repeated list)
    passed = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 0, 6: 1, 7: 0, 8: 1, 9: 1, 10: 1, 11: 1}
    reward = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 4.0, 5: 1.5, 6: 4.0, 7: 0.5, 8: 4.0, 9: 4.0, 10: 4.0, 11: 4.0}
    paths = [(i, {"passed": float(p), "reward": reward[i]}) for i, p in passed.items()]
    assert exp.pass_rates(paths, ["A", "B", "C"], samples=4) == {"A": 0.0, "B": 0.5, "C": 1.0}
    rewards = exp.reward_sets(paths, ["A", "B", "C"], samples=4)
    assert rewards == {"A": [1.0] * 4, "B": [0.5, 1.5, 4.0, 4.0], "C": [4.0] * 4}
    assert exp.choose(rewards) == ["B"]  # equal rewards in every sample: a GRPO group has no gradient
    assert exp.choose(rewards, strict=False) == ["A", "B", "C"]
    rewards["A"][0] = 0.0  # never passed, yet its rewards differ: a gradient is possible
    assert exp.choose(rewards) == ["A", "B"]


def test_baselines_get_at_least_the_reference_generation_budget(exp):
    from magrpo.tree import tree_size

    sizes = exp.FULL
    ref = tree_size("align", sizes.k, 2, 2)[1] * sizes.batch_size  # 2 agents, T=2: 40 per tree at K=4
    for name, v in exp.VARIANTS.items():
        per_step = tree_size("align", sizes.k, v.agents, v.turns)[1] * exp.batch_size(v, sizes)
        assert ref <= per_step < ref + tree_size("align", sizes.k, v.agents, v.turns)[1], name
    assert exp.batch_size(exp.VARIANTS["one_turn"], sizes) == 5 * sizes.batch_size
    assert exp.batch_size(exp.VARIANTS["single_agent"], sizes) == 2 * sizes.batch_size


def test_dataset_holds_the_selected_train_problems_then_every_held_out_one(exp, tmp_path):
    path, n = exp.write_dataset(["HumanEval/3", "HumanEval/0"], tmp_path)
    ids = [json.loads(line)["task_id"] for line in path.read_text().splitlines()]
    assert n == 2 and ids[:2] == ["HumanEval/3", "HumanEval/0"]
    assert ids[2:] == [f"HumanEval/{i}" for i in range(132, 164)]
    with pytest.raises(SystemExit, match="HumanEval/140"):  # a held-out problem can never be selected
        exp.write_dataset(["HumanEval/140"], tmp_path)
    overrides = exp.overrides("level_feedback", 0, exp.FULL, path, n, tmp_path / "run")
    assert "env.train_split='test[:2]'" in overrides and "env.eval_split='test[2:]'" in overrides


def fake_run(root, variant, seed, agents, before, after, rewards, between=(), seconds=600.0, **record):
    """A finished run dir: eval at step 0, after each step given a value in `between` (--eval-every)
    and after the last step, a training reward per step."""
    run_dir = root / "runs" / variant / f"seed{seed}"
    run_dir.mkdir(parents=True)
    def evaluation(step, p):
        return {"step": step, "perf/eval_s": 1.0, "eval/turn_0/greedy_reward_mean": p,
                "eval/turn_0/pass@1_greedy": p, "eval/turn_0/greedy_aux_defined_mean": 1.0,
                "eval/turn_1/pass@1_greedy": p + 0.1, "eval/improvement/pass@1_greedy": 0.1,
                "eval/turn_0/pass@4": p, "eval/turn_1/pass@4": p}
    records = [evaluation(0, before)]
    records += [{"step": s, "train/turn_0/reward_mean": r} for s, r in enumerate(rewards, start=1)]
    for step, p in enumerate(between, start=1):
        records[step].update(evaluation(step, p))
    records[-1].update(evaluation(len(rewards), after))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    info = {"variant": variant, "seed": seed, "agents": agents, "turns": 2, "feedback": "level_feedback",
            "completions_per_step": 40, "seconds": seconds, "date": "2026-01-01 00:00 UTC", "machine": "test box",
            **record}
    (run_dir / "experiment.json").write_text(json.dumps(info))


def test_report_gives_mean_and_spread_over_seeds_before_and_after(exp, tmp_path):
    fake_run(tmp_path, "level_feedback", 0, 2, before=0.2, after=0.4, rewards=[1.0, 2.0])
    fake_run(tmp_path, "level_feedback", 1, 2, before=0.4, after=0.4, rewards=[1.0, 3.0], seconds=720.0)
    fake_run(tmp_path, "single_agent", 0, 1, before=0.1, after=0.2, rewards=[0.5, 0.5])
    doc, image = tmp_path / "docs" / "results.md", tmp_path / "docs" / "img" / "results.png"
    text = exp.report(tmp_path, doc, image)
    assert doc.read_text() == text and image.stat().st_size > 0
    assert "| level_feedback | 2 | 2 | level_feedback | 0, 1 | 40 | 10.0, 12.0 |" in text  # minutes by seed
    # pass@1 greedy turn 1: before (0.2, 0.4), after (0.4, 0.4), change (0.2, 0.0); sample sd
    assert "| tests passed = pass@1 greedy | 1 | 0.300 ± 0.141 | 0.400 ± 0.000 | 0.100 ± 0.141 |" in text
    assert "| pass@4 sampled | 2 | 0.300 ± 0.141 |" in text
    assert "| turn-1 -> last-turn gain, pass@1 greedy | – |" in text
    single = text.split("**single_agent**")[1]
    assert "| tests passed = pass@1 greedy | 1 | 0.100 | 0.200 | 0.100 |" in single  # one seed: no spread
    assert "aux defined" not in single  # one agent writes no helper
    assert "2026-01-01 00:00 UTC" in text and "test box" in text and "](img/results.png)" in text
    assert "per evaluation step" not in text  # evaluated before and after only
    assert "Not in these tables" not in text


def test_report_says_which_variant_wins_and_by_how_much_paired_by_seed(exp, tmp_path):
    # one turn each, so the last turn is turn 0: greedy reward = pass@1 greedy = the eval value
    fake_run(tmp_path, "level_feedback", 0, 2, before=0.2, after=0.4, rewards=[1.0], turns=1)
    fake_run(tmp_path, "level_feedback", 1, 2, before=0.4, after=0.4, rewards=[1.0], turns=1)
    fake_run(tmp_path, "one_turn", 0, 2, before=0.2, after=0.8, rewards=[1.0], turns=1)
    fake_run(tmp_path, "one_turn", 1, 2, before=0.4, after=0.6, rewards=[1.0], turns=1)
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    wins = text.split("**Which wins**")[1].split("**level_feedback**")[0]
    # level_feedback changes (0.2, 0.0); one_turn (0.6, 0.2); paired differences (0.4, 0.2)
    assert "| level_feedback | 1 | 0.400 ± 0.000 | 0.100 ± 0.141 | – |" in wins
    assert "| one_turn | 1 | 0.700 ± 0.141 | 0.400 ± 0.283 | 0.300 ± 0.141 |" in wins
    assert ("- pass@1 greedy: the largest change is one_turn's, 0.400 ± 0.283; "
            "next level_feedback, 0.100 ± 0.141.") in wins


def test_report_calls_equal_changes_a_tie(exp, tmp_path):
    for variant in ("level_feedback", "plain"):
        fake_run(tmp_path, variant, 0, 2, before=0.0, after=0.0, rewards=[1.0], turns=1)
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    assert "- pass@1 greedy: a tie, change 0.000 in every variant." in text


def test_report_names_run_dirs_it_leaves_out(exp, tmp_path):
    fake_run(tmp_path, "level_feedback", 0, 2, before=0.2, after=0.4, rewards=[1.0, 2.0])
    (tmp_path / "runs" / "plain" / "seed0").mkdir(parents=True)  # still running: no experiment.json
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    assert "**Not in these tables** (no experiment.json: running, stopped or failed): runs/plain/seed0." in text


def test_a_finished_run_without_its_record_gets_one_timed_by_its_metrics(exp, tmp_path, monkeypatch):
    """Stopped after training but before experiment.json: `run` must not leave it out of the report."""
    from dataclasses import replace

    sizes = replace(exp.SMOKE, steps=2, eval_every=1)
    selection = tmp_path / "selection.json"
    selection.write_text(json.dumps({"selected": ["HumanEval/0"]}))
    run_dir = tmp_path / "runs" / "plain" / "seed0"
    fake_run(tmp_path, "plain", 0, 2, before=0.2, after=0.4, rewards=[1.0, 2.0])
    (run_dir / "experiment.json").unlink()
    monkeypatch.setattr(exp, "check_same_settings", lambda run_dir, wanted: None)
    monkeypatch.setattr("magrpo.cli.main", lambda argv: pytest.fail("a finished run was trained again"))
    exp.run(sizes, selection, tmp_path, ["plain"])
    info = json.loads((run_dir / "experiment.json").read_text())
    assert info["variant"] == "plain" and info["seconds"] == 2.0  # the fake's two evaluations, 1 s each
    assert info["seconds_from"].startswith("metrics.jsonl")


def test_a_kept_run_trained_on_other_problems_stops_the_experiment(exp, tmp_path, monkeypatch):
    """`all` twice with other --candidates, or a hand-edited selection.json: the data file is rewritten,
    so only the run's record can say which problems it trained on."""
    from dataclasses import replace

    selection = tmp_path / "selection.json"
    selection.write_text(json.dumps({"selected": ["HumanEval/0", "HumanEval/2"]}))
    fake_run(tmp_path, "plain", 0, 2, before=0.2, after=0.4, rewards=[1.0, 2.0],
             train_ids=["HumanEval/0", "HumanEval/1"])
    monkeypatch.setattr(exp, "check_same_settings", lambda run_dir, wanted: None)
    monkeypatch.setattr("magrpo.cli.main", lambda argv: pytest.fail("a finished run was trained again"))
    sizes = replace(exp.SMOKE, steps=2, eval_every=1)
    difference = r"trained on other problems \(2\) than the 2 of .*'HumanEval/1', 'HumanEval/2'"
    with pytest.raises(SystemExit, match=difference):
        exp.run(sizes, selection, tmp_path, ["plain"])
    selection.write_text(json.dumps({"selected": ["HumanEval/0", "HumanEval/1"]}))
    exp.run(sizes, selection, tmp_path, ["plain"])  # the same problems: kept


def test_a_new_selection_never_replaces_the_one_kept_runs_trained_on(exp, tmp_path):
    path = tmp_path / "selection.json"
    exp.save_selection({"selected": ["HumanEval/0"], "date": "day 1"}, path)
    exp.save_selection({"selected": ["HumanEval/1"], "date": "day 2"}, path)  # no runs yet: replaced
    fake_run(tmp_path, "plain", 0, 2, before=0.2, after=0.4, rewards=[1.0])
    exp.save_selection({"selected": ["HumanEval/1"], "date": "day 3"}, path)  # the same problems: fine
    with pytest.raises(SystemExit, match="holds runs trained on the 1 problems of .*selection.rejected.json"):
        exp.save_selection({"selected": ["HumanEval/0", "HumanEval/5"], "date": "day 4"}, path)
    assert json.loads(path.read_text()) == {"selected": ["HumanEval/1"], "date": "day 3"}
    assert json.loads((tmp_path / "selection.rejected.json").read_text())["date"] == "day 4"  # nothing lost


def test_report_gives_every_held_out_metric_per_evaluation_step(exp, tmp_path):
    fake_run(tmp_path, "level_feedback", 0, 2, before=0.2, after=0.6, rewards=[1.0, 2.0, 3.0], between=(0.3, 0.5))
    fake_run(tmp_path, "level_feedback", 1, 2, before=0.4, after=0.6, rewards=[1.0, 3.0, 3.0], between=(0.3, 0.3))
    fake_run(tmp_path, "single_agent", 0, 1, before=0.1, after=0.2, rewards=[0.5, 0.5, 0.5])  # no evals between
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    steps = text.split("**level_feedback** per evaluation step")[1]
    assert "| metric | turn | step 0 | step 1 | step 2 | step 3 |" in steps
    # pass@1 greedy turn 1 per step over the two seeds: (0.2, 0.4), (0.3, 0.3), (0.5, 0.3), (0.6, 0.6)
    assert ("| tests passed = pass@1 greedy | 1 | 0.300 ± 0.141 | 0.300 ± 0.000 | 0.400 ± 0.141 | 0.600 ± 0.000 |"
            in steps)
    assert "| turn-1 -> last-turn gain, pass@1 greedy | – | 0.100 ± 0.000 |" in steps
    assert "**single_agent** per evaluation step" not in text  # before and after only


@pytest.mark.slow
def test_smoke_pipeline_selects_trains_and_reports(exp, tmp_path, monkeypatch):
    monkeypatch.setattr(exp, "SELECT_CHUNK", 1)  # two chunks: the rates of each land on its own problems
    assert exp.main(["all", "--smoke", "--out", str(tmp_path)]) == 0
    selection = json.loads((tmp_path / "selection.json").read_text())
    assert len(selection["rates"]) == 2 and selection["selected"] == list(selection["rates"])
    assert all(not tid.endswith(tuple(f"/{i}" for i in range(132, 164))) for tid in selection["rates"])
    text = (tmp_path / "results.md").read_text()
    for name in exp.VARIANTS:
        assert f"**{name}**" in text
        assert (tmp_path / "runs" / name / "seed0" / "adapters").is_dir()
    assert "| main defined | 1 |" in text and (tmp_path / "results.png").stat().st_size > 0
    # a second call finds every run finished and only rewrites the report
    assert exp.main(["run", "--smoke", "--out", str(tmp_path)]) == 0


def test_a_kept_run_with_other_settings_stops_the_experiment(exp, tmp_path):
    """Rerunning with --eval-every 1 over runs evaluated before/after only must not keep them as
    finished: their per-step numbers would be silently missing from the report."""
    from dataclasses import asdict, replace

    from magrpo.cli import compose

    run_dir, dataset = tmp_path / "run", tmp_path / "problems.jsonl"
    run_dir.mkdir()
    before_after_only = replace(exp.FULL, eval_every=0)
    settings = exp.overrides("plain", 0, before_after_only, dataset, 3, run_dir)
    (run_dir / "config.json").write_text(json.dumps(asdict(compose(settings)), default=str))
    exp.check_same_settings(run_dir, settings)  # the same settings: kept
    with pytest.raises(SystemExit, match=r"eval.every=0, this call wants eval.every=1"):
        exp.check_same_settings(run_dir, exp.overrides("plain", 0, exp.FULL, dataset, 3, run_dir))
    with pytest.raises(SystemExit, match=r"trainer.lr=0.0003, this call wants trainer.lr=0.001"):
        other_lr = replace(before_after_only, lr=1e-3)
        exp.check_same_settings(run_dir, exp.overrides("plain", 0, other_lr, dataset, 3, run_dir))


def test_a_runs_machine_names_the_instruction_sets_that_change_its_floats(exp):
    """Runs on an AVX2, an AVX512-BF16 and an AMX CPU round bfloat16 differently, and "Intel(R) Xeon(R)
    Processor" alone does not say which of them a run had."""
    assert exp._cpu_kind({"avx2", "fma"}) == " (AVX2)"
    assert exp._cpu_kind({"avx2", "avx512f", "avx512_bf16"}) == " (AVX512-BF16, AVX-512, AVX2)"
    assert exp._cpu_kind({"amx_tile", "avx512_bf16", "avx512f", "avx2"}) == " (AMX, AVX512-BF16, AVX-512, AVX2)"
    assert exp._cpu_kind(set()) == ""
    assert exp._provenance(0.0)["machine"].count("core(s)") == 1
