"""experiments/reasoning_learning.py (issue 48, part 3) does not rot: its arms sample equal budgets and
compose on splits that never share a problem, the whole pipeline runs on the tiny model and a second
call keeps what finished, and the report reads hand-made run dirs right."""
from __future__ import annotations

import json

import pytest

from tests.conftest import experiment_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the tiny model: a second thread only spin-waits


@pytest.fixture(scope="module")
def exp():
    pytest.importorskip("reasoning_gym", reason="the extra reasoning-gym is not installed")
    yield from experiment_module("reasoning_learning")


@pytest.mark.parametrize("sizes", ["FULL", "SMOKE"])
def test_every_arm_samples_the_methods_completions_per_step(exp, sizes, tmp_path):
    from magrpo.cli import compose
    from magrpo.tree import tree_size

    sizes = getattr(exp, sizes)
    per_step = {}
    for name, arm in exp.ARMS.items():
        cfg = compose(exp.overrides(name, 0, sizes, tmp_path / name))
        assert (cfg.env["num_agents"], cfg.trainer.num_turns) == (arm.agents, arm.turns)
        per_step[name] = tree_size("align", sizes.k, arm.agents, arm.turns)[1] * cfg.trainer.batch_size
    assert set(per_step.values()) == {per_step[exp.METHOD]}, per_step  # equal, not only "at least"


def test_solvers_are_paid_their_own_score_and_an_untrained_record_does_not_care(exp, tmp_path):
    """With the team reward alone a solver's turn-1 reply never reaches the reward (the checker answers
    alone): the 2-agent arms pay each agent half its own score. That setting and the learning rate do not
    change an untrained evaluation, so a record made with others is kept; a generation setting does."""
    from magrpo.cli import compose

    for name, arm in exp.ARMS.items():
        cfg = compose(exp.overrides(name, 0, exp.FULL, tmp_path / name))
        assert cfg.reward.team_weight == (0.5 if arm.agents > 1 else 1.0)
    argv = exp.overrides(exp.METHOD, 0, exp.FULL, tmp_path / "u")
    record = tmp_path / "method.json"
    record.write_text(json.dumps({"overrides": [a for a in argv if not a.startswith("reward.team_weight")]}))
    exp.check_same_untrained(record, argv)  # kept
    record.write_text(json.dumps({"overrides": [a if not a.startswith("trainer.lr=") else "trainer.lr=0.003"
                                                for a in argv]}))
    exp.check_same_untrained(record, argv)  # kept: the runs' learning rate moved after this record was made
    record.write_text(json.dumps({"overrides": [a for a in argv if not a.startswith("generation.top_p")]}))
    with pytest.raises(SystemExit, match="other settings"):
        exp.check_same_untrained(record, argv)


def test_held_out_problems_never_are_train_problems(exp, tmp_path):
    """The full size's splits, as each arm's run builds them: other seeds, no shared question, >= 216."""
    from magrpo.cli import compose
    from magrpo.trainer import prepare

    for name in exp.ARMS:
        env, _ = prepare(compose(exp.overrides(name, 0, exp.FULL, tmp_path / name)))
        assert env.cfg.eval_seed != env.cfg.train_seed
        train, held_out = env.problems("train"), env.problems("eval")
        assert len(held_out) == exp.FULL.eval_size >= 216
        assert not {p["prompt"] for p in train} & {p["prompt"] for p in held_out}
        assert len({p["prompt"] for p in held_out}) == len(held_out)  # each question once
        assert len(train) >= exp.batch_size(exp.ARMS[name], exp.FULL) * exp.FULL.steps  # no train problem twice
        assert {p["metadata"]["source_dataset"] for p in held_out} == {exp.TASK}


def test_runs_are_seed_major_so_a_stopped_experiment_has_whole_seeds(exp):
    sizes = exp.replace(exp.SMOKE, seeds={"method": (0, 1), "single_agent": (0, 1), "one_turn": (0,)})
    assert sizes.runs == [("method", 0), ("single_agent", 0), ("one_turn", 0), ("method", 1), ("single_agent", 1)]


