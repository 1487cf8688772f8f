"""Hugging Face backend: one batched decode per distinct base model per turn.

All requests for agents that share a base model go into one left-padded batch, its rows grouped by
agent; `RowAdapters` routes each group through its own agent's LoRA. We run our own decode loop over
the model's forward (rather than `model.generate`) to prefill each distinct prompt once for its n
samples and to sample without `torch.multinomial`, both large costs on CPU. A call with
`SamplingParams.resumable` keeps its unfinished rows' KV caches for the next call to resume from
(magrpo.backends.hf_resume).
"""
from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from functools import lru_cache, partial
from typing import Callable, Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ..generation import GenerationRequest, SamplingParams
from ..models import Agent, cache_keyword
from ..sampling import Scratch, sample, sampling_logprobs, stream_key, stream_uniforms
from ..tree import Completion
from .base import encode_requests
from .hf_linear import PackedLinears
from .hf_prefill import group_cost, joinable, joined_cache, length_groups
from .hf_resume import KeptBatch, KeptStates, RowState, kept_batch, plain_layers, resumed_inputs


class HFBackend:
    batch_setting = "generation.max_batch_rows"  # what halve_batch lowers

    def __init__(self, agents: Sequence[Agent], max_batch_rows: int = 0, packed_weights: bool = True,
                 cuda_graphs: bool = False, prefix_reuse: bool = True):
        self.agents = list(agents)
        self.max_batch_rows = max_batch_rows  # 0 = everything in one call
        self.packed_weights = packed_weights  # model.cpu_weights=packed: frozen bf16 weights packed for decode
        self.cuda_graphs = cuda_graphs  # model.cuda_graphs: a decode on a CUDA device replays its step as a graph
        self.prefix_reuse = prefix_reuse  # generation.prefix_reuse: on a CPU, a turn's states serve the next turn
        self.generate_calls = 0
        self.generated_tokens = 0
        self.largest_chunk = 0  # rows of the biggest decode so far (what an out-of-memory halves)
        self.routing: dict[int, RowAdapters] = {}  # per base model: its LoRA layers, found once
        self.linears: dict[int, PackedLinears] = {}  # per base model: its packed frozen weights
        self.kept = KeptStates()  # the last call's rows' KV caches: unfinished ones when resumable, all on a CPU

    def halve_batch(self) -> int:
        """After an out-of-memory: decode at most half the rows of the biggest chunk from now on."""
        self.max_batch_rows = max(1, (self.max_batch_rows or self.largest_chunk) // 2)
        return self.max_batch_rows

    def sync_weights(self) -> None:
        """Generation runs on the trainer's own modules: nothing to copy; kept caches were computed with the
        weights before, so they go."""
        self.kept = KeptStates()

    def sleep(self) -> None:
        """The modules are the trainer's: only the kept KV caches are ours to free."""
        self.kept = KeptStates()

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing to shut down; the kept KV caches go."""
        self.kept = KeptStates()

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        results: list[list[Completion]] = [[] for _ in requests]
        kept, self.kept = self.kept, KeptStates()  # this call resumes from the last one's states, and drops the rest
        by_model: dict[tuple, list[int]] = defaultdict(list)  # agents with their own sampling settings apart
        for r, req in enumerate(requests):
            agent = self.agents[req.agent]
            by_model[id(agent.model), tuple(sorted(agent.sampling.items()))].append(r)
        for request_ids in by_model.values():
            own = self.agents[requests[request_ids[0]].agent].sampling_params(params)
            # Rows grouped by agent (each agent's LoRA then runs on one slice of the batch), each request
            # repeated n times, so one decode covers every agent and sample.
            request_ids.sort(key=lambda r: requests[r].agent)
            rows = [r for r in request_ids for _ in range(requests[r].n)]
            keys = [0] * len(rows) if params.greedy else [key for r in request_ids for key in row_keys(requests[r])]
            prompt_ids = encode_requests(self.agents, requests, request_ids)
            chunk = self.max_batch_rows or len(rows)
            for start in range(0, len(rows), chunk):
                part = rows[start : start + chunk]
                self.largest_chunk = max(self.largest_chunk, len(part))
                last = request_ids is list(by_model.values())[-1] and start + chunk >= len(rows)
                completions = self._generate_rows(requests, part, keys[start : start + chunk], prompt_ids, own,
                                                  kept, last)
                for r, completion in zip(part, completions):
                    results[r].append(completion)
        return results

    def _routing(self, model: torch.nn.Module) -> RowAdapters:
        if id(model) not in self.routing:
            self.routing[id(model)] = RowAdapters(model)
        return self.routing[id(model)]

    def _linears(self, model: torch.nn.Module) -> PackedLinears:
        if id(model) not in self.linears:
            self.linears[id(model)] = PackedLinears(model, self.packed_weights)
        return self.linears[id(model)]

    def _generate_rows(self, requests, rows: list[int], keys: list[int], prompt_ids: dict[int, list[int]],
                       params: SamplingParams, kept: KeptStates, release: bool):
        """Decode `rows`; `release`: no later chunk of this call needs `kept`, whose memory then goes once this
        decode has gathered what it resumes from (before its steps)."""
        first = self.agents[requests[rows[0]].agent]
        model, tok = first.model, first.tokenizer
        eos = sorted(first.eos_ids())
        # Each distinct request is prefilled once; its n samples share that KV cache.
        unique = list(dict.fromkeys(rows))
        slot = {r: i for i, r in enumerate(unique)}
        expand = torch.tensor([slot[r] for r in rows])
        stops = [(*requests[r].stop, *params.stop) for r in rows]  # the agent's (end the turn), the tool loop's (pause)
        budgets = [requests[r].budget(params) for r in rows]
        check = StopCheck(tok, stops) if any(stops) else None
        if any(b < params.max_new_tokens for b in budgets):  # a row at its own budget leaves the batch
            check = BudgetCheck(budgets, check)
        # On a CPU a prefix shared with a kept row is gathered instead of prefilled where it saves more than a
        # forward costs (hf_resume); every row's state is kept for the next call's prompts (the next turn's)
        # where it can be that long (never for a tiny model, whose forward costs ~2000 tokens).
        device = next(model.parameters()).device
        least = group_cost(model) if self.prefix_reuse and device.type == "cpu" else float("inf")
        carry = least <= max(len(prompt_ids[r]) for r in unique) + params.max_new_tokens
        found = [kept.find(requests[r].agent, prompt_ids[r], least) for r in unique] if len(kept) else None
        if release:
            kept.clear()  # `found` holds what this decode needs, and decode lets it go after its prefill
        decoded = decode(
            model,
            [prompt_ids[r] for r in unique],
            [self.agents[requests[r].agent].adapter for r in unique],
            expand,
            params,
            stream_keys=torch.tensor(keys, dtype=torch.long),
            pad_id=tok.pad_token_id,
            eos_ids=eos,
            routing=self._routing(model),
            linears=self._linears(model),
            stop=check,
            kept=found,
            keep_states=params.resumable or carry,
            static=self.cuda_graphs and device.type == "cuda",
            keep_finished=carry,
        )
        new, logprobs = decoded.tokens, decoded.logprobs
        self.generate_calls += 1
        completions = []
        eos_set = set(eos)
        for row, r in enumerate(rows):
            ids, finished = cut_at_end(tok, new[row].tolist()[: budgets[row]], eos_set, requests[r].stop, params.stop)
            self.generated_tokens += len(ids)
            if decoded.states is not None and row in decoded.states and (carry or not finished) and ids:
                self._keep(requests[r].agent, prompt_ids[r] + ids[:-1], decoded.states[row],
                           paused=params.resumable and not finished)
            completions.append(
                Completion(
                    token_ids=ids,
                    text=self.agents[requests[r].agent].tokenizer.decode(ids, skip_special_tokens=True),
                    prompt_ids=prompt_ids[r],
                    finished=finished,
                    logprobs=logprobs[row, : len(ids)].tolist() if logprobs is not None else None,
                )
            )
        return completions

    def _keep(self, agent: int, tokens: list[int], where: tuple[KeptBatch, int], paused: bool) -> None:
        """Keep a row's keys and values of `tokens` (its last sampled token may not have been fed: a paused
        row's next call feeds it first). `paused`: the row's turn goes on (a tool call), else it ended."""
        batch, row = where
        if batch.lengths[row] >= len(tokens):
            self.kept.keep(agent, RowState(tuple(tokens), batch, row, paused))


class BudgetCheck:
    """A `decode` stop check that also ends each row at its own budget (then `cut_at_end` cuts it there,
    not finished), around the stop-string check, if any."""

    def __init__(self, budgets: Sequence[int], inner: Callable | None):
        self.budgets, self.inner = torch.tensor(budgets), inner

    def __call__(self, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        spent = self.budgets[rows.cpu()] <= new.shape[1]
        return spent if self.inner is None else spent | self.inner(rows, new)


class Decoded(NamedTuple):
    tokens: torch.Tensor  # (rows, steps) new token ids, pad after EOS
    logprobs: torch.Tensor | None  # (rows, steps) their sampling log-probs, when asked
    states: dict[int, tuple[KeptBatch, int]] | None  # with `keep_states`: per row without EOS, where its states are


def row_keys(request: GenerationRequest) -> list[int]:
    """The random-stream key of each of the request's n samples (a request without a seed draws one
    from torch's global RNG, so seeded runs stay reproducible)."""
    seed = request.seed if request.seed is not None else int(torch.randint(0, 2**32, (1,)))
    return [stream_key(seed, k) for k in range(request.n)]


def stop_window(stop: Sequence[str]) -> int:
    """Tokens whose text can hold a stop string that the last of them completes (a token is >= 1 char)."""
    return max(len(s) for s in stop) + 1


class StopCheck:
    """Which batch rows end in one of their stop strings: called with batch rows (rows[i] an index into
    `stops`) and their tokens so far new[i], once per step (checking the last few tokens each step
    finds the first one). Only rows whose newest token can complete a stop string are decoded:
    decoding every row's tail at every step was most of a tool turn's stop-string cost. A stop string
    that ends in a printable ASCII character c first shows up in a tail's text at a token whose own
    text holds c (byte-level and SentencePiece tokenizers alike: c is one byte, in that token); one that
    ends in anything else (whitespace, which a lone token may decode without; a multi-byte character,
    split over tokens) can be completed by any token, and then every row is decoded."""

    def __init__(self, tokenizer, stops: Sequence[Sequence[str]]):
        self.tokenizer, self.stops = tokenizer, stops
        every = {s for row in stops for s in row if s}
        self.window = stop_window(every) if every else 0
        self.ends = {s[-1] for s in every}
        printable = all(c.isascii() and c.isprintable() and not c.isspace() for c in self.ends)
        self.known = completing(tokenizer, frozenset(self.ends)) if printable else None

    def __call__(self, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(rows), dtype=torch.bool)
        if not self.window:
            return out
        newest = new[:, -1].tolist()
        if self.known is None:
            check = list(range(len(newest)))
        else:
            known = self.known
            check = [i for i, t in enumerate(newest) if (k := known.get(t)) or (k is None and self._learn(t))]
        if check:
            row_ids = rows.tolist()
            tails = self.tokenizer.batch_decode(new[check, -self.window :].tolist())
            out[check] = torch.tensor([any(s in text for s in self.stops[row_ids[i]]) for i, text in zip(check, tails)])
        return out

    def _learn(self, token: int) -> bool:
        self.known[token] = any(c in self.tokenizer.decode([token]) for c in self.ends)
        return self.known[token]


@lru_cache(maxsize=64)
def completing(tokenizer, ends: frozenset[str]) -> dict[int, bool]:
    """Per tokenizer and stop-string endings: token -> whether its own text (special tokens included,
    as a tail's decode shows them) holds one of `ends`; filled as tokens are met, kept across calls."""
    return {}


def stop_position(tokenizer, stop: Sequence[str], ids: list[int]) -> int | None:
    """Tokens up to and including the one that completes the first stop string; None: no stop string.
    A tail's text is part of the whole text (a stop string in one is in the other), so one decode of
    the whole rules out most rows before the token-by-token search."""
    if not stop or not any(s in tokenizer.decode(ids) for s in stop):
        return None
    window = stop_window(stop)
    return next((t + 1 for t in range(len(ids))
                 if any(s in tokenizer.decode(ids[max(0, t + 1 - window) : t + 1]) for s in stop)), None)


def cut_at_end(tokenizer, ids: list[int], eos: set[int], stop: Sequence[str], pause: Sequence[str]
               ) -> tuple[list[int], bool]:
    """A decoded row's completion tokens and whether it finished: through its EOS (finished), or through
    the token that completes the first stop string in the text: one of the request's `stop` (finished:
    the agent's turn ends) or of the tool loop's `pause` (not finished: the turn goes on after the tool);
    a tie goes to the request's, as in vLLM (its stop list puts them first). Neither: cut at
    max_new_tokens (not finished)."""
    end = next((t + 1 for t, i in enumerate(ids) if i in eos), None)
    body = ids[: end - 1] if end else ids  # a stop string in the EOS token's own text does not count
    at_stop, at_pause = stop_position(tokenizer, stop, body), stop_position(tokenizer, pause, body)
    if at_stop is None and at_pause is None:
        return ids[:end], end is not None
    if at_stop is None or at_pause is None or at_stop != at_pause:
        first = min(t for t in (at_stop, at_pause) if t is not None)
        return ids[:first], first == at_stop
    # One token completes both: the one whose text ends first in the token's text wins.
    text = tokenizer.decode(ids[max(0, at_stop - stop_window([*stop, *pause])) : at_stop])
    return ids[:at_stop], first_end(text, stop) <= first_end(text, pause)


def first_end(text: str, strings: Sequence[str]) -> int:
    """Where the first of `strings` to end in `text` ends (len(text) + 1: none is in it)."""
    return min((text.index(s) + len(s) for s in strings if s in text), default=len(text) + 1)


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    prompts: list[list[int]],
    adapters: list[str],
    expand: torch.Tensor,
    params: SamplingParams,
    stream_keys: torch.Tensor,
    pad_id: int,
    eos_ids: list[int],
    drop_finished: bool = True,
    routing: RowAdapters | None = None,
    linears: PackedLinears | None = None,
    stop: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    kept: list[RowState | None] | None = None,
    keep_states: bool = False,
    split_prefill: bool = True,
    static: bool = False,
    keep_finished: bool = False,
) -> Decoded:
    """Sample completions for rows `expand` (an index into `prompts`, repeated for n samples).

    One batched prefill over the distinct prompts (left-padded, positions from the mask as in
    training), the KV cache gathered to the rows, then one forward per new token for all rows, each
    row through its own agent's adapter (fastest with rows grouped by adapter). Row r draws token t
    with uniform number t of stream stream_keys[r] (magrpo.sampling), whatever the other rows.
    Returns (rows, steps) new token ids (pad after EOS) and, when asked, their sampling log-probs.
    Rows that finished leave the batch once a quarter of it has (`drop_finished`): the other rows
    keep their random streams, so their tokens stay the same (their logits may move by float
    rounding, ~1e-6, where a smaller batch's matrix products sum in another order). `routing`: the
    model's RowAdapters, when the caller keeps one across calls. `linears`: the model's PackedLinears (the
    same bits, faster products; None: plain weights). `stop`: given batch rows (indices into
    `expand`) and their tokens so far, which of them end here though no EOS came (a stop string, kept in
    the tokens).
    `kept`: per prompt, a state of an earlier call whose tokens begin it (or None): only the rest of
    the prompt is prefilled; the list is emptied once gathered. `keep_states`: also return each row's
    keys and values (every row that wrote no EOS; with `keep_finished`, every row: a next turn's prompt
    may begin with it).
    `split_prefill`: on a CPU, prefill prompts of similar length together (hf_prefill); False: one
    prefill of all, left-padded to the longest. `static`: decode steps of fixed shape
    (hf_graph: no row leaves the batch), captured as a CUDA graph on a CUDA device and replayed each step;
    elsewhere run eagerly (the CPU tests); ignored with `kept` or `keep_states`, and for a cache of
    sliding-window layers.
    """
    from .hf_cache import reserve  # transformers' cache classes: imported when a decode runs
    from .hf_graph import static_step

    device = next(model.parameters()).device
    cache_key = cache_keyword(model)
    resumed = kept is not None and any(state is not None for state in kept)
    # prompts of similar length (after a kept state: what is left of them) prefilled together (hf_prefill): a
    # CPU computes padding like any token
    groups = []
    if split_prefill and device.type == "cpu" and len(prompts) > 1 and joinable(model.config):
        states = kept if resumed else [None] * len(prompts)
        left = [len(p) - (len(s.tokens) if s is not None else 0) for p, s in zip(prompts, states)]
        groups = length_groups(left, group_cost(model))
    prior, ids = {}, None
    if resumed and len(groups) < 2:
        ids, attention, cache = resumed_inputs(prompts, kept, pad_id, model.config, device)
        prior = {cache_key: cache}
        kept.clear()  # the states are gathered: their memory can go before the decode's own grows
    elif not resumed:
        ids, attention = left_padded(prompts, pad_id, device)
    expand, stream_keys = expand.to(device), stream_keys.to(device)
    row_adapters = [adapters[i] for i in expand.tolist()]
    model.eval()
    eos = torch.tensor(eos_ids, device=device)
    unkept = eos[:0] if keep_finished else eos  # rows whose tokens hold one of these keep no state
    steps = params.max_new_tokens
    new = torch.full((len(expand), steps), pad_id, dtype=torch.long, device=device)
    new_logprobs = torch.zeros(len(expand), steps, device=device) if params.logprobs else None
    alive = torch.arange(len(expand), device=device)  # the rows still in the batch, in row order
    # Every row's uniform for every step at once (row r, step t: draw t of stream stream_keys[r]).
    uniforms = None if params.greedy else stream_uniforms(stream_keys, torch.arange(steps, device=device))
    finished = torch.zeros(len(expand), dtype=torch.bool, device=device)  # per batch row
    states = {} if keep_states else None
    scratch = Scratch()  # the sampler's (rows, vocabulary) tensors, reused from step to step
    packed = linears.active() if linears is not None else nullcontext()
    with (routing or RowAdapters(model)).active() as routing, packed:
        with contiguous_head_input(model):
            if ids is None:  # resumed, in groups
                logits, cache, attention = resumed_prefill(model, prompts, kept, pad_id, adapters, routing, groups)
            else:
                logits, cache = prefill(model, ids, attention, prior, adapters, routing, groups)
        cache.batch_select_indices(expand)
        logits = logits[expand]
        attention = attention[expand]
        positions = attention.sum(-1)  # next position of every row
        route = routing.rows(row_adapters)
        fixed = None  # a StaticStep: every step at fixed shapes and addresses (a CUDA graph on a GPU)
        if static and not prior and states is None:
            fixed = static_step(model, cache, cache_key, attention, steps, route, capture=device.type == "cuda")
        if fixed is None:
            reserve(cache, steps)  # each step writes its position in place instead of copying the cache
        for step in range(steps):
            logp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p, scratch)
            nxt = logp.argmax(-1) if params.greedy else sample(logp, uniforms[alive, step], scratch)
            if new_logprobs is not None:
                new_logprobs[alive, step] = logp.gather(-1, nxt[:, None]).squeeze(-1)
            nxt = torch.where(finished, torch.full_like(nxt, pad_id), nxt)
            new[alive, step] = nxt
            finished |= torch.isin(nxt, eos)
            if stop is not None:
                going = (~finished).nonzero().squeeze(-1)
                finished[going] |= stop(alive[going], new[alive[going], : step + 1]).to(device)
            done = int(finished.sum())
            if done == len(alive) or step == steps - 1:
                if states is not None:
                    states.update(row_states(cache, torch.arange(len(alive)), alive, attention, new, unkept))
                new, new_logprobs = new[:, : step + 1], None if new_logprobs is None else new_logprobs[:, : step + 1]
                break
            if fixed is not None:  # finished rows stay, feeding pad
                logits = fixed.step(nxt)
                continue
            if drop_finished and done >= max(1, len(alive) // 4):  # finished rows would cost a forward per step
                if states is not None:  # a row paused at a stop string keeps its state as it leaves
                    states.update(row_states(cache, finished.nonzero().squeeze(-1), alive, attention, new, unkept))
                keep = (~finished).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                alive, attention, positions, nxt = alive[keep], attention[keep], positions[keep], nxt[keep]
                finished = finished[keep]
                route = routing.rows([row_adapters[i] for i in alive.tolist()])
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
            out = model(input_ids=nxt[:, None], attention_mask=attention, position_ids=positions[:, None],
                        use_cache=True, **{cache_key: cache}, **route)
            cache, logits, positions = out[cache_key], out.logits[:, -1], positions + 1
    return Decoded(new.cpu(), new_logprobs.cpu() if new_logprobs is not None else None, states)


def prefill(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, prior: dict, adapters: list[str],
            routing: RowAdapters, groups: list[list[int]]) -> tuple[torch.Tensor, object]:
    """The prompts' last logits (U, vocab) and their KV cache, from one forward, or from one per group of
    prompts (`groups`, two or more: each left-padded to its own longest) joined into the cache one forward
    would give; one forward where the cache's layout cannot be joined."""
    cache_key = cache_keyword(model)

    def forward(rows: list[int] | None, columns: int = 0) -> dict:
        """All prompts (and a kept state's columns), or `rows` in their last `columns` columns (no kept state)."""
        part_ids, mask, names = ids, attention, adapters
        if rows is not None:
            pick = torch.tensor(rows, device=ids.device)
            part_ids, mask = ids[pick, ids.shape[1] - columns:], attention[pick, attention.shape[1] - columns:]
            names = [adapters[i] for i in rows]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -part_ids.shape[1]:]  # after a kept state: from it on
        return model(input_ids=part_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                     logits_to_keep=1, **prior, **routing.rows(names))

    if len(groups) > 1:
        lengths = attention.sum(-1).tolist()
        outs = [forward(group, max(lengths[i] for i in group)) for group in groups]
        cache = joined_cache([out[cache_key] for out in outs], groups, len(ids), ids.shape[1], model.config,
                             ids.device)
        if cache is not None:
            logits = outs[0].logits.new_empty(len(ids), outs[0].logits.shape[-1])
            for out, group in zip(outs, groups):
                logits[torch.tensor(group, device=ids.device)] = out.logits[:, -1]
            return logits, cache
    out = forward(None)
    return out.logits[:, -1], out[cache_key]


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded to the longest, and their attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, attention


