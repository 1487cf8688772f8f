"""Grouped advantage estimator for tree rollouts: pure functions over numpy arrays.

1. Returns flow up the tree: G_j = r_j + gamma * mean(G of the child's joint actions); a leaf's G_j = r_j.
2. Credit per agent: each of an agent's K completions at a node gets one value from the G's of
   the joint actions that contain it (align: exactly one; cross: K^(N-1) of them).
3. Group = one agent's K completions at one node; a GRPO baseline per group gives advantages.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .registry import Registry

STD_EPS = 1e-6
# Groups whose values differ by less than this are "zero-variance": they carry no signal.
ZERO_STD = 1e-8

BASELINES: Registry[Callable[[np.ndarray], np.ndarray]] = Registry("baseline")
CREDITS: Registry[Callable[[np.ndarray, np.ndarray, int], np.ndarray]] = Registry("cross_credit")
SCALES: Registry[Callable[[np.ndarray], np.ndarray]] = Registry("advantage_scale")


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


def agent_credit(joint: np.ndarray, returns: np.ndarray, k: int, how: str) -> np.ndarray:
    """(N, K) value per completion. Align joint actions contain each completion once, so mean and
    sum agree there."""
    return CREDITS.get(how)(joint, returns, k)


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


def group_advantages(values: np.ndarray, baseline: str, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """values (..., K) -> advantages (..., K) and a (...,) mask of zero-variance groups.
    Zero-variance groups get advantage 0 whatever the baseline (none included): no signal, no gradient."""
    values = np.asarray(values, dtype=np.float64)
    adv = (values - BASELINES.get(baseline)(values)) / SCALES.get(scale)(values)
    zero_std = zero_variance(values)
    adv = np.where(zero_std[..., None], 0.0, adv)
    return adv, zero_std


def zero_variance(values: np.ndarray) -> np.ndarray:
    """values (..., K) -> (...,) bool: the group's K values are all equal (no signal)."""
    return np.asarray(values, dtype=np.float64).std(axis=-1) < ZERO_STD


def all_groups_flat(joint: np.ndarray, rewards: np.ndarray, k: int, credit: str) -> bool:
    """True when every agent's group at a node has zero variance in the node's own rewards (credited
    as at a leaf). Dynamic sampling (DAPO, arXiv:2503.14476, over-samples prompts whose group is all
    right or all wrong) regenerates such a node: at the last turn it could give no gradient at all."""
    return bool(zero_variance(agent_credit(joint, rewards, k, credit)).all())