def test_the_pipeline_on_the_tiny_model_then_a_second_call_keeps_what_finished(exp, tmp_path, capsys):
    out = tmp_path / "out"
    assert exp.main(["all", "--smoke", "--out", str(out)]) == 0
    text = (out / "results.md").read_text()
    for table in ("**Held-out accuracy, sampled pass@1", "**Held-out accuracy, greedy pass@1", "**Per turn**",
                  "**Untrained**", "**Sampling budget per training step**", "groups with zero reward spread",
                  "**Durations**", "**Exact settings per arm**"):
        assert table in text
    assert (out / "results.png").stat().st_size > 0
    runs = exp.load_runs(out)
    assert list(runs) == list(exp.ARMS)
    # the tokens each arm really sampled per step: equal completions of max_new_tokens each (the tiny
    # model never stops early), so equal tokens
    tokens = {name: sorted({exp.sampled_tokens(r) for records, _ in seeds.values() for r in records
                            if "perf/gen_s" in r}) for name, seeds in runs.items()}
    assert all(t == tokens[exp.METHOD] for t in tokens.values()), tokens
    assert "| 1.00x |" in text
    # evaluated before (the arm's untrained evaluation), during (eval_every=1) and after
    records = runs[exp.METHOD][0][0]
    assert sorted(exp.shared.evaluations(records)) == [0, 1, 2]
    untrained = json.loads((out / "untrained" / "method.json").read_text())["metrics"]
    assert records[0] == {"step": 0, **untrained}

    metrics = {d: d.stat().st_mtime_ns for d in out.glob("runs/*/seed0/metrics.jsonl")}
    capsys.readouterr()
    assert exp.main(["all", "--smoke", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("already finished") == err.count("already evaluated") == len(exp.ARMS)
    assert {d: d.stat().st_mtime_ns for d in metrics} == metrics  # nothing trained again
    for command in ("untrained", "run"):  # a kept evaluation or run must have these settings
        with pytest.raises(SystemExit, match="other settings"):
            exp.main([command, "--smoke", "--out", str(out), "--arms", "method", "--eval-samples", "2"])
    with pytest.raises(SystemExit, match="other settings"):  # --lr reaches the runs
        exp.main(["run", "--smoke", "--out", str(out), "--arms", "method", "--lr", "0.001"])


def write_run(out, arm: str, seed: int, before: float, after: float, tokens: float = 100.0, samples: int = 1) -> None:
    a = exp_arms[arm]
    run = out / "runs" / arm / f"seed{seed}"
    run.mkdir(parents=True)
    keys = [f"eval/turn_{a[1] - 1}/pass@1{kind}" for kind in ("_greedy", "")[:1 + bool(samples)]]
    records = [{"step": 0, "perf/eval_s": 60.0, **dict.fromkeys(keys, before)},
               {"step": 1, "perf/step_s": 2.0, "perf/gen_s": 1.0, "perf/tokens_per_s": tokens,
                f"train/turn_{a[1] - 1}/reward_mean": 0.5, "train/agent_0/frac_zero_std": 0.25},
               {"step": 1, "perf/eval_s": 60.0, **dict.fromkeys(keys, after)}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "experiment.json").write_text(json.dumps({
        "variant": arm, "seed": seed, "agents": a[0], "turns": a[1], "feedback": "reasoning_gym",
        "completions_per_step": 80, "sizes": {"eval_size": 216, "eval_samples": samples}, "dtype": "bfloat16",
        "load_average": [1.0, 1.0, 1.0],
        "overrides": ["model=tiny", "trainer.batch_size=2", f"trainer.seed={seed}", f"logging.run_dir='{run}'"],
        "date": "2026-11-28 12:00 UTC", "machine": "test machine", "seconds": 600.0}))


exp_arms = {"method": (2, 2), "single_agent": (1, 2), "one_turn": (2, 1)}


def test_report_gain_against_two_standard_errors_and_the_best_baseline(exp, tmp_path):
    for seed, (before, after) in enumerate([(0.28, 0.40), (0.27, 0.38), (0.29, 0.42)]):
        write_run(tmp_path, "method", seed, before, after)
    for seed, (before, after) in enumerate([(0.28, 0.30), (0.27, 0.35), (0.29, 0.31)]):
        write_run(tmp_path, "single_agent", seed, before, after, tokens=110.0)
    write_run(tmp_path, "one_turn", 0, 0.28, 0.29)
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    headline = text.splitlines()[0]
    assert headline.startswith("**Headline:** Held-out sampled accuracy")
    # gains 0.12, 0.11, 0.13: mean 0.12, SE 0.01/sqrt(3)
    assert "0.280 ± 0.010 before -> 0.400 ± 0.020 after (3 seed(s); gain +0.120, exceeds 2 SE)" in headline
    # best baseline single_agent after 0.32 ± 0.026; difference 0.08, SE sqrt((0.0004 + 0.000700) / 3) = 0.019
    assert "Best baseline: single_agent, 0.320 ± 0.026 after training; the method minus it: +0.080 (SE 0.019), " \
           "beyond 2 SE." in headline
    assert "| one_turn | 2 | 1 | 1 | 0.280 | 0.290 | +0.010 | – | one seed: no SE |" in text
    assert "| single_agent | 2 | 80 | 110 ± 0 | 1.10x |" in text
    zero = "| method | groups with zero reward spread (no gradient) | 0.250 ± 0.000 | 0.250 ± 0.000 | 0.250 ± 0.000 |"
    assert zero in text
    assert "test machine" in text and "- one_turn: `model=tiny trainer.batch_size=2 trainer.seed=0`" in text


def test_the_reports_sizes_name_the_seeds_it_holds_not_those_of_one_runs_command(exp, tmp_path):
    """Each run records the sizes of the command that started it: a run started with `--seeds 0` says
    {"method": [0]}; a real report of 3 method seeds once printed that as its sizes."""
    for seed in (0, 1, 2):
        write_run(tmp_path, "method", seed, 0.28, 0.30)
    write_run(tmp_path, "single_agent", 1, 0.2, 0.3)
    for info_path in tmp_path.glob("runs/*/seed*/experiment.json"):
        info = json.loads(info_path.read_text())
        sizes = {**info["sizes"], "seeds": {info["variant"]: [info["seed"]]}}
        info_path.write_text(json.dumps({**info, "sizes": sizes}))
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    assert '"seeds": {"method": [0, 1, 2], "single_agent": [1]}' in text


def test_a_run_resumed_across_jobs_counts_the_time_of_every_job(exp, tmp_path):
    """experiment.json holds the wall time of the job that finished a run; a run resumed across jobs logged
    the earlier jobs' steps and evaluations in its metrics (here 62 s against the last job's 30 s)."""
    write_run(tmp_path, "method", 0, 0.28, 0.40)
    info_path = tmp_path / "runs" / "method" / "seed0" / "experiment.json"
    info_path.write_text(json.dumps({**json.loads(info_path.read_text()), "seconds": 30.0}))
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    assert "| method | 0 | 1.0 | 2 | 60 |" in text and "Time: 1 runs, 0.02 h in all." in text


def test_a_runs_durations_leave_out_its_arms_untrained_evaluation(exp, tmp_path):
    """The untrained evaluation (OUT/untrained, a job of its own) is each run's step 0 in the report, not part
    of the run's time: a real report once said 676 s per evaluation, the mean of the untrained 1548 s and the
    run's own 264 and 216 s."""
    write_run(tmp_path, "method", 0, 0.28, 0.40)
    path = tmp_path / "runs" / "method" / "seed0" / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[1:]))  # eval.at_start=false
    (tmp_path / "untrained").mkdir()
    (tmp_path / "untrained" / "method.json").write_text(json.dumps({
        "variant": "method", "agents": 2, "turns": 2, "overrides": [], "load_average": [1.0, 1.0, 1.0],
        "metrics": {"eval/turn_0/pass@1_greedy": 0.3, "eval/turn_1/pass@1_greedy": 0.28, "eval/turn_1/pass@1": 0.28,
                    "perf/eval_s": 1548.0},
        "date": "2026-11-28 11:00 UTC", "machine": "test machine", "seconds": 1548.0}))
    text = exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    assert "| method | 0 | 10.0 | 2 | 60 |" in text
    assert "0.280 before -> 0.400 after" in text  # the untrained evaluation is still the run's "before"


