"""Credit options (issue 16, point 5): AT-GRPO's agent-and-turn groups (trainer.group_by) and
per-agent rewards mixed with the team reward (reward.team_weight). Expected values by hand."""
from __future__ import annotations

import numpy as np
import pytest

from magrpo.advantage import agent_credit, assign_advantages, mix_rewards, pooled_advantages
from magrpo.config import ConfigError
from magrpo.env import Scored
from magrpo.rollout import RewardError, expand_trees
from magrpo.trainer import prepare, train
from magrpo.tree import Completion, Node, align_joint_actions, cross_joint_actions
from tests.fakes import (
    PROBLEMS,
    SAMPLING,
    TEXT,
    FakeBackend,
    FakeEnv,
    RecordingFeedback,
    advantage_settings,
    serial,
    tree_settings,
)
from tests.test_train_smoke import read_jsonl

ALIGN = align_joint_actions(2, 2)


def node(tree, turn, rewards, children, agent_rewards=None):
    """An align node, N = 2 agents, K = 2 (the completions' contents do not matter here)."""
    c = Completion([], "", [], True)
    return Node(tree=tree, turn=turn, parent=None, prompts=["", ""], prompt_history=[], response_history=[],
                completions=[[c, c], [c, c]], joint=ALIGN, rewards=np.array(rewards, dtype=float), children=children,
                agent_rewards=None if agent_rewards is None else np.array(agent_rewards, dtype=float))


# ---------------------------------------------------------------- pure pieces


def test_mix_rewards_by_hand():
    # team [0, 2], own [[4, 0], [2, 6]], w = 0.25: 0.25 * team + 0.75 * own = [[3, 0], [2, 5]]
    np.testing.assert_allclose(mix_rewards(np.array([0.0, 2.0]), np.array([[4.0, 0.0], [2.0, 6.0]]), 0.25),
                               [[3.0, 0.0], [2.0, 5.0]])


def test_agent_credit_uses_each_agents_own_returns():
    # cross K=2 N=2: joints (0,0), (0,1), (1,0), (1,1); agent 0's returns [1, 2, 3, 4], agent 1's [10, 0, 10, 0]
    # mean credit: agent 0 k0 = (1+2)/2 = 1.5, k1 = (3+4)/2 = 3.5; agent 1 k0 = (10+10)/2 = 10, k1 = 0
    returns = np.array([[1.0, 10.0], [2.0, 0.0], [3.0, 10.0], [4.0, 0.0]])
    np.testing.assert_allclose(agent_credit(cross_joint_actions(2, 2), returns, 2, "mean"), [[1.5, 3.5], [10.0, 0.0]])
    # a (J,) team return [1, 2, 3, 4] credits both agents from the same numbers, as before:
    # agent 1 k0 = joints (0,0), (1,0) = (1+3)/2 = 2, k1 = (2+4)/2 = 3
    np.testing.assert_allclose(
        agent_credit(cross_joint_actions(2, 2), returns[:, 0], 2, "mean"), [[1.5, 3.5], [2.0, 3.0]]
    )


def test_pooled_advantages_one_group_per_agent_over_the_pool():
    # agent 0 over two nodes: [1, 3] + [5, 7], mean 4 -> [-3, -1], [1, 3]; agent 1: [2, 2] + [2, 2]: flat -> 0
    advs, zeros = pooled_advantages(
        [np.array([[1.0, 3.0], [2.0, 2.0]]), np.array([[5.0, 7.0], [2.0, 2.0]])], "mean", "none"
    )
    np.testing.assert_allclose(advs[0], [[-3.0, -1.0], [0.0, 0.0]])
    np.testing.assert_allclose(advs[1], [[1.0, 3.0], [0.0, 0.0]])
    assert [z.tolist() for z in zeros] == [[False, True], [False, True]]


# ---------------------------------------------------------------- group_by


def two_trees():
    # tree 0: root (id 0) rewards [0, 0], both joints expand to ids 2 and 3 with rewards [1, 3] and [5, 7];
    # tree 1: a lone root (id 1) with rewards [10, 10]
    return [node(0, 0, [0, 0], [2, 3]), node(1, 0, [10, 10], [None, None]),
            node(0, 1, [1, 3], [None, None]), node(0, 1, [5, 7], [None, None])]


def test_group_by_node_by_hand():
    # returns: leaves as rewards; tree 0's root [0 + mean(1, 3), 0 + mean(5, 7)] = [2, 6] -> adv [-2, 2]
    nodes = two_trees()
    zero = assign_advantages(nodes, advantage_settings(discount=1.0, cross_credit="mean", baseline="mean",
                                                       scale="none", group_by="node"))
    np.testing.assert_allclose(nodes[0].returns, [2.0, 6.0])
    for n, want in zip(nodes, ([-2, 2], [0, 0], [-1, 1], [-1, 1])):
        np.testing.assert_allclose(n.advantages, [want, want])  # align: both agents see the same values
    assert zero[:, 0].tolist() == [False, True, False, False]


