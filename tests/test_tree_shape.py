"""The real tree expander driven by a fake backend and a fake env (no model).

Expected counts come from closed-form formulas written here: with J joint actions per node, s of
which stop early and c = J - s continue, a tree has c^t nodes at turn t, and its leaves are the s
stopped joint actions of every non-final node plus all J joint actions of every final-turn node.
"""
from __future__ import annotations

import numpy as np
import pytest

from magrpo.advantage import assign_advantages
from magrpo.rollout import expand_trees
from magrpo.tree import count_leaves, tree_size
from tests.fakes import (
    PROBLEMS,
    SAMPLING,
    TEXT,
    B,
    FakeBackend,
    FakeEnv,
    RecordingFeedback,
    advantage_settings,
    serial,
    sum_of_indices,
    tree_settings,
)


def run(mode, n, t, k, threshold=None, reward=sum_of_indices, problems=PROBLEMS, expand="all", seed=None):
    env, backend, fb = FakeEnv(n, reward), FakeBackend(), RecordingFeedback()
    rollout = expand_trees(problems, env, backend, serial(fb, env),
                           tree_settings(num_generations=k, num_turns=t, joint_mode=mode,
                                         early_termination_threshold=threshold, expand=expand), SAMPLING, seed=seed)
    return rollout, env, backend, fb


def num_joint(mode, k, n):
    return k if mode == "align" else k**n


def chosen(node, j):
    return [node.completions[a][node.joint[j][a]].text for a in range(len(node.completions))]


# ---------------------------------------------------------------- shape without early termination

SHAPES = [(mode, n, t, 2) for mode in ("align", "cross") for n in (1, 2, 3) for t in (1, 2, 3)]
SHAPES += [("align", 2, 3, 3), ("cross", 2, 2, 3), ("cross", 3, 2, 3)]