def test_headline_says_when_the_gain_is_within_two_standard_errors(exp, tmp_path):
    for seed, (before, after) in enumerate([(0.28, 0.28), (0.28, 0.40), (0.28, 0.28)]):  # mean +0.04, SE 0.04
        write_run(tmp_path, "method", seed, before, after, samples=0)
    headline = exp.headline(exp.load_runs(tmp_path))
    assert "gain +0.040, does not exceed 2 SE" in headline
    assert headline.startswith("Held-out greedy accuracy")  # no sampled held-out paths: the greedy ones
    assert "accuracy, sampled pass@1" not in exp.report(tmp_path, tmp_path / "results.md", tmp_path / "results.png")
    assert exp.headline({}) == "No finished run of the method (method) yet."
    runs = exp.load_runs(tmp_path)
    for records, _ in runs["method"].values():  # runs whose "before" (OUT/untrained) is missing
        records.pop(0)
    assert "no untrained evaluation to start from: run `untrained --arms method`" in exp.headline(runs)


def test_a_run_stopped_by_its_jobs_time_limit_is_no_failure(exp, tmp_path, monkeypatch):
    import magrpo.cli

    monkeypatch.setattr(magrpo.cli, "main", lambda argv: 143)  # SIGTERM (`timeout`), after a checkpoint
    with pytest.raises(SystemExit, match=r"method seed 0 stopped \(exit 143\); the same command resumes it"):
        exp.run(exp.SMOKE, tmp_path, ["method"])


