"""Tools inside a turn (issue 31): generate until the model's reply ends in a tool call, run every
branch's calls of the round concurrently, append each result as a tool message and resume all those
branches in one batched generate call, until no reply calls a tool, `tools.max_calls` calls were
made in a turn, or the turn's `max_new_tokens` (model and tool tokens together) are spent.

A turn's completion holds every segment in order; the tool segments are masked out of the loss
(`Completion.from_segments`, docs/backends.md "Inserted tokens"). Backend-neutral: it calls only
`backend.generate`, with a stop string and `GenerationRequest.continuation`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from .generation import GenerationRequest, SamplingParams
from .sampling import stream_key
from .tools import CALL_END, Tool, ToolStats, execute_calls, parse_call, resolve, response_text
from .tree import Completion

EncodeText = Callable[[int, str], list[int]]  # (agent, text) -> token ids, no special tokens


@dataclass(frozen=True)
class ToolSettings:
    tools: tuple[Tool, ...]
    max_calls: int
    timeout_s: float
    max_output_chars: int
    max_concurrency: int

    @classmethod
    def of(cls, cfg) -> ToolSettings | None:
        """None when no tool is configured: generation then runs exactly as without this module."""
        t = cfg.tools
        if not t.names:
            return None
        return cls(tuple(resolve(t.names, "tools.names")), t.max_calls, t.timeout_s, t.max_output_chars,
                   t.max_concurrency)


@dataclass
class Turn:
    """One sample's turn so far: its segments (token ids, sampled by the model) and their texts."""

    request: GenerationRequest
    sample: int  # k of the request
    prompt_ids: list[int]
    segments: list[tuple[list[int], bool]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[float] | None = None
    finished: bool = False

    def tokens(self) -> list[int]:
        return [t for ids, _ in self.segments for t in ids]

    def add_model(self, c: Completion, budget: int) -> None:
        """Append a generated segment, cut to `budget` tokens (a batched resume asks for the largest)."""
        ids = c.token_ids[:budget]
        self.segments.append((ids, True))
        self.texts.append(c.text)
        if self.logprobs is not None and c.logprobs is not None:
            self.logprobs += c.logprobs[: len(ids)]
        else:
            self.logprobs = None
        self.finished = c.finished and len(ids) == len(c.token_ids)

    def completion(self) -> Completion:
        return Completion.from_segments(self.segments, "".join(self.texts), self.prompt_ids, self.finished,
                                        self.logprobs)


def generate_with_tools(backend, requests: Sequence[GenerationRequest], params: SamplingParams,
                        settings: ToolSettings, encode_text: EncodeText, stats: ToolStats) -> list[list[Completion]]:
    """What `backend.generate(requests, params)` returns, with tool calls made and their results
    spliced into each completion; one generate call per round, all branches' calls of a round at once."""
    params = replace(params, stop=(*params.stop, CALL_END))
    turns: list[list[Turn]] = []
    for req, completions in zip(requests, backend.generate(requests, params)):
        turns.append([])
        for k, c in enumerate(completions):
            turn = Turn(req, k, c.prompt_ids, logprobs=[] if c.logprobs is not None else None)
            turn.add_model(c, params.max_new_tokens)
            turns[-1].append(turn)
    called: set[int] = set()  # id() of the turns that made a call
    for round_ in range(1, settings.max_calls + 1):
        calling = [(t, call) for row in turns for t in row if not t.finished
                   and len(t.tokens()) < params.max_new_tokens
                   and (call := parse_call(t.texts[-1])) is not None]
        if not calling:
            break
        called.update(id(t) for t, _ in calling)
        results = execute_calls([call for _, call in calling], settings.tools, settings.timeout_s,
                                settings.max_output_chars, settings.max_concurrency)
        stats.add(results)
        resume = []
        for (turn, _), result in zip(calling, results):
            tool_ids = encode_text(turn.request.agent, response_text(result.text))
            if len(turn.tokens()) + len(tool_ids) >= params.max_new_tokens:
                continue  # no room left to read the result and answer: the turn ends at its call (never half a message)
            turn.segments.append((tool_ids, False))
            turn.texts.append(response_text(result.text))
            resume.append(turn)
        if resume:
            budgets = [params.max_new_tokens - len(t.tokens()) for t in resume]
            out = backend.generate([resume_request(t, round_) for t in resume],
                                   replace(params, max_new_tokens=max(budgets)))
            for turn, budget, [c] in zip(resume, budgets, out):
                turn.add_model(c, budget)
    stats.add_completions(sum(len(row) for row in turns), len(called))
    return [[t.completion() for t in row] for row in turns]


def resume_request(turn: Turn, round_: int) -> GenerationRequest:
    """One sample resumed after its tool message, on a random stream of its own (sample k of the
    request, round r): the same tokens in any batch, never the first round's numbers again."""
    req = turn.request
    seed = None if req.seed is None else stream_key(req.seed, turn.sample, round_)
    return replace(req, n=1, seed=seed, continuation=tuple(turn.tokens()))


def text_encoder(agents) -> EncodeText:
    """Tool messages as plain characters: a tool's output that spells `<|im_end|>` stays text."""
    def encode(agent: int, text: str) -> list[int]:
        return list(agents[agent].tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    return encode


class ToolBackend:
    """A GenerationBackend whose `generate` makes the turn's tool calls (training and evaluation
    alike); every other member is the wrapped backend's. `metrics` adds the tool numbers since the
    last call (tools/calls, tools/errors/<kind>, tools/seconds, tools/call_rate)."""

    def __init__(self, inner, settings: ToolSettings, encode_text: EncodeText):
        self.inner, self.settings, self.encode_text = inner, settings, encode_text
        self.batch_setting = inner.batch_setting
        self.stats = ToolStats()

    @property
    def generate_calls(self) -> int:
        return self.inner.generate_calls

    @property
    def generated_tokens(self) -> int:
        return self.inner.generated_tokens

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        return generate_with_tools(self.inner, requests, params, self.settings, self.encode_text, self.stats)

    def halve_batch(self) -> int | None:
        return self.inner.halve_batch()

    def sync_weights(self) -> None:
        self.inner.sync_weights()

    def sleep(self) -> None:
        self.inner.sleep()

    def metrics(self) -> dict[str, float]:
        out = {**self.inner.metrics(), **self.stats.metrics()}
        self.stats = ToolStats()
        return out

    def close(self) -> None:
        self.inner.close()


def with_tools(backend, cfg, agents):
    """`backend` itself when no tool is configured (generation exactly as before), else wrapped."""
    settings = ToolSettings.of(cfg)
    return backend if settings is None else ToolBackend(backend, settings, text_encoder(agents))
