"""A decode's prefill on a CPU in groups of prompts of similar length, for the HF backend.

One batched prefill left-pads every prompt to the longest, and a CPU computes the padding like any
token: in a greedy evaluation of issue 48's task (64 problems, 2 agents) the second turn's 128 prompts
were 33% padding (lengths 150-377). `length_groups` sorts the prompts by length and cuts them where a
group's padding would cost more than another forward (`group_cost`); each group is prefilled on its own, left-padded
to its own longest, and `joined_cache` lays the groups' keys and values out as one prefill of all the
prompts would (each row right-aligned, zeros where it is padding: masked, as the padding is). The
decode then goes on as after one prefill. A row's logits may move by float rounding where its group's
matrix products and attention sum in another order than the whole batch's (as with
generation.max_batch_rows), so a token can change only at a near tie (docs/long-runs.md,
Reproducibility).
"""
from __future__ import annotations

from typing import Sequence

import torch

# What one more forward costs beside its tokens (its Python work and per-layer calls: ~50 ms at ~100 GFLOP/s),
# in FLOPs: ~18 tokens of SmolLM2-135M, so a tiny model (a few thousand tokens' worth) never splits.
FORWARD_FLOPS = 5e9


def group_cost(model: torch.nn.Module) -> int:
    """One more forward of `model`, in prefilled tokens (2 FLOPs per parameter per token)."""
    return max(1, round(FORWARD_FLOPS / (2 * sum(p.numel() for p in model.parameters()))))


def length_groups(lengths: Sequence[int], group_cost: int) -> list[list[int]]:
    """Indices into `lengths`, in groups of similar length, that minimise the tokens a prefill computes
    (each group: its size times its longest) plus `group_cost` per group; each group in index order
    (prompts of one agent stay together, so each group's rows route to few adapters)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    ordered = [lengths[i] for i in order]
    # best[j]: the cheapest cost of the j shortest prompts; cut[j]: where its last group starts
    best, cut = [0] * (len(order) + 1), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        best[j], cut[j] = min((best[i] + (j - i) * ordered[j - 1] + group_cost, i) for i in range(j))
    groups, j = [], len(order)
    while j > 0:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


def joinable(config) -> bool:
    """Whether this model's cache is plain in every layer (one column per position), so that groups'
    caches can be joined: not with sliding-window layers (Mistral, Gemma 3), which then prefill in one."""
    from transformers import DynamicCache

    from .hf_resume import plain_layers

    return plain_layers(DynamicCache(config=config)) is not None


def joined_cache(caches: list, groups: list[list[int]], rows: int, width: int, config, device: torch.device):
    """One DynamicCache of `rows` rows and `width` columns holding each group's prefill cache (its rows in
    the group's order) right-aligned; None unless every group's cache is plain (one column per position:
    no sliding window)."""
    from transformers import DynamicCache

    from .hf_resume import plain_layers

    layered = [plain_layers(cache) for cache in caches]
    if any(layers is None for layers in layered):
        return None
    joined = DynamicCache(config=config)
    places = [torch.tensor(group, device=device) for group in groups]  # once, not per layer and side
    for i, first in enumerate(layered[0]):
        sides = []
        for side in ("keys", "values"):
            part = getattr(first, side)
            whole = part.new_zeros(rows, part.shape[1], width, part.shape[-1])
            for layers, place in zip(layered, places):
                piece = getattr(layers[i], side)
                whole[place, :, width - piece.shape[-2]:] = piece
            sides.append(whole)
        joined.update(*sides, i)
    return joined
