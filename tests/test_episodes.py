"""Environment-owned episodes (issue 31, point 6): the env ends a branch with Scored.done, and
trainer.stop_on_truncation ends a branch whose joint action holds a completion cut at max_new_tokens.
Either makes the joint action a leaf like early termination: its reward is its return.

Exact counts (B = 2 problems, N = 2 agents, K = 2): with c of a node's J joint actions going on, a
tree has c^t nodes at turn t; its leaves are the J - c stopped joint actions of every non-final node
plus all J of every final-turn node. A stop at the last turn is no stop: every joint action there is
a leaf anyway, so the done/truncated counts leave it out.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from magrpo.advantage import assign_advantages
from magrpo.config import TrainConfig
from magrpo.env import Scored
from magrpo.errors import RewardError
from magrpo.evaluation import run_paths
from magrpo.rollout import TreeSettings, expand_trees
from magrpo.run_io import tree_records
from magrpo.trainer import _metrics
from magrpo.tree import count_leaves
from tests.fakes import (
    PROBLEMS,
    SAMPLING,
    TEXT,
    FakeBackend,
    FakeEnv,
    advantage_settings,
    serial,
    sum_of_indices,
    tree_settings,
)


def k_of(text: str) -> int:
    return int(TEXT.match(text).group(2))


class DoneEnv(FakeEnv):
    """Ends the episode of every joint action whose agent 0 chose its completion k=0."""

    def __init__(self, n: int, done=lambda texts: k_of(texts[0]) == 0):
        super().__init__(n)
        self.done = done

    def score(self, problems, joint_completions):
        return [Scored(r, {"reward": r}, done=self.done(texts))
                for r, texts in zip(map(sum_of_indices, problems, joint_completions), joint_completions)]


def plain_feedback(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    return [f"again {i}" for i in range(num_agents)]


def expand(env, mode, turns, backend=None, **settings):
    tree = tree_settings(num_generations=2, num_turns=turns, joint_mode=mode, **settings)
    rollout = expand_trees(PROBLEMS, env, backend or FakeBackend(), serial(plain_feedback, env), tree, SAMPLING)
    assign_advantages(rollout.nodes, advantage_settings())
    return rollout


def counts(rollout) -> dict[str, int]:
    metrics = _metrics(rollout, [], max(n.turn for n in rollout.nodes) + 1)
    return {"nodes": len(rollout.nodes), "leaves": count_leaves(rollout.nodes),
            "done": metrics["tree/done_leaves"], "truncated": metrics["tree/truncated_leaves"],
            "terminated_per_turn": rollout.terminated_per_turn}


# ------------------------------------------------------------------------------ the env's done


def test_done_ends_the_branch_align():
    # J = 2, joint action 0 done: c = 1; nodes 2 + 2 + 2; leaves 2 x (1 + 1) stopped + 2 x 2 at turn 2
    rollout = expand(DoneEnv(2), "align", 3)
    assert counts(rollout) == {"nodes": 6, "leaves": 8, "done": 4, "truncated": 0, "terminated_per_turn": [2, 2, 0]}


def test_done_ends_the_branch_cross():
    # J = 4, (0,0) and (0,1) done: c = 2; nodes 2 + 4; leaves 2 x 2 stopped + 4 x 4 at turn 1
    rollout = expand(DoneEnv(2), "cross", 2)
    assert counts(rollout) == {"nodes": 6, "leaves": 20, "done": 4, "truncated": 0, "terminated_per_turn": [4, 0]}


def test_a_done_leaf_returns_its_reward_and_the_others_their_childrens_mean():
    rollout = expand(DoneEnv(2), "align", 2)
    root = rollout.nodes[0]
    assert root.done.tolist() == [True, False] and root.children[0] is None
    assert root.returns[0] == root.rewards[0]  # a leaf: G = r
    child = rollout.nodes[root.children[1]]
    assert root.returns[1] == pytest.approx(root.rewards[1] + child.returns.mean())


def test_done_false_and_none_let_the_branch_go_on():
    for value in (False, None):
        assert counts(expand(DoneEnv(2, done=lambda texts, v=value: v), "align", 2))["nodes"] == 2 + 4


def test_done_of_the_wrong_type_is_one_line_naming_the_env_method():
    with pytest.raises(RewardError) as caught:
        expand(DoneEnv(2, done=lambda texts: "yes"), "align", 2)
    message = str(caught.value)
    assert "DoneEnv.score" in message and "done must be True, False or None, got 'yes'" in message
    assert "\n" not in message


def test_numpy_bools_are_a_done():
    assert counts(expand(DoneEnv(2, done=lambda texts: np.bool_(k_of(texts[0]) == 0)), "align", 3))["done"] == 4


# ------------------------------------------------------------------------------ stop_on_truncation


def agent1_k0_cut(agent: int, k: int) -> bool:
    return agent == 1 and k == 0


def test_stop_on_truncation_ends_a_joint_action_when_any_agent_was_cut():
    # cross: agent 1's k=0 is cut, agent 0 never: (0,0) and (1,0) stop, c = 2; nodes 2 + 4, leaves 4 + 16
    rollout = expand(FakeEnv(2), "cross", 2, FakeBackend(cut=agent1_k0_cut), stop_on_truncation=True)
    assert counts(rollout) == {"nodes": 6, "leaves": 20, "done": 0, "truncated": 4, "terminated_per_turn": [4, 0]}
    root = rollout.nodes[0]
    assert root.truncated.tolist() == [True, False, True, False]


def test_stop_on_truncation_align_three_turns():
    # align: joint action 0 holds agent 1's cut k=0: c = 1; nodes 2 + 2 + 2, leaves 2 + 2 + 4
    rollout = expand(FakeEnv(2), "align", 3, FakeBackend(cut=agent1_k0_cut), stop_on_truncation=True)
    assert counts(rollout) == {"nodes": 6, "leaves": 8, "done": 0, "truncated": 4, "terminated_per_turn": [2, 2, 0]}


def test_truncated_completions_go_on_when_stop_on_truncation_is_off():
    rollout = expand(FakeEnv(2), "cross", 2, FakeBackend(cut=agent1_k0_cut), stop_on_truncation=False)
    assert counts(rollout) == {"nodes": 2 + 8, "leaves": 32, "done": 0, "truncated": 0, "terminated_per_turn": [0, 0]}


def test_stop_on_truncation_is_off_by_default_and_read_from_the_config():
    assert TrainConfig().trainer.stop_on_truncation is False
    cfg = TrainConfig()
    cfg.trainer.stop_on_truncation = True
    assert TreeSettings.of(cfg).stop_on_truncation is True


def test_a_branch_both_done_and_truncated_counts_under_each():
    env = DoneEnv(2, done=lambda texts: k_of(texts[1]) == 0)
    rollout = expand(env, "cross", 2, FakeBackend(cut=agent1_k0_cut), stop_on_truncation=True)
    assert counts(rollout) == {"nodes": 6, "leaves": 20, "done": 4, "truncated": 4, "terminated_per_turn": [4, 0]}


def test_a_bad_stop_on_truncation_is_one_config_line(run_cli):
    code, err = run_cli("trainer.stop_on_truncation=maybe")
    assert code == 2 and len(err) == 1 and "trainer.stop_on_truncation" in err[0], err


def test_evaluation_paths_stop_on_truncation_as_training_does():
    calls = []

    def fb(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        calls.append(prompt)
        return ["again"] * num_agents

    env = FakeEnv(2)
    for stop, expected in ((False, 2), (True, 0)):  # one path per problem; agent 1 is always cut
        calls.clear()
        paths = run_paths(PROBLEMS, env, FakeBackend(cut=lambda agent, k: agent == 1), serial(fb, env), 2, SAMPLING,
                          stop_on_truncation=stop)
        assert len(calls) == expected and len(paths[1]) == 2  # a stopped path's answer stands for turn 1


def test_the_documented_score_example_ends_a_solved_episode():
    doc = (Path(__file__).parent.parent / "docs" / "environments.md").read_text()
    block = doc.split("## Episodes the env ends")[1].split("```python\n")[1].split("```")[0]
    head, method = block.split("\n\n", 1)  # the import, then the method (indented as in a class)
    namespace = {"FakeEnv": FakeEnv}
    exec(f"{head}\n\nclass Documented(FakeEnv):\n{method}", namespace)
    # FakeBackend numbers completions in order: agent 1's k=1 at the root is the 4th, "a1k1u4"
    rollout = expand_trees([{"prompt": "P", "answer": "a1k1u4"}], namespace["Documented"](2),
                           FakeBackend(cut=agent1_k0_cut), serial(plain_feedback, FakeEnv(2)),
                           tree_settings(num_generations=2, num_turns=2), SAMPLING)
    root = rollout.nodes[0]
    assert root.rewards.tolist() == [-0.5, 1.0] and root.done.tolist() == [False, True]
    assert len(rollout.nodes) == 2  # only the unsolved joint action got a child


def test_rollout_records_say_what_ended_a_branch_and_nothing_otherwise():
    rollout = expand(DoneEnv(2, done=lambda texts: k_of(texts[1]) == 0), "cross", 2,
                     FakeBackend(cut=agent1_k0_cut), stop_on_truncation=True)
    root = tree_records(1, rollout.problems, rollout.nodes)[0]["nodes"][0]
    ended = [{k: ja[k] for k in ("done", "truncated") if k in ja} for ja in root["joint_actions"]]
    assert ended == [{"done": True, "truncated": True}, {}, {"done": True, "truncated": True}, {}]
    plain = expand(FakeEnv(2), "align", 2)
    nodes = tree_records(1, plain.problems, plain.nodes)[0]["nodes"]
    assert not any("done" in ja or "truncated" in ja for node in nodes for ja in node["joint_actions"])


def test_with_repeat_a_done_branch_counts_its_reward_at_every_turn_it_skipped():
    """`done = solved` with early_termination_return=repeat: the solved branch's reward counts again at
    each turn it skipped, as an early-terminated one's does. Before, done kept G = r, so a sibling that
    scored 0.6 and was fixed next turn (0.6 + 1.0) ranked above the branch solved at once (1.0): the
    flaw `repeat` was made to fix."""
    class Solved(DoneEnv):
        turn = 0

        def score(self, problems, joint_completions):  # turn 0: k=0 solves it (1.0), k=1 half does (0.6); turn 1: fixed
            rewards = [1.0 if self.turn or k_of(texts[0]) == 0 else 0.6 for texts in joint_completions]
            self.turn += 1
            return [Scored(r, {}, done=r == 1.0) for r in rewards]

    env = Solved(2)
    tree = tree_settings(num_generations=2, num_turns=2, joint_mode="align")
    rollout = expand_trees(PROBLEMS[:1], env, FakeBackend(), serial(plain_feedback, env), tree, SAMPLING)
    root = rollout.nodes[0]
    assert root.done.tolist() == [True, False] and root.rewards.tolist() == [1.0, 0.6]
    assign_advantages(rollout.nodes, advantage_settings(discount=1.0, early_termination_return="repeat",
                                                        num_turns=2))
    child = rollout.nodes[root.children[1]]
    assert root.returns.tolist() == pytest.approx([2.0, 0.6 + child.returns.mean()])
    assert root.returns[0] >= root.returns[1]
    assign_advantages(rollout.nodes, advantage_settings(discount=1.0, num_turns=2))  # reward: G = r
    assert root.returns[0] == 1.0