def resumed_prefill(model: torch.nn.Module, prompts: list[list[int]], kept: list[RowState | None], pad_id: int,
                    adapters: list[str], routing: RowAdapters, groups: list[list[int]]
                    ) -> tuple[torch.Tensor, object, torch.Tensor]:
    """The prompts' last logits, KV cache and attention mask, each group resumed from its kept states (or
    prefilled whole where it has none) in a forward of its own, joined with every row right-aligned as one
    resumed prefill would lay them out (masked holes and padding on the left). Empties `kept`."""
    device, cache_key = next(model.parameters()).device, cache_keyword(model)
    parts = []
    for group in groups:
        sub, states = [prompts[i] for i in group], [kept[i] for i in group]
        if any(state is not None for state in states):
            ids, attention, cache = resumed_inputs(sub, states, pad_id, model.config, device)
            prior = {cache_key: cache}
        else:
            (ids, attention), prior = left_padded(sub, pad_id, device), {}
        logits, cache = prefill(model, ids, attention, prior, [adapters[i] for i in group], routing, [])
        parts.append((logits, cache, attention))
    kept.clear()  # gathered: their memory can go before the decode's own grows
    width = max(attention.shape[1] for _, _, attention in parts)
    cache = joined_cache([cache for _, cache, _ in parts], groups, len(prompts), width, model.config, device)
    logits = parts[0][0].new_empty(len(prompts), parts[0][0].shape[-1])
    attention = parts[0][2].new_zeros(len(prompts), width)
    for (part_logits, _, part_attention), group in zip(parts, groups):
        rows = torch.tensor(group, device=device)
        logits[rows] = part_logits
        attention[rows, width - part_attention.shape[1]:] = part_attention
    return logits, cache, attention


