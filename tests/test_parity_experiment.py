"""experiments/parity.py (issue 47, part 2) does not rot: its quick mode trains magrpo through train.py
(and CoMLRL in its own venv, where scripts/setup_comlrl.sh made one) and writes per-prompt reward
records, a summary and a plot of the documented shape; both sides get the same problems in the same
order; CoMLRL's reward calls are read back per turn in the order its trees make them."""
from __future__ import annotations

import json

import pytest

from tests.conftest import experiment_module

pytestmark = pytest.mark.slow  # train.py / CoMLRL subprocesses


@pytest.fixture(scope="module")
def parity():
    yield from experiment_module("parity")


@pytest.fixture(scope="module")
def comlrl_side():
    yield from experiment_module("parity_comlrl")  # imports no CoMLRL until it runs


def test_comlrl_reward_calls_are_grouped_by_turn_in_tree_order(comlrl_side):
    # a node scores its J joint actions, then builds each child depth first
    assert comlrl_side.turn_order(2, 2) == [0, 0, 1, 1, 1, 1]
    assert comlrl_side.turn_order(2, 3) == [0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 2, 2]
    assert comlrl_side.turn_order(3, 1) == [0, 0, 0]
    rewards = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    assert comlrl_side.per_turn(rewards, [0, 0, 1, 1, 1, 1], 2) == [[0.1, 0.2], [0.3, 0.4, 0.5, 0.6]]
    with pytest.raises(SystemExit, match="made 5 reward calls, expected 6"):
        comlrl_side.per_turn(rewards[:5], [0, 0, 1, 1, 1, 1], 2)  # a stopped branch: refused, not misread


def test_the_problem_order_is_the_one_magrpo_draws(parity):
    from magrpo.trainer import ProblemSampler

    order = parity.problem_order(6, seed=3)
    assert sorted(order) == list(range(6))  # one epoch: each problem once
    sampler = ProblemSampler(list(range(6)), 3)
    assert order == [sampler.next(1)[0] for _ in range(6)]
    assert parity.problem_order(6, seed=4) != order


def check_record(record: dict, settings, mode: str) -> None:
    tree = settings.tree
    joint = tree.joint_actions(mode)
    assert record["mode"] == mode and len(record["steps"]) == settings.prompts
    for step in record["steps"]:
        assert [len(r) for r in step["turn_rewards"]] == [joint ** (t + 1) for t in range(tree.turns)]
        assert all(0.0 <= r <= 1.0 for rewards in step["turn_rewards"] for r in rewards)
        assert step["seconds"] > 0 and len(step["optimizer_steps"]) == tree.num_agents
        assert len(step["sample"]) == tree.num_agents and all(isinstance(t, str) for t in step["sample"])


