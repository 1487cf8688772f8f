"""Grouped advantage estimator for tree rollouts: pure functions over numpy arrays.

1. Returns flow up the tree: G_j = r_j + gamma * mean(G of the child's joint actions); a leaf's G_j = r_j
   (with trainer.early_termination_return=repeat, an early-stopped one's reward counts at every turn it skipped).
2. Credit per agent: each of an agent's K completions at a node gets one value from the G's of
   the joint actions that contain it (align: exactly one; cross: K^(N-1) of them).
3. Group = one agent's K completions at one node (group_by=node), or at every node of one turn
   of a tree (group_by=agent_turn); a GRPO baseline per group gives advantages.
With per-agent rewards, every agent's returns flow up the tree from its own (team-mixed) rewards.

`ESTIMATORS` holds whole estimators by name (trainer.advantage_estimator), as verl's core_algos do:
`fn(nodes, AdvantageSettings) -> (nodes, N) zero-variance mask`, filling each node's returns and
advantages. `tree_grpo` is the three steps above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

import numpy as np

from .registry import Registry

if TYPE_CHECKING:
    from .tree import Node

STD_EPS = 1e-6
# Groups whose values differ by less than this are "zero-variance": they carry no signal.
ZERO_STD = 1e-8

BASELINES: Registry[Callable[[np.ndarray], np.ndarray]] = Registry("baseline")
CREDITS: Registry[Callable[[np.ndarray, np.ndarray, int], np.ndarray]] = Registry("cross_credit")
SCALES: Registry[Callable[[np.ndarray], np.ndarray]] = Registry("advantage_scale")
# group_key(node index, tree, turn) -> key: nodes with one key pool each agent's completions into one group.
GROUP_BY: Registry[Callable[[int, int, int], Hashable]] = Registry("group_by")


@dataclass(frozen=True)
class AdvantageSettings:
    """What an estimator reads (trainer.* and reward.team_weight; every default lives in magrpo.config)."""

    estimator: str
    discount: float
    cross_credit: str
    baseline: str
    scale: str
    group_by: str
    team_weight: float
    early_termination_return: str = "reward"  # reward | repeat (trainer.early_termination_return)
    num_turns: int = 1  # T, for the turns an early-stopped branch skipped
    user_code_timeout_s: float = 0  # a plugin's estimator, credit rule, baseline, ... (limits.*; 0: no limit)

    @classmethod
    def of(cls, cfg: Any) -> "AdvantageSettings":
        trainer = cfg.trainer
        return cls(estimator=trainer.advantage_estimator, discount=trainer.discount,
                   cross_credit=trainer.cross_credit, baseline=trainer.baseline, scale=trainer.advantage_scale,
                   group_by=trainer.group_by, team_weight=cfg.reward.team_weight,
                   early_termination_return=trainer.early_termination_return, num_turns=trainer.num_turns,
                   user_code_timeout_s=cfg.limits.user_code_timeout_s)


# name -> estimator(nodes, settings): fills node.returns / agent_returns / advantages / zero_std and
# returns the (nodes, N) zero-variance-group mask.
ESTIMATORS: Registry[Callable[["list[Node]", AdvantageSettings], np.ndarray]] = Registry("advantage_estimator")


def assign_advantages(nodes: "list[Node]", settings: AdvantageSettings) -> np.ndarray:
    """The configured estimator over one step's nodes; returns the (nodes, N) zero-variance mask."""
    return ESTIMATORS.hook(settings.estimator, settings.user_code_timeout_s)(nodes, settings)


def tree_returns(
    rewards: Sequence[np.ndarray], children: Sequence[Sequence[int | None]], discount: float
) -> list[np.ndarray]:
    """Returns per node. Node ids index `rewards`/`children`; a child id is always greater than its
    parent's (nodes are created turn by turn), so one reverse sweep sees every child first."""
    returns: list[np.ndarray | None] = [None] * len(rewards)
    for node in reversed(range(len(rewards))):
        g = np.asarray(rewards[node], dtype=np.float64).copy()
        for j, child in enumerate(children[node]):
            if child is not None:
                assert child > node, "child ids must follow their parent's"
                g[j] += discount * float(np.mean(returns[child]))
        returns[node] = g
    return returns  # type: ignore[return-value]


@CREDITS.register("mean")
def mean_credit(joint: np.ndarray, returns: np.ndarray, k: int) -> np.ndarray:
    """(N, K): mean G over the joint actions that contain completion k of agent i."""
    return _credit_sums(joint, returns, k) / _credit_counts(joint, k)