def test_the_breakdown_splits_held_out_problems_by_their_operands_digits(exp):
    breakdown = next(experiment_module("reasoning_breakdown"))  # imports reasoning_learning: the `exp` fixture's

    def problem(expression):
        return {"metadata": {"expression": expression}}

    assert [breakdown.kind(problem(e)) for e in ("9 + 4", "9 - 12", "31 + 4", "0 + 0")] == \
        ["one-digit", "two-digit", "two-digit", "one-digit"]
    result = {"kinds": ["one-digit", "two-digit", "one-digit"], "passed": {0: [1.0, 0.0, 0.0], 1: [1.0, 1.0, 1.0]}}
    assert breakdown.table(result).splitlines()[2:] == ["| 1 | 0.333 of 3 | 0.500 of 2 | 0.000 of 1 |",
                                                        "| 2 | 1.000 of 3 | 1.000 of 2 | 1.000 of 1 |"]


def test_the_training_breakdown_averages_every_seeds_rewards_by_turn_kind_and_half(exp, tmp_path):
    breakdown = next(experiment_module("reasoning_breakdown"))

    def record(step, expression, turn_rewards):
        nodes = [{"turn": t, "joint_actions": [{"reward": r} for r in rs]} for t, rs in enumerate(turn_rewards)]
        return json.dumps({"step": step, "problem": {"metadata": {"expression": expression}}, "nodes": nodes})

    for seed, lines in enumerate([[record(1, "3 + 4", [[1, 0], [1, 1]]), record(12, "13 + 4", [[0, 0], [1, 0]])],
                                  [record(2, "3 - 4", [[1, 1], [0, 0]])]]):
        (tmp_path / "method" / f"seed{seed}").mkdir(parents=True)
        (tmp_path / "method" / f"seed{seed}" / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    rows = breakdown.training_table(tmp_path).splitlines()[2:]
    assert rows == ["| method | 1 | 0.75 of 4 | – | – | 0.00 of 2 |", "| method | 2 | 0.50 of 4 | – | – | 0.50 of 2 |"]
