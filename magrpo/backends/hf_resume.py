"""Resuming paused rows from their own KV cache (issue 31), for the HF backend.

A turn that stops at a tool call resumes in the next generate call with the call's output appended
(`GenerationRequest.continuation`). Prefilling its prompt and every earlier segment again costs more
than the decoding itself when segments are short, so a call with `SamplingParams.resumable` keeps the
keys and values of each row it leaves unfinished, and the next call prefills only the new tokens (the
last sampled token, the tool message) on top of them, batched over all resumed rows.

A state lives for one call: the next generate call takes those whose tokens begin a request's prompt
ids and drops the rest, and `sleep` drops them all before the update, so a row whose turn ended, or
that was not resumed, holds no memory past the next call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowState:
    tokens: tuple[int, ...]  # the ids these keys and values are of: the prompt, then the completion but its last token
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values), each (heads, len(tokens), dim)


class KeptStates:
    """The row states one generate call kept, per agent (its adapter made them), by their tokens."""

    def __init__(self):
        self.by_agent: dict[int, dict[tuple[int, ...], RowState]] = {}

    def __len__(self) -> int:
        return sum(len(states) for states in self.by_agent.values())

    def keep(self, agent: int, state: RowState) -> None:
        self.by_agent.setdefault(agent, {})[state.tokens] = state

    def find(self, agent: int, prompt: list[int]) -> RowState | None:
        """The longest state of `agent` whose tokens begin `prompt` and leave at least one token to
        prefill (its logits give the first new token)."""
        states = self.by_agent.get(agent, {})
        for length in sorted({len(tokens) for tokens in states}, reverse=True):
            if length < len(prompt) and (state := states.get(tuple(prompt[:length]))) is not None:
                return state
        return None


def plain_layers(cache) -> list | None:
    """The cache's layers when every one is a plain growing layer (keys, values of shape (rows, heads,
    length, dim), one column per attended position); None for sliding-window or other layouts, which
    are then prefilled from scratch."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return layers if layers and all(type(layer) is DynamicLayer for layer in layers) else None


def row_layers(layers: list, row: int, columns: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Row `row`'s keys and values at `columns` (its attended positions, in order), copied out of the
    batch's cache so that the batch's own tensors can go."""
    return tuple((layer.keys[row][:, columns], layer.values[row][:, columns]) for layer in layers)


def resumed_inputs(prompts: list[list[int]], states: list[RowState | None], pad_id: int, config,
                   device: torch.device):
    """What a prefill resumed from `states` feeds the model: (ids (U, M) the tokens after each state,
    left-padded; attention (U, L + M); a cache holding each state left-padded to L columns).

    Row j attends to [pad]*(L - P_j) + state (P_j) + [pad]*(M - N_j) + new (N_j): the hole between the
    state and its new tokens is masked, and positions come from the mask (as in `decode`), so new token
    i of row j sits at position P_j + i exactly as in a prefill of the whole prompt. A row without a
    state has P_j = 0 and is prefilled whole."""
    from transformers import DynamicCache

    kept = [len(s.tokens) if s is not None else 0 for s in states]
    fresh = [p[n:] for p, n in zip(prompts, kept)]
    width, new = max(kept), max(len(f) for f in fresh)
    ids = torch.tensor([[pad_id] * (new - len(f)) + f for f in fresh], device=device)
    attention = torch.tensor([[0] * (width - n) + [1] * n + [0] * (new - len(f)) + [1] * len(f)
                              for n, f in zip(kept, fresh)], device=device)
    some = next(s for s in states if s is not None)
    cache = DynamicCache(config=config)
    for i, (keys, _) in enumerate(some.layers):
        heads, _, dim = keys.shape
        padded = [torch.zeros(len(prompts), heads, width, dim, dtype=keys.dtype, device=device) for _ in range(2)]
        for j, (state, n) in enumerate(zip(states, kept)):
            if state is not None:
                for tensor, part in zip(padded, state.layers[i]):
                    tensor[j, :, width - n :] = part
        cache.update(*padded, i)
    return ids, attention, cache