@CREDITS.register("sum")
def sum_credit(joint: np.ndarray, returns: np.ndarray, k: int) -> np.ndarray:
    """(N, K): summed G (CoMLRL parity: scales with K^(N-1) in cross mode)."""
    return _credit_sums(joint, returns, k)


def _credit_sums(joint: np.ndarray, returns: np.ndarray, k: int) -> np.ndarray:
    n = joint.shape[1]
    sums = np.zeros((n, k))
    for i in range(n):
        np.add.at(sums[i], joint[:, i], returns)
    return sums


def _credit_counts(joint: np.ndarray, k: int) -> np.ndarray:
    counts = np.stack([np.bincount(joint[:, i], minlength=k) for i in range(joint.shape[1])])
    if (counts == 0).any():
        raise ValueError("every completion must belong to at least one joint action")
    return counts.astype(np.float64)


def agent_credit(joint: np.ndarray, returns: np.ndarray, k: int, how: str, timeout_s: float = 0) -> np.ndarray:
    """(N, K) value per completion from the (J,) team returns, or from (J, N) per-agent returns (each
    agent credited with its own column). Align joint actions contain each completion once, so mean
    and sum agree there. A plugin's rule runs under limits.user_code_timeout_s (`timeout_s`), as every
    registered hook below does."""
    credit = CREDITS.hook(how, timeout_s)
    if returns.ndim == 1:
        return credit(joint, returns, k)
    return np.stack([credit(joint, returns[:, i], k)[i] for i in range(joint.shape[1])])


def own_values(team: np.ndarray, own: np.ndarray | None, team_weight: float) -> np.ndarray:
    """What credit starts from at one node: the (J,) team rewards, or with per-agent rewards (J, N)
    and team_weight < 1 each agent's own mixed with the team's."""
    return team if own is None or team_weight == 1 else mix_rewards(team, own, team_weight)


def mix_rewards(team: np.ndarray, own: np.ndarray, team_weight: float) -> np.ndarray:
    """team (J,), own (J, N) -> (J, N): each agent's reward, team_weight x team + (1 - team_weight) x own."""
    return team_weight * np.asarray(team, dtype=np.float64)[:, None] + (1 - team_weight) * np.asarray(
        own, dtype=np.float64
    )


@BASELINES.register("mean")
def mean_baseline(values: np.ndarray) -> np.ndarray:
    return np.broadcast_to(values.mean(axis=-1, keepdims=True), values.shape)


@BASELINES.register("rloo")
def rloo_baseline(values: np.ndarray) -> np.ndarray:
    """Leave-one-out: mean of the other K-1 completions of the group."""
    k = values.shape[-1]
    return (values.sum(axis=-1, keepdims=True) - values) / (k - 1)


@BASELINES.register("max")
def max_baseline(values: np.ndarray) -> np.ndarray:
    return np.broadcast_to(values.max(axis=-1, keepdims=True), values.shape)


@BASELINES.register("none")
def no_baseline(values: np.ndarray) -> np.ndarray:
    return np.zeros_like(values)


@SCALES.register("none")
def no_scale(values: np.ndarray) -> np.ndarray:
    return np.ones(values.shape[:-1] + (1,))


@SCALES.register("std")
def std_scale(values: np.ndarray) -> np.ndarray:
    """Divide by the group's population std (+eps); no re-centring, so baselines stay distinct."""
    return values.std(axis=-1, keepdims=True) + STD_EPS


def group_advantages(values: np.ndarray, baseline: str, scale: str,
                     timeout_s: float = 0) -> tuple[np.ndarray, np.ndarray]:
    """values (..., K) -> advantages (..., K) and a (...,) mask of zero-variance groups.
    Zero-variance groups get advantage 0 whatever the baseline (none included): no signal, no gradient."""
    values = np.asarray(values, dtype=np.float64)
    adv = (values - BASELINES.hook(baseline, timeout_s)(values)) / SCALES.hook(scale, timeout_s)(values)
    zero_std = zero_variance(values)
    adv = np.where(zero_std[..., None], 0.0, adv)
    return adv, zero_std


def zero_variance(values: np.ndarray) -> np.ndarray:
    """values (..., K) -> (...,) bool: the group's K values are all equal (no signal)."""
    return np.asarray(values, dtype=np.float64).std(axis=-1) < ZERO_STD


def all_groups_flat(joint: np.ndarray, rewards: np.ndarray, k: int, credit: str, timeout_s: float = 0) -> bool:
    """True when every agent's group at a node has zero variance in the node's own rewards (credited
    as at a leaf). Dynamic sampling (DAPO, arXiv:2503.14476, over-samples prompts whose group is all
    right or all wrong) regenerates such a node: at the last turn it could give no gradient at all."""
    return bool(zero_variance(agent_credit(joint, rewards, k, credit, timeout_s)).all())