def test_quick_magrpo_side_writes_curves_summary_and_plot(parity, tmp_path, monkeypatch):
    # cross only (K^N joint actions, summed credit): align takes the same path with fewer joint actions,
    # and each train.py run costs ~15 s, mostly start-up
    result = parity.main(["--quick", "--sides", "magrpo", "--modes", "cross", "--out", str(tmp_path)])
    s = parity.replace(parity.QUICK, modes=("cross",))
    assert {(r["library"], r["mode"], r["seed"]) for r in result["records"]} == {
        ("magrpo", "cross", seed) for seed in s.seeds}
    assert list(result["settings"]["modes"]) == ["cross"]
    for record in result["records"]:
        check_record(record, s, record["mode"])
        order = parity.problem_order(s.prompts, record["seed"])
        assert [step["problem"] for step in record["steps"]] == [f"train-{i}" for i in order]
        trainer = record["config"]["trainer"]  # what train.py ran with: CoMLRL's update settings
        assert (trainer["batch_size"], trainer["lr"], trainer["max_grad_norm"], trainer["weight_decay"]) == (
            1, s.lr, 0.0, 0.01)
        assert (trainer["advantage_scale"], trainer["cross_credit"], trainer["loss_agg"]) == ("std", "sum", "dr_grpo")
        assert trainer["early_termination_threshold"] is None
        assert trainer["update_every"] == "turn"  # the default --updates: one step per turn on both sides
        assert [a["finetune"] for a in record["config"]["agents"]] == ["full"] * s.tree.num_agents
        saved = json.loads((tmp_path / "runs" / f"magrpo_{record['mode']}_seed{record['seed']}.json").read_text())
        assert saved == record
    assert json.loads((tmp_path / "parity.json").read_text()) == json.loads(json.dumps(result))
    rows = result["summary"]
    assert [(r["mode"], r["turn"]) for r in rows] == [(m, t) for m in s.modes for t in range(s.tree.turns)]
    assert all(r["optimizer_steps_per_prompt"] == s.tree.turns and r["last"]["n"] == len(s.seeds) for r in rows)
    assert (tmp_path / "parity.png").stat().st_size > 0  # matplotlib is a magrpo dependency

    # Run again: every record is kept (same inputs), none is trained again; other inputs train again.
    def no_training(*args):
        raise AssertionError("a run with a saved record of the same inputs was trained again")

    monkeypatch.setattr(parity, "run_magrpo", no_training)
    kept = parity.main(["--quick", "--sides", "magrpo", "--modes", "cross", "--out", str(tmp_path)])
    assert kept["records"] == result["records"]
    with pytest.raises(AssertionError, match="trained again"):
        parity.main(["--quick", "--sides", "magrpo", "--modes", "cross", "--lr", "0.5", "--out", str(tmp_path)])


def test_quick_comlrl_side_writes_records_of_the_same_shape(parity, tmp_path):
    python = parity.COMLRL_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no CoMLRL venv at {parity.COMLRL_VENV} (bash scripts/setup_comlrl.sh makes it)")
    result = parity.main(["--quick", "--sides", "comlrl", "--modes", "cross", "--updates", "buffer",
                          "--out", str(tmp_path)])
    s = parity.replace(parity.QUICK, updates="buffer")
    (record,) = result["records"]
    check_record(record, s, "cross")
    assert record["versions"]["comlrl"] == "1.4.3"
    assert record["config"]["agent_learning_rate"] == s.lr and record["config"]["rollout_buffer_size"] == 2
    order = parity.problem_order(s.prompts, 0)
    assert [step["problem"] for step in record["steps"]] == [f"train-{i}" for i in order]
    # Each agent's node samples, in tree order, fill rollout buffers of 2; a buffer takes one optimizer step
    # per turn it holds. 2 trees of 5 nodes (root r, 4 children c): (r,c) 2, (c,c) 1, (c,r) 2, (c,c) 1, (c,c) 1.
    after = record["after_last_prompt"]["optimizer_steps"][0]
    assert [step["optimizer_steps"][0] for step in record["steps"]] == [3, 4] and after == 0


def test_band_agreement_counts_prompts_inside_comlrls_seed_band(parity):
    """magrpo's mean over seeds against CoMLRL's lowest-to-highest seed, prompt by prompt (window 1)."""
    def record(library, seed, rewards):
        return {"library": library, "mode": "align", "seed": seed,
                "steps": [{"turn_rewards": [[r]]} for r in rewards]}

    records = [record("comlrl", 0, [0.2, 0.5, 0.9]), record("comlrl", 1, [0.4, 0.7, 0.8]),
               record("magrpo", 0, [0.3, 0.1, 1.0]), record("magrpo", 1, [0.3, 0.3, 1.0])]
    s = parity.Settings(seeds=(0, 1), prompts=3, tree=parity.Tree(k=2, turns=1, max_new_tokens=6), window=1,
                        modes=("align",))
    (row,) = parity.band_agreement(records, s)
    assert row["within"] == 1 and row["prompts"] == 3  # 0.3 in [0.2, 0.4]; 0.2 below 0.5; 1.0 above 0.9
    assert row["largest_below"] == pytest.approx(-0.3) and row["largest_above"] == pytest.approx(0.1)