@contextmanager
def contiguous_head_input(model: torch.nn.Module) -> Iterator[None]:
    """The prefill keeps the last position's logits only: a strided [prompts, 1, hidden] slice, for which
    torch's matmul copies the output head's weight once per prompt (a batched product over an expanded
    weight: 8 copies of SmolLM2's 49152 x 576 head for 8 prompts). A contiguous input is one matrix
    product instead: 2.6 s less per 8-prompt prefill in float32 on a loaded 2-core machine."""
    head = model.get_output_embeddings()
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def row_states(cache, batch_rows: torch.Tensor, alive: torch.Tensor, attention: torch.Tensor, new: torch.Tensor,
               eos: torch.Tensor) -> dict[int, tuple[KeptBatch, int]]:
    """Where row alive[i]'s keys and values are, for each i in `batch_rows` whose tokens hold no EOS:
    (a KeptBatch of those rows, its row); nothing for a cache of another layout."""
    layers = plain_layers(cache)
    if layers is None:
        return {}
    wrote_eos = torch.isin(new[alive[batch_rows]], eos).any(-1).tolist()  # one look for all rows (one GPU sync)
    rows = [i for i, ended in zip(batch_rows.tolist(), wrote_eos) if not ended]
    if not rows:
        return {}
    if len(batch_rows) == len(alive):  # the decode's end: its cache as it is, EOS rows and all (no copy)
        batch, at = kept_batch(layers, attention), rows
    else:  # rows leaving a decode that goes on: a copy of theirs
        batch, at = kept_batch(layers, attention, torch.tensor(rows, device=attention.device)), range(len(rows))
    return {row: (batch, j) for row, j in zip(alive[rows].tolist(), at)}