@GROUP_BY.register("node")
def node_group(node: int, tree: int, turn: int) -> Hashable:
    """MAGRPO: an agent's K completions at one node (one prompt) form its group."""
    return node


@GROUP_BY.register("agent_turn")
def agent_turn_group(node: int, tree: int, turn: int) -> Hashable:
    """AT-GRPO (Zhao et al. 2025, arXiv:2510.11062): an agent's completions at every node of one
    turn of a tree form one group (prompts differ by branch, the agent and the turn do not)."""
    return tree, turn


def pooled_advantages(
    values: Sequence[np.ndarray], baseline: str, scale: str, timeout_s: float = 0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """values: (N, K_m) per node of one pool -> advantages (N, K_m) per node and each node's (N,)
    zero-variance mask, with one group per agent over all the pool's completions."""
    adv, zero = group_advantages(np.concatenate(values, axis=-1), baseline, scale, timeout_s)
    cuts = np.cumsum([v.shape[-1] for v in values])[:-1]
    return np.split(adv, cuts, axis=-1), [zero] * len(values)


@ESTIMATORS.register("tree_grpo")
def tree_grpo(nodes: "list[Node]", settings: AdvantageSettings) -> np.ndarray:
    """MAGRPO-MT: returns up the tree (per agent too, with per-agent rewards and team_weight < 1), each
    completion credited from the joint actions containing it, grouped baselines per agent."""
    children, timeout_s = [node.children for node in nodes], settings.user_code_timeout_s
    repeats = [early_repeats(node, settings) for node in nodes]
    returns = tree_returns([node.rewards * r for node, r in zip(nodes, repeats)], children, settings.discount)
    own = agent_rewards_of(nodes, settings.team_weight)
    per_agent: list[np.ndarray | None] = [None] * len(nodes)
    if own is not None:  # every agent's returns flow up the tree from its own rewards
        own = [o * r[:, None] for o, r in zip(own, repeats)]
        columns = [tree_returns([o[:, a] for o in own], children, settings.discount) for a in range(own[0].shape[1])]
        per_agent = [np.stack([column[m] for column in columns], axis=1) for m in range(len(nodes))]
    values = []
    for node, g, mine in zip(nodes, returns, per_agent):
        node.returns, node.agent_returns = g, mine
        values.append(  # (N, K)
            agent_credit(node.joint, g if mine is None else mine, len(node.completions[0]), settings.cross_credit,
                         timeout_s))
    pools: dict = {}
    group_key = GROUP_BY.hook(settings.group_by, timeout_s)
    for m, node in enumerate(nodes):
        pools.setdefault(group_key(m, node.tree, node.turn), []).append(m)
    for members in pools.values():
        advantages, zero_std = pooled_advantages([values[m] for m in members], settings.baseline, settings.scale,
                                                 timeout_s)
        for m, adv, zero in zip(members, advantages, zero_std):
            nodes[m].advantages, nodes[m].zero_std = adv, zero
    return np.array([node.zero_std for node in nodes])


def early_repeats(node: "Node", settings: AdvantageSettings) -> np.ndarray:
    """(J,) how many times each joint action's reward counts in its return before the children's: 1, or
    with early_termination_return=repeat, for a joint action that early termination or the env's done
    ended at turn t, 1 + gamma + ... + gamma^(T-1-t) (its reward again at every turn it skipped,
    discounted as they would be: the episode stays where it ended). The env's done counts too: with
    `done = solved` a branch solved at turn t would otherwise rank below a sibling that failed and was
    fixed a turn later, the flaw `repeat` is there to fix. Truncation, a failed score and trainer.expand
    end no episode: G = r."""
    width = len(node.rewards)
    ended = [m for m in (node.early, node.done) if m is not None]
    if settings.early_termination_return != "repeat" or not any(m.any() for m in ended):
        return np.ones(width)
    skipped = settings.num_turns - 1 - node.turn
    return np.where(np.logical_or.reduce(ended), sum(settings.discount ** i for i in range(skipped + 1)), 1.0)


def agent_rewards_of(nodes: "list[Node]", team_weight: float) -> list[np.ndarray] | None:
    """Each node's (J, N) per-agent rewards mixed with the team reward; None (the team reward alone)
    when no node has per-agent rewards or team_weight is 1."""
    if team_weight == 1 or all(node.agent_rewards is None for node in nodes):
        return None
    return [mix_rewards(node.rewards, node.agent_rewards if node.agent_rewards is not None else
                        np.repeat(node.rewards[:, None], len(node.completions), axis=1), team_weight) for node in nodes]
