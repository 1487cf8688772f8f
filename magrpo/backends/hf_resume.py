"""Resuming paused rows from their own KV cache (issue 31), for the HF backend.

A turn that stops at a tool call resumes in the next generate call with the call's output appended
(`GenerationRequest.continuation`). Prefilling its prompt and every earlier segment again costs more
than the decoding itself when segments are short, so a call with `SamplingParams.resumable` keeps the
keys and values of each row it leaves unfinished, and the next call prefills only the new tokens (the
last sampled token, the tool message) on top of them, batched over all resumed rows.

States are kept a batch at a time (`KeptBatch`: the decode's own cache tensors, or one selection of
rows when some leave early) and gathered back in one indexing per layer: copying each row out and
back in, layer by layer, cost as much as a decode step per round on a CPU and one kernel launch per
row and layer on a GPU.

A state lives for one call: the next generate call takes those whose tokens begin a request's prompt
ids and drops the rest, and `sleep` drops them all before the update, so a row whose turn ended, or
that was not resumed, holds no memory past the next call.

On a CPU the same mechanism carries a turn's states into the next turn (`KeptStates.find` with `least`):
a next-turn prompt repeats its agent's first prompt (and, with external.history=messages or continuation,
the reply too), so the keys and values of its longest common prefix with a kept row are gathered and only
the rest is prefilled. A prefix is taken only where it saves more tokens than a forward costs (hf_prefill's
price: ~17 tokens of SmolLM2-135M; the tiny model's ~2000 never). What is left of the prompts is prefilled in
groups of similar length, as whole prompts are (hf.resumed_prefill).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class KeptBatch:
    """Keys and values of some rows of one decode, laid out as its cache held them."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values), each (rows, heads, L, dim)
    attended: torch.Tensor  # (rows, L) bool: each row's attended columns (its prompt, then each token fed)
    lengths: tuple[int, ...]  # per row, how many columns it attends to


@dataclass(frozen=True)
class RowState:
    tokens: tuple[int, ...]  # the ids these keys and values are of: the prompt, then the completion but its last token
    batch: KeptBatch  # where they are: the first len(tokens) attended columns of row `row`
    row: int
    paused: bool = True  # a row paused in its turn (a tool call); False: its turn ended, kept for the next turn


class KeptStates:
    """The row states one generate call kept, per agent (its adapter made them), by their tokens."""

    def __init__(self):
        self.by_agent: dict[int, dict[tuple[int, ...], RowState]] = {}
        self.table: dict[int, tuple[np.ndarray, list[RowState]]] = {}  # per agent: the states' tokens, -1 padded

    def __len__(self) -> int:
        return sum(len(states) for states in self.by_agent.values())

    def clear(self) -> None:
        self.by_agent, self.table = {}, {}

    def keep(self, agent: int, state: RowState) -> None:
        self.by_agent.setdefault(agent, {})[state.tokens] = state
        self.table.pop(agent, None)

    def find(self, agent: int, prompt: list[int], least: float = float("inf")) -> RowState | None:
        """The state of `agent` that covers most of `prompt` and leaves at least one token to prefill (its
        logits give the first new token): a paused state whose tokens begin `prompt`, or the first n tokens of
        any state that `prompt` begins with, where n >= `least` (a RowState of those n tokens)."""
        states = self.by_agent.get(agent, {})
        best = None
        for length in sorted({len(tokens) for tokens in states}, reverse=True):
            state = states.get(tuple(prompt[:length])) if length < len(prompt) else None
            if state is not None and (state.paused or length >= least):
                best = state
                break
        if least > len(prompt) - 1 or not states or (best is not None and len(best.tokens) == len(prompt) - 1):
            return best
        shared, state = self._longest_common_prefix(agent, prompt)
        if shared >= least and (best is None or shared > len(best.tokens)):
            return RowState(state.tokens[:shared], state.batch, state.row, paused=False)
        return best

    def _longest_common_prefix(self, agent: int, prompt: list[int]) -> tuple[int, RowState]:
        """How many first tokens of `prompt` (all but its last at most) the best state of `agent` shares, and it."""
        if agent not in self.table:
            states = list(self.by_agent[agent].values())
            width = max(len(s.tokens) for s in states)
            tokens = np.full((len(states), width), -1, dtype=np.int64)
            for i, state in enumerate(states):
                tokens[i, : len(state.tokens)] = state.tokens
            self.table[agent] = tokens, states
        tokens, states = self.table[agent]
        m = min(tokens.shape[1], len(prompt) - 1)
        same = tokens[:, :m] == np.asarray(prompt[:m], dtype=np.int64)
        shared = np.where(same.all(1), m, same.argmin(1))  # the first column that differs
        best = int(shared.argmax())
        return int(shared[best]), states[best]


