"""Comparing the samples of one random stream decoded in batches of different shapes.

A sample's uniforms come from its own stream whatever shares its batch (magrpo.sampling), but on a
CPU its logits can change in their last bits with the batch's shape: MKL rounds a matrix product of
fewer than 4 rows differently (measured on AVX2), LoRA multiplies each agent's slice of rows on its
own, and attention sums over the batch's left padding (~1e-6 in log-probs). The uniform then picks
the same token unless it falls within that rounding of a boundary of the sampling CDF, where the
token and its neighbour in vocabulary order swap: 2 of 16,336 tokens of the tiny model, both
neighbours (2026-11-25, AVX2). After such a swap the two samples continue differently.

Batches of the same shape give the same bits: `HFBackend(agents, max_batch_rows=1)` decodes every row
alone, so what a row samples is then exactly independent of the rest of the call."""
from __future__ import annotations

from typing import Sequence


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    return next((t for t, (g, w) in enumerate(zip(got, want)) if g != w), None)


def same_up_to_a_near_tie(got: Sequence[int], want: Sequence[int]) -> bool:
    """Equal, or equal up to a first token that is the other's neighbour in the CDF. Vocabulary order
    is CDF order only when every token has a share of it: sample without top-k and top-p."""
    t = first_difference(got, want)
    if t is None:
        return list(got) == list(want)
    return abs(got[t] - want[t]) == 1


def shared_prefix(got: Sequence[int], want: Sequence[int]) -> int:
    """How many leading tokens the two samples share (their log-probs are comparable there)."""
    t = first_difference(got, want)
    return min(len(got), len(want)) if t is None else t


def by_path(nodes) -> dict[tuple, object]:
    """Each node of a rollout under (tree, joint action at turn 0, at turn 1, ...): the same key in
    two rollouts of the same problems is the same branch, whatever the node ids."""
    keys: dict[int, tuple] = {}
    for i, node in enumerate(nodes):  # parents come before their children
        keys[i] = (node.tree,) if node.parent is None else (*keys[node.parent[0]], node.parent[1])
    return {keys[i]: node for i, node in enumerate(nodes)}


def compare_rollouts(got, want) -> tuple[int, int]:
    """Assert two rollouts of the same trees agree up to near ties: along every branch whose ancestors'
    completions are all equal, a node has the same prompts, its completions are the same up to a near
    tie, and where they are all equal, the same rewards, stops and children. Returns (nodes equal,
    nodes compared), so a caller can require that near ties stay rare."""
    mine, theirs = by_path(got.nodes), by_path(want.nodes)
    equal = compared = 0
    diverged: set[tuple] = set()
    for key, node in theirs.items():
        if any(key[:i] in diverged for i in range(1, len(key))):
            continue  # a near tie upstream: this branch's prompts may differ
        other = mine.get(key)
        assert other is not None, f"branch {key} is missing"
        compared += 1
        assert other.prompts == node.prompts, key
        pairs = [(c.token_ids, d.token_ids) for a, b in zip(other.completions, node.completions) for c, d in zip(a, b)]
        assert all(same_up_to_a_near_tie(c, d) for c, d in pairs), (key, pairs)
        if any(c != d for c, d in pairs):
            diverged.add(key)
            continue
        equal += 1
        assert other.rewards.tolist() == node.rewards.tolist(), key
        assert other.terminated.tolist() == node.terminated.tolist(), key
        assert [c is None for c in other.children] == [c is None for c in node.children], key
    return equal, compared