def test_group_by_agent_turn_pools_the_nodes_of_one_turn_of_one_tree():
    # turn 1 of tree 0: [1, 3, 5, 7], mean 4 -> [-3, -1] and [1, 3]; the two roots stay apart (different
    # trees): tree 0's [-2, 2], tree 1's flat [10, 10] -> 0 (pooled together they would not be)
    nodes = two_trees()
    zero = assign_advantages(nodes, advantage_settings(discount=1.0, cross_credit="mean", baseline="mean",
                                                       scale="none", group_by="agent_turn"))
    for n, want in zip(nodes, ([-2, 2], [0, 0], [-3, -1], [1, 3])):
        np.testing.assert_allclose(n.advantages, [want, want])
    assert zero[:, 1].tolist() == [False, True, False, False]


# ---------------------------------------------------------------- per-agent rewards


def per_agent_tree():
    # root: team [0, 0], own [[0, 4], [2, 0]] (joint 0: agent 0 gets 0, agent 1 gets 4); joint 0 expands
    # to a leaf node with team [2, 4], own [[0, 2], [6, 2]]
    return [node(0, 0, [0, 0], [1, None], [[0, 4], [2, 0]]), node(0, 1, [2, 4], [None, None], [[0, 2], [6, 2]])]


def test_per_agent_rewards_mixed_by_team_weight_by_hand():
    # w = 0.5: root mixed [[0, 2], [1, 0]], leaf mixed [[1, 2], [5, 3]]
    # leaf returns = mixed; their means per agent: (1+5)/2 = 3, (2+3)/2 = 2.5
    # root returns: joint 0 [0 + 3, 2 + 2.5] = [3, 4.5], joint 1 (a leaf) [1, 0]
    # credit (align): agent 0 [3, 1] -> [1, -1]; agent 1 [4.5, 0] -> [2.25, -2.25]
    # leaf: agent 0 [1, 5] -> [-2, 2]; agent 1 [2, 3] -> [-0.5, 0.5]; team returns stay [3, 0] and [2, 4]
    nodes = per_agent_tree()
    assign_advantages(nodes, advantage_settings(discount=1.0, cross_credit="mean", baseline="mean", scale="none",
                                                team_weight=0.5))
    np.testing.assert_allclose(nodes[0].agent_returns, [[3.0, 4.5], [1.0, 0.0]])
    np.testing.assert_allclose(nodes[0].returns, [3.0, 0.0])
    np.testing.assert_allclose(nodes[0].advantages, [[1.0, -1.0], [2.25, -2.25]])
    np.testing.assert_allclose(nodes[1].advantages, [[-2.0, 2.0], [-0.5, 0.5]])


def test_team_weight_one_is_the_team_reward_and_zero_is_each_agents_own():
    # w = 1: the team returns [3, 0] for both agents -> [1.5, -1.5]; leaf [2, 4] -> [-1, 1]
    nodes = per_agent_tree()
    assign_advantages(nodes, advantage_settings(discount=1.0, cross_credit="mean", baseline="mean", scale="none",
                                                team_weight=1.0))
    assert nodes[0].agent_returns is None
    np.testing.assert_allclose(nodes[0].advantages, [[1.5, -1.5], [1.5, -1.5]])
    np.testing.assert_allclose(nodes[1].advantages, [[-1.0, 1.0], [-1.0, 1.0]])
    # w = 0: leaf own [[0, 2], [6, 2]], means 3 and 2; root joint 0 [0 + 3, 4 + 2] = [3, 6], joint 1 [2, 0]
    # agent 0 [3, 2] -> [0.5, -0.5]; agent 1 [6, 0] -> [3, -3]
    nodes = per_agent_tree()
    assign_advantages(nodes, advantage_settings(discount=1.0, cross_credit="mean", baseline="mean", scale="none",
                                                team_weight=0.0))
    np.testing.assert_allclose(nodes[0].advantages, [[0.5, -0.5], [3.0, -3.0]])


class PerAgentEnv(FakeEnv):
    """Team reward: the sum of the chosen sample indices k; agent i's own: 10 x its own k."""

    def __init__(self, own=lambda ks: [10.0 * k for k in ks]):
        super().__init__(2)
        self.own = own

    def score(self, problems, joint_completions):
        out = []
        for texts in joint_completions:
            ks = [int(TEXT.match(t).group(2)) for t in texts]
            out.append(Scored(float(sum(ks)), {"reward": float(sum(ks))}, agent_rewards=self.own(ks)))
        return out