@pytest.mark.parametrize("mode, n, t, k", SHAPES)
def test_tree_shape_and_call_counts(mode, n, t, k):
    rollout, env, backend, fb = run(mode, n, t, k)
    nodes = rollout.nodes
    j = num_joint(mode, k, n)
    per_turn = [B * j**turn for turn in range(t)]  # nodes at each turn, all trees together

    assert len(nodes) == sum(per_turn)
    assert [sum(node.turn == turn for node in nodes) for turn in range(t)] == per_turn
    for b in range(B):
        assert count_leaves([node for node in nodes if node.tree == b]) == (k if mode == "align" else k**n) ** t
    # batching: one generate and one reward call per turn, each covering every node of the turn
    assert backend.generate_calls == t
    assert backend.requests_per_call == [p * n for p in per_turn]
    assert env.reward_calls == t
    assert env.reward_batch_sizes == [p * j for p in per_turn]
    # one feedback call per expanding branch = every non-root node
    expanding = sum(c is not None for node in nodes for c in node.children)
    assert len(fb.calls) == expanding == sum(per_turn[1:])
    assert backend.sync_calls == 0
    # the start-up estimate is exact when nothing stops early
    assert tree_size(mode, k, n, t) == (len(nodes) // B, len(nodes) // B * n * k)


def test_tree_size_by_hand():
    assert tree_size("cross", 3, 3, 3) == (1 + 27 + 27**2, 757 * 3 * 3)  # the N=3, K=3, T=3: 757 nodes
    assert tree_size("align", 4, 2, 2) == (1 + 4, 5 * 2 * 4)


def test_a_tree_above_the_cap_is_a_config_error_before_any_model_loads(make_cfg):
    from magrpo.config import ConfigError
    from magrpo.trainer import prepare

    big = ("trainer.joint_mode=cross", "trainer.num_turns=3", "trainer.num_generations=3", "env.num_agents=3",
           "trainer.batch_size=4")
    with pytest.raises(ConfigError, match=r"trainer.max_sequences_per_step: this tree samples 27,252 completions per "
                                          r"step \(3,028 nodes: cross mode, N=3, K=3, T=3, batch 4\), "
                                          r"above the cap of 20,000"):
        prepare(make_cfg(*big))
    prepare(make_cfg(*big, "trainer.max_sequences_per_step=0"))  # no cap
    prepare(make_cfg(*big, "trainer.max_sequences_per_step=30000"))


@pytest.mark.parametrize("mode, n, t, k",
                         [("align", 2, 3, 2), ("cross", 2, 2, 2), ("cross", 3, 2, 3), ("align", 1, 2, 3)])
def test_node_contents_and_links(mode, n, t, k):
    rollout, env, backend, _ = run(mode, n, t, k)
    nodes = rollout.nodes
    j = num_joint(mode, k, n)
    for node_id, node in enumerate(nodes):
        assert node.joint.shape == (j, n)
        assert len(node.completions) == n and all(len(c) == k for c in node.completions)
        # every completion came from a request for this node's prompt and this agent
        for a in range(n):
            for c in node.completions[a]:
                uid = int(TEXT.match(c.text).group(3))
                assert backend.origin[uid] == (node.prompts[a], a)
        # each joint action's reward was computed on that joint action's texts and its own problem
        expected = [sum_of_indices(PROBLEMS[node.tree], chosen(node, jj)) for jj in range(j)]
        np.testing.assert_allclose(node.rewards, expected)
        assert len(node.children) == j
        # parent/children links agree, children are created turn by turn after their parent
        for jj, child in enumerate(node.children):
            if child is not None:
                assert child > node_id
                assert nodes[child].parent == (node_id, jj)
                assert nodes[child].turn == node.turn + 1 and nodes[child].tree == node.tree
        if node.parent is None:
            assert node.turn == 0 and node.prompts == env.agent_prompts(PROBLEMS[node.tree])
        else:
            pid, pj = node.parent
            assert nodes[pid].children[pj] == node_id
    assert [node.tree for node in nodes if node.turn == 0] == list(range(B))


# ---------------------------------------------------------------- early termination


def leaves_with_stops(j, s, t):
    """Per tree, when s of the J joint actions of every non-final node stop: c = J - s continue."""
    c = j - s
    return sum(c**turn * s for turn in range(t - 1)) + c ** (t - 1) * j


@pytest.mark.parametrize(
    "mode, n, t, threshold, stops",
    [
        # align K=2 N=2: joint sums [0, 2] (+0.25 for P1); >= 2 stops joint 1 -> s = 1
        ("align", 2, 3, 2.0, 1),
        # cross K=2 N=2: sums [0, 1, 1, 2]; >= 1 stops three of four -> s = 3
        ("cross", 2, 2, 1.0, 3),
        # >= 2 stops only (1, 1) -> s = 1, c = 3
        ("cross", 2, 3, 2.0, 1),
        # N=1 align: sums [0, 1]; >= 0.5 stops k=1
        ("align", 1, 3, 0.5, 1),
    ],
)
def test_early_termination_prunes_branches(mode, n, t, threshold, stops):
    rollout, env, backend, fb = run(mode, n, t, 2, threshold)
    nodes = rollout.nodes
    j = num_joint(mode, 2, n)
    c = j - stops
    for b in range(B):
        tree = [node for node in nodes if node.tree == b]
        # e.g. align T=3, s=1: 1 + 1 + 2 = 4 leaves instead of 8; cross T=3, s=1: 1 + 3 + 9*4 = 40 instead of 64
        assert count_leaves(tree) == leaves_with_stops(j, stops, t)
        assert len(tree) == sum(c**turn for turn in range(t))
    for node in nodes:
        over = node.rewards >= threshold
        if node.turn < t - 1:
            np.testing.assert_array_equal(node.terminated, over)
            assert [ch is None for ch in node.children] == list(over)
        else:
            assert not node.terminated.any()
            assert all(ch is None for ch in node.children)
    assert any(node.turn == t - 1 and (node.rewards >= threshold).any() for node in nodes)  # not vacuous
    assert rollout.terminated_per_turn == [B * c**turn * stops for turn in range(t - 1)] + [0]
    assert len(fb.calls) == sum(ch is not None for node in nodes for ch in node.children)
    assert backend.generate_calls == t and env.reward_calls == t


def test_early_termination_threshold_is_per_joint_action_reward():
    # align K=2 N=2, threshold 2.1: P0's best joint scores 2 (continues), P1's scores 2.25 (stops)
    rollout, *_ = run("align", 2, 2, 2, threshold=2.1)
    roots = [node for node in rollout.nodes if node.turn == 0]
    assert roots[0].children[1] is not None and not roots[0].terminated[1]
    assert roots[1].children[1] is None and roots[1].terminated[1]
    assert count_leaves([nd for nd in rollout.nodes if nd.tree == 0]) == 4
    assert count_leaves([nd for nd in rollout.nodes if nd.tree == 1]) == 1 + 2


@pytest.mark.parametrize("mode", ["align", "cross"])
def test_no_threshold_nothing_terminates(mode):
    rollout, *_ = run(mode, 2, 3, 2, threshold=None)
    for node in rollout.nodes:
        assert not node.terminated.any()
        if node.turn < 2:
            assert all(ch is not None for ch in node.children)
    assert rollout.terminated_per_turn == [0, 0, 0]


def test_all_branches_terminate_stops_early():
    # threshold below every reward: only turn 0 is generated and scored
    rollout, env, backend, fb = run("cross", 2, 3, 2, threshold=-1.0)
    assert len(rollout.nodes) == B
    assert backend.generate_calls == 1 and env.reward_calls == 1 and fb.calls == []
    assert count_leaves(rollout.nodes) == B * 4


# ---------------------------------------------------------------- feedback contract


def test_feedback_receives_branch_histories():
    rollout, env, backend, fb = run("cross", 2, 3, 2)
    nodes = rollout.nodes
    by_return = {tuple(call["returned"]): call for call in fb.calls}
    root = [nd for nd in nodes if nd.tree == 1 and nd.turn == 0][0]
    j0, j1 = 1, 2  # (0, 1) at turn 0, then (1, 0) at turn 1: agents choose different completions
    c1 = nodes[root.children[j0]]
    c2 = nodes[c1.children[j1]]
    r0 = [root.completions[0][0].text, root.completions[1][1].text]  # joint (0, 1)
    r1 = [c1.completions[0][1].text, c1.completions[1][0].text]  # joint (1, 0)
    assert r0 == chosen(root, j0) and r1 == chosen(c1, j1)

    first = by_return[tuple(c1.prompts)]  # the call that made c1
    assert first["prompt"] == "P1" and first["num_agents"] == 2
    assert first["agent_completions"] == r0
    assert first["prompt_history_per_agent"] == [["P1::agent0"], ["P1::agent1"]]
    assert first["response_history_per_agent"] == [[r0[0]], [r0[1]]]

    second = by_return[tuple(c2.prompts)]  # the call that made c2
    assert second["prompt"] == "P1" and second["num_agents"] == 2
    assert second["agent_completions"] == r1
    assert second["prompt_history_per_agent"] == [["P1::agent0", c1.prompts[0]], ["P1::agent1", c1.prompts[1]]]
    assert second["response_history_per_agent"] == [[r0[0], r1[0]], [r0[1], r1[1]]]

    # the node keeps the same branch history, with its own prompt appended
    assert c2.prompt_history == [["P1::agent0", c1.prompts[0], c2.prompts[0]],
                                 ["P1::agent1", c1.prompts[1], c2.prompts[1]]]
    assert c2.response_history == [[r0[0], r1[0]], [r0[1], r1[1]]]
    assert c1.prompts[0].startswith("fb") and c1.prompts != c2.prompts


@pytest.mark.parametrize("bad", [lambda n: ["only one"], lambda n: ["x"] * (n + 1), lambda n: "not a list"])
def test_feedback_with_wrong_prompt_count_names_the_function(bad):
    def my_bad_feedback(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        return bad(num_agents)

    with pytest.raises(Exception, match="my_bad_feedback"):
        expand_trees(PROBLEMS, FakeEnv(2), FakeBackend(), serial(my_bad_feedback, FakeEnv(2)),
                     tree_settings(num_generations=2, num_turns=2, joint_mode="align"), SAMPLING)


# ---------------------------------------------------------------- assign_advantages


def test_assign_advantages_align_by_hand():
    # one problem, align K=2 N=2, T=2, rewards = k_0 + k_1: every node's joints score [0, 2]
    # leaves: G = [0, 2], mean 1 ; root: G = [0 + 0.5*1, 2 + 0.5*1] = [0.5, 2.5]
    # per agent, completion j gets G_j; mean baseline: [-1, 1] at the root and at every leaf node
    rollout, *_ = run("align", 2, 2, 2, problems=PROBLEMS[:1])
    nodes = rollout.nodes
    zero = assign_advantages(nodes, advantage_settings(discount=0.5, cross_credit="mean", baseline="mean",
                                                       scale="none"))
    root = nodes[0]
    np.testing.assert_allclose(root.returns, [0.5, 2.5])
    for j, ch in enumerate(root.children):
        assert root.returns[j] == root.rewards[j] + 0.5 * np.mean(nodes[ch].returns)
    for node in nodes:
        assert node.advantages.shape == (2, 2)
        np.testing.assert_allclose(node.advantages, [[-1, 1], [-1, 1]])
    for node in nodes[1:]:
        np.testing.assert_allclose(node.returns, node.rewards)
    assert zero.shape == (len(nodes), 2) and not zero.any()


@pytest.mark.parametrize("how, turn1, root", [
    # one problem, align K=2 N=2, T=3, gamma 0.5, threshold 2: every node's joints score [0, 2], joint 1 stops
    # early at turns 0 and 1, joint 0 goes on. Turn 2 (leaves): G = [0, 2], mean 1.
    # reward: turn 1 G = [0 + 0.5*1, 2] (mean 1.25); root G = [0 + 0.5*1.25, 2]
    ("reward", [0.5, 2.0], [0.625, 2.0]),
    # repeat: turn 1's stopped joint skipped 1 turn: 2 * (1 + 0.5) = 3 -> G = [0.5, 3] (mean 1.75);
    # the root's skipped 2: 2 * (1 + 0.5 + 0.25) = 3.5 -> G = [0 + 0.5*1.75, 3.5]
    ("repeat", [0.5, 3.0], [0.875, 3.5]),
])
def test_early_termination_return_by_hand(how, turn1, root):
    rollout, *_ = run("align", 2, 3, 2, threshold=2.0, problems=PROBLEMS[:1])
    nodes = rollout.nodes
    assert [node.turn for node in nodes] == [0, 1, 2]
    assign_advantages(nodes, advantage_settings(discount=0.5, early_termination_return=how, num_turns=3))
    np.testing.assert_allclose(nodes[2].returns, [0.0, 2.0])
    np.testing.assert_allclose(nodes[1].returns, turn1)
    np.testing.assert_allclose(nodes[0].returns, root)
    assert [list(node.early) for node in nodes] == [[False, True], [False, True], [False, False]]


def test_assign_advantages_cross_by_hand():
    # one problem, cross K=2 N=2, T=2, gamma 1: joints (0,0),(0,1),(1,0),(1,1) score [0, 1, 1, 2]
    # leaves G = [0, 1, 1, 2], mean 1 -> root G = [1, 2, 2, 3]
    # mean credit, agent 0: k0 -> (1+2)/2 = 1.5, k1 -> (2+3)/2 = 2.5; agent 1 the same
    # rloo with K=2: [1.5 - 2.5, 2.5 - 1.5] = [-1, 1]; std = 0.5 -> [-1, 1] / (0.5 + 1e-6)
    rollout, *_ = run("cross", 2, 2, 2, problems=PROBLEMS[:1])
    nodes = rollout.nodes
    zero = assign_advantages(nodes, advantage_settings(discount=1.0, cross_credit="mean", baseline="rloo", scale="std"))
    np.testing.assert_allclose(nodes[0].returns, [1, 2, 2, 3])
    np.testing.assert_allclose(nodes[0].advantages, np.array([[-1, 1], [-1, 1]]) / (0.5 + 1e-6))
    assert len(nodes) == 5 and all(node.advantages.shape == (2, 2) for node in nodes)
    assert zero.shape == (5, 2) and not zero.any()


def test_assign_advantages_flags_zero_variance_groups():
    # constant reward: every group is flat -> advantage exactly 0, every group flagged
    rollout, *_ = run("cross", 3, 2, 2, reward=lambda problem, texts: 1.0)
    zero = assign_advantages(rollout.nodes, advantage_settings(discount=1.0, cross_credit="sum", baseline="none",
                                                               scale="none"))
    assert zero.shape == (len(rollout.nodes), 3) and zero.all()
    for node in rollout.nodes:
        assert node.advantages.shape == (3, 2) and np.all(node.advantages == 0.0)


# ---------------------------------------------------------------- tree budgets (trainer.expand)

@pytest.mark.parametrize("mode, n, t, k, rule, children", [
    ("align", 2, 3, 4, "top:2", 2), ("cross", 2, 3, 2, "top:1", 1), ("cross", 2, 2, 3, "random:4", 4),
    ("align", 2, 3, 2, "top:5", 2),  # M above J: every joint action, as "all"
])
def test_expand_rules_give_exact_node_and_leaf_counts(mode, n, t, k, rule, children):
    rollout, _, backend, fb = run(mode, n, t, k, expand=rule, seed=7)
    nodes, j = rollout.nodes, num_joint(mode, k, n)
    for b in range(B):
        tree = [node for node in nodes if node.tree == b]
        assert len(tree) == sum(children**turn for turn in range(t))
        # every joint action of every node is a leaf but the `children` expanded ones of non-final nodes
        assert count_leaves(tree) == len(tree) * j - sum(children**turn for turn in range(1, t))
    assert len(fb.calls) == B * sum(children**turn for turn in range(1, t))
    assert tree_size(mode, k, n, t, rule) == (len(nodes) // B, len(nodes) // B * n * k)
    assert not any(node.terminated.any() for node in nodes)  # left out, not terminated


def test_top_expands_the_highest_rewards_and_leaves_are_their_own_return():
    rollout, *_ = run("cross", 2, 2, 2, expand="top:1")
    for node in [n for n in rollout.nodes if n.turn == 0]:
        # sums [0, 1, 1, 2] (+ offset): only the joint action (1, 1) expands; ties would go to the lower index
        assert [c is not None for c in node.children] == [False, False, False, True]
    assign_advantages(rollout.nodes, advantage_settings(discount=1.0, cross_credit="mean", baseline="mean",
                                                        scale="none"))
    root = rollout.nodes[0]
    np.testing.assert_allclose(root.returns[:3], root.rewards[:3])  # leaves: G = r
    assert root.returns[3] == root.rewards[3] + rollout.nodes[root.children[3]].returns.mean()


def test_random_expansion_is_seeded_per_node_and_applies_after_early_termination():
    first = run("cross", 2, 3, 2, expand="random:2", seed=3)[0]
    again = run("cross", 2, 3, 2, expand="random:2", seed=3)[0]
    picks = [[c is not None for c in node.children] for node in first.nodes]
    assert picks == [[c is not None for c in node.children] for node in again.nodes]
    assert picks != [[c is not None for c in node.children] for node in run("cross", 2, 3, 2, expand="random:2",
                                                                            seed=4)[0].nodes]
    # threshold 2 stops (1, 1) first; random:3 then expands the other three
    rollout = run("cross", 2, 2, 2, threshold=2.0, expand="random:3", seed=3)[0]
    for node in [n for n in rollout.nodes if n.turn == 0]:
        assert [c is not None for c in node.children] == [True, True, True, False]


@pytest.mark.parametrize("rule", ["top", "top:0", "random:x", "best:2", "top:-1"])
def test_a_bad_expand_rule_is_a_config_error(make_cfg, rule):
    from magrpo.config import ConfigError
    from magrpo.trainer import prepare

    with pytest.raises(ConfigError,
                       match=r"trainer.expand: .* is not an expansion rule; choose one of: all, top:M, random:M"):
        prepare(make_cfg(f"trainer.expand='{rule}'"))