def test_per_turn_updates_give_comlrl_a_buffer_of_one_tree(parity):
    """--updates turn: CoMLRL's buffer holds one tree's node samples and is drained by turn (one batch,
    one step, per turn), and magrpo steps once per turn; --updates buffer keeps CoMLRL's default 2."""
    s = parity.Settings(prompts=2)  # K=4, N=2, T=2
    assert parity.tree_nodes(s.tree, "align") == 5 and parity.tree_nodes(s.tree, "cross") == 17
    config = parity.comlrl_spec(s, "cross", 0)["config"]
    assert (config["rollout_buffer_size"], config["train_batch_size"]) == (17, 17)
    assert "trainer.update_every=turn" in parity.magrpo_command(s, "align", 0, parity.Path("RUN"))
    own = parity.replace(s, updates="buffer")
    assert parity.comlrl_spec(own, "align", 0)["config"]["rollout_buffer_size"] == 2
    assert "train_batch_size" not in parity.comlrl_spec(own, "align", 0)["config"]
    assert not any("update_every" in o for o in parity.magrpo_command(own, "align", 0, parity.Path("RUN")))
    # a record is reused only for the same inputs: the update rule, the seed and the threads are inputs
    inputs = parity.run_inputs(s, "magrpo", "align", 0)
    assert inputs == parity.run_inputs(parity.replace(s, window=4, seeds=(0,)), "magrpo", "align", 0)
    for other in (parity.run_inputs(own, "magrpo", "align", 0), parity.run_inputs(s, "magrpo", "align", 1),
                  parity.run_inputs(parity.replace(s, threads=2), "magrpo", "align", 0)):
        assert other != inputs


def test_calibration_compares_comlrls_seed_halves_with_each_other(parity):
    def record(seed, rewards):
        return {"library": "comlrl", "mode": "align", "seed": seed, "steps": [{"turn_rewards": [[r]]} for r in rewards]}

    records = [record(0, [0.15, 0.5]), record(1, [0.35, 0.5]), record(2, [0.2, 0.9]), record(3, [0.3, 1.0])]
    s = parity.Settings(seeds=(0, 1, 2, 3), prompts=2, tree=parity.Tree(k=2, turns=1, max_new_tokens=6), window=1,
                        modes=("align",))
    first, second = parity.calibration(records, s)
    # seeds 0,1 (means 0.25, 0.5) against 2,3's band ([0.2, 0.3], [0.9, 1.0]);
    # then 2,3 (means 0.25, 0.95) against 0,1's ([0.15, 0.35], [0.5, 0.5])
    assert first["compared"] == "CoMLRL seeds [0, 1] vs CoMLRL seeds [2, 3]"
    assert first["within"] == 1 and first["largest_below"] == pytest.approx(-0.4)
    assert second["within"] == 1 and second["largest_above"] == pytest.approx(0.45)


def test_a_missing_comlrl_venv_is_made_by_the_command_itself(parity, tmp_path, monkeypatch):
    made = []

    def setup(argv, check, env):  # stands in for scripts/setup_comlrl.sh
        made.append((argv[-1], env["MAGRPO_COMLRL_VENV"]))
        (tmp_path / "venv" / "bin").mkdir(parents=True)
        (tmp_path / "venv" / "bin" / "python").touch()

    monkeypatch.setattr(parity, "COMLRL_VENV", tmp_path / "venv")
    monkeypatch.setattr(parity.subprocess, "run", setup)
    parity.ensure_comlrl(tmp_path / "venv" / "bin" / "python")
    parity.ensure_comlrl(tmp_path / "venv" / "bin" / "python")  # there now: nothing to do
    assert made == [(str(parity.ROOT / "scripts" / "setup_comlrl.sh"), str(tmp_path / "venv"))]
    with pytest.raises(SystemExit, match="--comlrl-python .* does not exist"):
        parity.ensure_comlrl(tmp_path / "elsewhere" / "python")  # a path of the user's: not made