def expand(env, team_weight=1.0, on_error="raise", resample=0):
    settings = tree_settings(num_generations=2, num_turns=1, joint_mode="align", on_reward_error=on_error,
                             team_weight=team_weight, resample_zero_std=resample)
    return expand_trees(PROBLEMS[:1], env, FakeBackend(), serial(RecordingFeedback(), env), settings, SAMPLING)


def test_env_per_agent_rewards_reach_the_advantages():
    # align joints (0, 0), (1, 1): team [0, 2], own [[0, 0], [10, 10]]; w = 0.5: mixed [[0, 0], [6, 6]]
    # -> every agent's values [0, 6] -> [-3, 3]
    rollout = expand(PerAgentEnv(), team_weight=0.5)
    (root,) = rollout.nodes
    np.testing.assert_allclose(root.agent_rewards, [[0.0, 0.0], [10.0, 10.0]])
    assign_advantages(rollout.nodes, advantage_settings(discount=1.0, cross_credit="mean", baseline="mean",
                                                        scale="none", team_weight=0.5))
    np.testing.assert_allclose(root.advantages, [[-3.0, 3.0], [-3.0, 3.0]])


def test_bad_per_agent_rewards_are_reward_errors():
    with pytest.raises(RewardError, match=r"agent_rewards must be 2 finite numbers \(one per agent\), got \[0.0\]"):
        expand(PerAgentEnv(own=lambda ks: [0.0]))
    # reward.on_error=zero: joint action (1, 1) scores 0, every agent's own reward too; (0, 0) keeps [5, 6]
    rollout = expand(PerAgentEnv(own=lambda ks: [float("nan"), 1.0] if ks[0] else [5.0, 6.0]), on_error="zero")
    np.testing.assert_allclose(rollout.nodes[0].agent_rewards, [[5.0, 6.0], [0.0, 0.0]])
    assert rollout.reward_errors == 1


class FlatTeamEnv(PerAgentEnv):
    """Team reward 1 everywhere; agent i's own: 10 x its own k."""

    def score(self, problems, joint_completions):
        return [
            Scored(1.0, {"reward": 1.0}, agent_rewards=s.agent_rewards)
            for s in super().score(problems, joint_completions)
        ]


def test_dynamic_sampling_checks_each_agents_own_values():
    # team [1, 1] is flat; with w = 0.5 the agents' values [0.5, 5.5] are not: nothing to regenerate
    assert expand(FlatTeamEnv(), team_weight=1.0, resample=2).resampled_nodes == 2
    assert expand(FlatTeamEnv(), team_weight=0.5, resample=2).resampled_nodes == 0


# ---------------------------------------------------------------- config and end to end


@pytest.mark.parametrize("override, words", [
    ("trainer.group_by=turn", "'turn' is not allowed; choose one of: agent_turn, node"),
    ("reward.team_weight=1.5", "must be in [0, 1], got 1.5"),
])
def test_bad_credit_options_are_one_line_config_errors(make_cfg, override, words):
    with pytest.raises(ConfigError) as info:
        prepare(make_cfg(override))
    assert str(info.value) == f"{override.split('=')[0]}: {words}"


def test_agent_turn_groups_and_per_agent_rewards_end_to_end(make_cfg, monkeypatch):
    from magrpo.envs.length_ratio import LengthRatioEnv

    team_score = LengthRatioEnv.score

    def score(self, problems, joint):  # agent 0 is paid the team reward, agent 1 its complement
        return [
            Scored(s.reward, s.outcomes, s.context, [s.reward, 1 - s.reward]) for s in team_score(self, problems, joint)
        ]

    monkeypatch.setattr(LengthRatioEnv, "score", score)
    run = train(make_cfg("trainer.group_by=agent_turn", "reward.team_weight=0.5", "eval.at_end=false"))
    for tree in read_jsonl(run / "rollouts.jsonl"):
        for n in tree["nodes"]:
            for ja in n["joint_actions"]:
                np.testing.assert_allclose(ja["agent_rewards"], [ja["reward"], 1 - ja["reward"]])
                if ja["child"] is None:  # a leaf's return is its mixed reward: 0.5 r + 0.5 own
                    np.testing.assert_allclose(ja["agent_returns"], [ja["reward"], 0.5])
    metrics = read_jsonl(run / "metrics.jsonl")
    assert all(0 <= m["train/agent_0/reward_mean"] <= 1 for m in metrics)
    for m in metrics:
        np.testing.assert_allclose(m["train/agent_0/reward_mean"] + m["train/agent_1/reward_mean"], 1.0)