class RowAdapters:
    """Each row of a batch through its own agent's LoRA, cheaply when the rows are grouped by agent.

    peft's mixed-adapter batching (`adapter_names=`) walks every module to register hooks and, in
    every LoRA layer at every forward, rebuilds index lists and gathers and scatters rows: a quarter
    of a decode step of a 135M model on CPU. Here the base model runs with its adapters disabled and a
    hook on each LoRA linear adds `B(A(x)) * scaling` to each agent's slice of rows: peft's own
    arithmetic, on views. As in peft's forward (the one the update trains through), not its mixed batching,
    the adapters' float32 sum is added to a reduced-precision output and rounded once, so a bfloat16 row
    gets the logits of the policy being trained. Models with other LoRA layer kinds (embeddings, DoRA) keep
    peft's path.
    """

    def __init__(self, model: torch.nn.Module, reuse_buffers: bool = True):
        from peft.tuners.lora import Linear, LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model = model
        tuned = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        plain = all(type(m) is Linear and not any(m.use_dora.values()) for m in tuned)
        self.layers = [m for m in tuned if isinstance(m, LoraLayer)] if plain else []
        self.peft = bool(tuned)  # False: a full agent's own model, no adapter to route
        self.slices: list[tuple[str, slice]] = []
        self.names: tuple[str, ...] = ()  # the slices' adapters, in order
        self.even = False  # two or more slices of the same number of rows
        self.reuse_buffers = reuse_buffers  # False: the batched hook makes fresh tensors (the benchmark's "before")
        self.scratch = Scratch()  # the batched hook's intermediates, reused from layer to layer
        self.last_cast: tuple | None = None  # (input, its version, its cast in the scratch): q, k and v share one

    @contextmanager
    def active(self) -> Iterator[RowAdapters]:
        """The base model runs with each LoRA layer's own switch off, and the hooks add each row's adapter.
        The switch, not peft's `disable_adapter()`: that one checks every layer's status (walking the model
        and printing each layer) at every call, ~0.01 s per generate call on a tiny model, paid again for
        each resumed round of a tool-using turn; it also resets which adapter requires grad, which the
        updater sets for itself. Merged weights keep peft's path (the switch alone would not unmerge them)."""
        if not self.layers:
            yield self
            return
        if any(layer.merged for layer in self.layers):
            with self.model.disable_adapter(), self._hooked():
                yield self
            return
        switches = [layer._disable_adapters for layer in self.layers]
        try:
            for layer in self.layers:
                layer._disable_adapters = True
            with self._hooked():
                yield self
        finally:
            for layer, switch in zip(self.layers, switches):
                layer._disable_adapters = switch

    @contextmanager
    def _hooked(self) -> Iterator[None]:
        handles = [layer.register_forward_hook(partial(self._add_lora, self._weights(layer)))
                   for layer in self.layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.scratch.clear()  # a prefill's buffers can be large: kept for one decode call only
            self.last_cast = None

    def rows(self, adapters: Sequence[str]) -> dict:
        """Route the next forwards' rows to `adapters` (one name per row); returns the forward's extra
        keyword arguments."""
        if not self.layers:
            return {"adapter_names": list(adapters)} if self.peft else {}
        self.slices = []
        start = 0
        for end in range(1, len(adapters) + 1):
            if end == len(adapters) or adapters[end] != adapters[start]:
                self.slices.append((adapters[start], slice(start, end)))
                start = end
        # once per routing, not per layer: whether the slices are equal runs (batched LoRA), and their adapters
        self.names = tuple(name for name, _ in self.slices)
        self.even = len(self.slices) >= 2 and len({rows.stop - rows.start for _, rows in self.slices}) == 1
        return {}

    @staticmethod
    def _weights(layer) -> dict[str, tuple]:
        """Per adapter of the layer: what `B(A(dropout(x))) * scaling` needs, looked up once per decode
        call rather than through module attributes and calls at every token (a third of a tiny model's
        decode time went there). The parameters are the live ones: optimizer steps update them in place.
        Dropout is kept only where it is in training mode (never during a decode: the model is in eval)."""
        out = {}
        for name, lora_a in layer.lora_A.items():
            lora_b, dropout = layer.lora_B[name], layer.lora_dropout[name]
            out[name] = (lora_a.weight, lora_a.bias, lora_b.weight, lora_b.bias, layer.scaling[name],
                         dropout if dropout.training and not isinstance(dropout, torch.nn.Identity) else None)
        return out

    def _add_lora(self, weights: dict[str, tuple], layer, args, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if self._batched(weights, x):
            return self._add_lora_batched(weights, x, output)
        for name, rows in self.slices:
            if name in weights:
                a_weight, a_bias, b_weight, b_bias, scaling, dropout = weights[name]
                h = x[rows].to(a_weight.dtype)
                if dropout is not None:
                    h = dropout(h)
                delta = F.linear(F.linear(h, a_weight, a_bias), b_weight, b_bias).mul_(scaling)  # peft's arithmetic
                output[rows] += delta  # summed in the adapters' dtype, rounded once: as peft's forward the update runs
        return output

    def _batched(self, weights: dict, x: torch.Tensor) -> bool:
        """Whether this forward's slices go through one batched product: two or more slices of the same
        number of rows (`rows` says), in a reduced-precision model (float32 keeps the per-slice products:
        its goldens are bit-exact), through adapters this layer can stack (`_stacked`, once per decode
        call and order of adapters)."""
        if not self.even or x.dtype == torch.float32:
            return False
        if self.names not in weights:
            weights[self.names] = self._stacked(weights, self.names)
        return weights[self.names] is not None

    @staticmethod
    def _stacked(weights: dict, names: tuple[str, ...]) -> tuple | None:
        """The adapters `names`, in order, stacked for two batched products (A as [slices, in, rank], B as
        [slices, rank, out], the scalings as [slices, 1, 1], or None where they are folded into B); None
        unless each is an adapter of this layer of one shape, without bias or dropout."""
        if any(name not in weights for name in names):
            return None
        picked = [weights[name] for name in names]
        if (len({w[0].shape for w in picked}) != 1 or len({w[2].shape for w in picked}) != 1
                or any(w[1] is not None or w[3] is not None or w[5] is not None for w in picked)):
            return None
        a = torch.stack([w[0] for w in picked]).transpose(1, 2)
        b = torch.stack([w[2] for w in picked]).transpose(1, 2)
        scale = torch.tensor([w[4] for w in picked], dtype=a.dtype, device=a.device)[:, None, None]
        if all(w[4] > 0 and math.frexp(w[4])[0] == 0.5 for w in picked):
            # a power of two (alpha / r = 2 by default) scales every product and partial sum exactly, so
            # h A (B s) is (h A B) s bit for bit: folded into B, one pass over the output less per layer
            return a, b * scale, None
        return a, b, scale

    def _add_lora_batched(self, weights: dict, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """`B(A(x)) * scaling` for every slice at once: two batched products over the slices' stacked
        adapters instead of ~7 small operations per slice (a fifth of a default run's time with 4-8 rows
        was spent in this hook, one slice at a time). Without gradients its large intermediates (a
        prefill's) go into buffers reused from layer to layer: fresh ones of that size are new pages from
        the kernel, and their faults made this hook cost as much as the layer's own product (66 vs 25 ms
        for 8192 rows of a 576 x 1536 layer, one thread); the same operations, so the same bits."""
        a, b, scale = weights[self.names]
        shape = (len(self.names), -1, x.shape[-1])  # the slices are equal runs of rows, in order
        if torch.is_grad_enabled() or not self.reuse_buffers:
            delta = torch.bmm(torch.bmm(x.reshape(shape).to(a.dtype), a), b)
            delta = delta if scale is None else delta * scale
            output += delta.reshape(output.shape)
            return output
        h = x.reshape(shape)
        if h.dtype != a.dtype:
            h = self._cast(x, h, a.dtype)
        delta = self.scratch("delta", (h.shape[0], h.shape[1], b.shape[-1]), a.dtype, x.device)
        torch.bmm(torch.bmm(h, a), b, out=delta)
        if scale is not None:
            delta.mul_(scale)
        output += delta.reshape(output.shape)
        return output

    def _cast(self, x: torch.Tensor, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`h` (a view of the layer's input `x`) as `dtype`, in scratch buffer "input": the cast the hook
        made last when `x` is the same unchanged tensor (a decoder layer's q, k and v projections take one
        input, as do an MLP's gate and up: 3 casts of 7 per layer less), else a new one. Only this writes
        buffer "input", so the last cast holds until the next; a grown buffer leaves it in the old memory."""
        last = self.last_cast
        if last is not None and last[0] is x and last[1] == x._version and last[2].dtype == dtype:
            return last[2]
        cast = self.scratch("input", h.shape, dtype, x.device).copy_(h)  # .to(dtype), in place
        self.last_cast = (x, x._version, cast)
        return cast
