"""experiments/reasoning_sizing.py (issue 48, part 2) does not rot: it samples the train split's first
problems through the env's own prompts and verifier (team: 2 agents, 2 turns; one agent, one turn), its
held-out size formula matches hand numbers, and its candidates parse (seconds; the tiny model)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import experiment_module


@pytest.fixture(scope="module")
def exp():
    pytest.importorskip("reasoning_gym", reason="the extra reasoning-gym is not installed")
    yield from experiment_module("reasoning_sizing")


def test_a_candidate_is_a_task_and_its_config(exp):
    assert exp.parse_candidate("chain_sum:min_terms=2,max_digits=1") == ("chain_sum", {"min_terms": 2, "max_digits": 1})
    assert exp.parse_candidate("basic_arithmetic") == ("basic_arithmetic", {})
    assert exp.parse_candidate("chain_sum:allow_negation=false")[1] == {"allow_negation": False}
    for text in exp.CANDIDATES:  # every default candidate is a valid task config (one line before a model loads)
        from magrpo.cli import compose
        from magrpo.trainer import prepare

        task, config = exp.parse_candidate(text)
        prepare(compose(["env=reasoning_gym", f"env.task={task}", "model=tiny",
                         "env.eval_size=0", "eval.at_end=false",  # as the sizing runs: no held-out split
                         *[f"+env.task_config.{k}={json.dumps(v)}" for k, v in config.items()]]))


def test_the_lenient_reading_is_a_diagnostic_of_tag_or_last_number(exp):
    from reasoning_gym.utils import extract_answer

    assert exp.lenient("so 3 + 4 = 7, I think 7.", extract_answer) == "7"
    assert exp.lenient("<answer>-4</answer> and then 9", extract_answer) == "-4"  # the tag wins, as in the env
    assert exp.lenient("no number", extract_answer) is None


def test_heldout_size_against_hand_numbers(exp):
    # p = 0.3, one run per arm, one sample: 2 * sqrt(2 * 0.21 / n) <= 0.05  ->  n >= 672
    assert exp.heldout_size(0.21, 0.05, seeds=1) == pytest.approx(672)
    assert exp.heldout_size(0.21, 0.05, seeds=3) == pytest.approx(224)  # means of 3 seeds per arm
    assert exp.heldout_size(0.21, 0.05, seeds=3, samples=4) == pytest.approx(56)
    # training's own seed spread eats the room: 2 * sqrt(2 * (0.21 / n + 0.02^2) / 3) <= 0.05
    assert exp.heldout_size(0.21, 0.05, seeds=3, seed_sd=0.02) == pytest.approx(0.21 / (0.05 ** 2 * 3 / 8 - 0.0004))
    assert exp.heldout_size(0.21, 0.05, seeds=3, seed_sd=0.04) == float("inf")


def test_it_samples_the_train_split_through_the_envs_prompts_and_verifier(exp, tmp_path):
    from magrpo.cli import compose
    from magrpo.trainer import prepare

    out = tmp_path / "sizing.json"
    results = exp.main(["model.dtype=float32", "--model", "tiny", "--problems", "2", "--samples", "2",
                        "--max-new-tokens", "6", "--out", str(out),
                        "--candidates", "chain_sum:min_terms=2,max_terms=2,max_digits=1"])
    assert json.loads(out.read_text()) == results
    r = results[0]
    assert (r["task"], r["problems"], r["samples"]) == ("chain_sum", 2, 2)
    env, _ = prepare(compose(["env=reasoning_gym", "env.task=chain_sum", "model=tiny", "env.eval_size=0",
                              "eval.at_end=false", "+env.task_config.min_terms=2",
                              "+env.task_config.max_terms=2", "+env.task_config.max_digits=1"]))
    train = [p["prompt"] for p in env.problems("train")[:2]]
    team, single = r["transcripts"]["team"], r["transcripts"]["single"]
    assert len(team) == 2 and len(single) == 1  # turns
    assert [t["question"] for t in team[0]] == [q for q in train for _ in range(2)]  # each problem, 2 samples
    assert [len(t["replies"]) for t in team[0]] == [2] * 4 and [len(t["replies"]) for t in single[0]] == [1] * 4
    assert r["replies"]["team_turn1_checker"]["replies"] == 4 and r["replies"]["single"]["replies"] == 4
    # the team's accuracy is the checker's answer under the env's own verifier
    problems = {p["prompt"]: p for p in env.problems("train")[:2]}
    checker = [env.verify(env.rg.utils.extract_answer(t["replies"][-1]), problems[t["question"]]) >= 1.0
               for t in team[1]]
    assert r["team_turn2"]["mean"] == pytest.approx(sum(checker) / 4)
    assert len(r["team_turn1"]["per_sample"]) == 2 and "within_problem_var" in r["single"]