def plain_layers(cache) -> list | None:
    """The cache's layers when every one is a plain growing layer (keys, values of shape (rows, heads,
    length, dim), one column per attended position); None for sliding-window or other layouts, which
    are then prefilled from scratch."""
    from transformers.cache_utils import DynamicLayer

    from .hf_cache import ReservedLayer

    layers = getattr(cache, "layers", None)
    return layers if layers and all(type(layer) in (DynamicLayer, ReservedLayer) for layer in layers) else None


def kept_batch(layers: list, attention: torch.Tensor, rows: torch.Tensor | None = None) -> KeptBatch:
    """Rows `rows` of a decode's cache layers, with their attention masks: one selection per layer;
    None: every row, the cache's own tensors (a decode that has ended never writes them again)."""
    if rows is None:
        kept = tuple((layer.keys, layer.values) for layer in layers)
    else:
        kept = tuple((layer.keys[rows], layer.values[rows]) for layer in layers)
        attention = attention[rows]
    attended = attention.bool()
    return KeptBatch(kept, attended, tuple(attended.sum(-1).tolist()))


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
    columns = torch.arange(width + new, device=device)
    kept_t = torch.tensor(kept, device=device)[:, None]
    fresh_t = torch.tensor([len(f) for f in fresh], device=device)[:, None]
    attention = (((columns >= width - kept_t) & (columns < width)) | (columns >= width + new - fresh_t)).long()
    by_batch: dict[KeptBatch, list[int]] = {}  # a KeptBatch hashes by identity
    for j, state in enumerate(states):
        if state is not None:
            by_batch.setdefault(state.batch, []).append(j)
    # The usual round: every row resumes from one decode's states, and what is gathered is the cache.
    one_source = len(by_batch) == 1 and len(next(iter(by_batch.values()))) == len(states)
    layers: list[list[torch.Tensor | None]] = [[None, None] for _ in next(iter(by_batch)).layers]
    for batch, dest in by_batch.items():
        rows = [states[j].row for j in dest]
        source = torch.tensor(rows, device=device)
        in_order = rows == list(range(batch.attended.shape[0]))  # the batch's rows as they were: no selection
        n = torch.tensor([kept[j] for j in dest], device=device)[:, None]
        # Column c of destination row j holds attended column c - (width - n_j) of its source row.
        attended_first = torch.argsort((~batch.attended[source]).to(torch.int8), dim=-1, stable=True)
        t = torch.arange(width, device=device)[None, :] - (width - n)
        valid = (t >= 0)[:, None, :, None]  # left of the state: padding, zeros as in a fresh cache
        picked = attended_first.gather(1, t.clamp(min=0))[:, None, :, None]
        dest_t = torch.tensor(dest, device=device)
        for padded, pair in zip(layers, batch.layers):
            for side, part in enumerate(pair):
                part = part if in_order else part[source]
                gathered = part.gather(2, picked.expand(-1, part.shape[1], -1, part.shape[-1])).masked_fill_(~valid, 0)
                if one_source:
                    padded[side] = gathered
                else:  # rows from several decodes, or prefilled whole (zeros: attended to by none)
                    if padded[side] is None:
                        padded[side] = part.new_zeros(len(prompts), part.shape[1], width, part.shape[-1])
                    padded[side][dest_t] = gathered
    cache = DynamicCache(config=config)
    for i, (keys, values) in enumerate(layers):
        cache.update(keys, values, i)
    return ids, attention, cache
