"""Tools inside a turn (issue 31): generate until the model's reply ends in a tool call, run every
branch's calls of the round concurrently, append each result as a tool message and resume all those
branches in one batched generate call, until no reply calls a tool, `tools.max_calls` calls were
made in a turn, or the turn's `max_new_tokens` (model and tool tokens together) are spent.

A turn's completion holds every segment in order; the tool segments are masked out of the loss
(`Completion.from_segments`, docs/backends.md "Inserted tokens"). Backend-neutral: it calls only
`backend.generate`, with a stop string and `GenerationRequest.continuation`. An agent's own stop
strings (`GenerationRequest.stop`, kept in every resumed request) end the turn instead: a reply that
writes one before a call's end is finished and calls nothing. Each `Turn` is one rollout
branch for the tools: its `Session` (magrpo.tool_state) carries the request's context and the stateful
tools' handles, all released when the turn ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from .generation import GenerationRequest, SamplingParams
from .sampling import stream_key
from .tool_state import Session, ToolContext, release_all
from .toolbox import Toolbox
from .tools import (
    CALL_END,
    CallError,
    ToolCall,
    ToolResult,
    ToolStats,
    execute_calls,
    parse_call,
    response_text,
)
from .tree import Completion

# (agent, texts) -> each text's token ids, no special tokens: one tokenizer call for a round's messages
EncodeText = Callable[[int, list[str]], list[list[int]]]
# (agent, tool result) -> (text, token ids) of the chat template's own tool message; None: the plain format
ToolMessage = Callable[[int, str], "tuple[str, list[int]] | None"]


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
    calls: list[dict] = field(default_factory=list)  # the calls made, with their results (Completion.tool_calls)
    session: Session = field(default_factory=Session)  # this branch's tool context and stateful tools' handles

    def tokens(self) -> list[int]:
        return [t for ids, _ in self.segments for t in ids]

    def add_model(self, c: Completion, budget: int) -> None:
        """Append a generated segment; the backend kept it within the request's `budget` (its text is
        what the env and feedback score: it must be the text of these very tokens, never cut here)."""
        if len(c.token_ids) > budget:
            raise RuntimeError(f"the backend returned {len(c.token_ids)} tokens for a request of "
                               f"max_new_tokens={budget}: a backend must honour GenerationRequest.max_new_tokens")
        self.segments.append((c.token_ids, True))
        self.texts.append(c.text)
        if self.logprobs is not None and c.logprobs is not None:
            self.logprobs += c.logprobs
        else:
            self.logprobs = None
        self.finished = c.finished

    def completion(self) -> Completion:
        return Completion.from_segments(self.segments, "".join(self.texts), self.prompt_ids, self.finished,
                                        self.logprobs, self.calls)


def generate_with_tools(backend, requests: Sequence[GenerationRequest], params: SamplingParams,
                        settings: Toolbox, encode_text: EncodeText, stats: ToolStats,
                        message: ToolMessage | None = None) -> list[list[Completion]]:
    """What `backend.generate(requests, params)` returns, with tool calls made and their results
    spliced into each completion; one generate call per round, all branches' calls of a round at once."""
    # resumable: a round's paused branches resume in the next call, which may start from their states
    params = replace(params, stop=(*params.stop, CALL_END), resumable=True)
    turns: list[list[Turn]] = []
    for req, completions in zip(requests, backend.generate(requests, params)):
        turns.append([])
        for k, c in enumerate(completions):
            turn = Turn(req, k, c.prompt_ids, logprobs=[] if c.logprobs is not None else None,
                        session=Session(ToolContext(req.context, req.agent)))
            turn.add_model(c, params.max_new_tokens)
            turns[-1].append(turn)
    try:
        run_rounds(backend, turns, params, settings, encode_text, stats, message)
    finally:  # the turn is over, however it ended (an error in a generate call too): stateful tools let go
        failed = release_all([t.session for row in turns for t in row], settings.timeout_s, settings.max_concurrency)
        stats.count("release", failed)
    every = [t for row in turns for t in row]
    stats.add_completions(len(every), sum(bool(t.calls) for t in every))  # tools/call_rate
    return [[t.completion() for t in row] for row in turns]


def run_rounds(backend, turns: list[list[Turn]], params: SamplingParams, settings: Toolbox,
               encode_text: EncodeText, stats: ToolStats, message: ToolMessage | None = None) -> None:
    """Call, splice, resume, until no turn calls or `settings.max_calls` rounds were made."""
    for round_ in range(1, settings.max_calls + 1):
        calling = [(t, call) for row in turns for t in row if not t.finished
                   and len(t.tokens()) < params.max_new_tokens
                   and (call := parse_call(t.texts[-1])) is not None]
        if not calling:
            break
        results = execute_calls([call for _, call in calling], settings.tools, settings.timeout_s,
                                settings.max_output_chars, settings.max_concurrency,
                                sessions=[turn.session for turn, _ in calling])
        stats.add(results)
        messages = tool_message_ids([turn.request.agent for turn, _ in calling], [r.text for r in results],
                                    encode_text, message)
        resume = []
        for (turn, call), result, (text, tool_ids) in zip(calling, results, messages):
            turn.calls.append(call_record(call, result))
            if len(turn.tokens()) + len(tool_ids) >= params.max_new_tokens:
                turn.calls[-1]["inserted"] = False
                continue  # no room left to read the result and answer: the turn ends at its call (never half a message)
            turn.segments.append((tool_ids, False))
            turn.texts.append(text)
            resume.append(turn)
        if resume:
            # each branch with its own room left; the call's budget is the largest
            budgets = [params.max_new_tokens - len(t.tokens()) for t in resume]
            out = backend.generate([resume_request(t, round_, b) for t, b in zip(resume, budgets)],
                                   replace(params, max_new_tokens=max(budgets), resumable=round_ < settings.max_calls))
            for turn, budget, [c] in zip(resume, budgets, out):
                turn.add_model(c, budget)


def tool_message_ids(agents: list[int], outputs: list[str], encode_text: EncodeText,
                     message: ToolMessage | None) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each call's tool message: the chat template's own where the agent's shows
    tools, else the plain format, encoded in one call per agent."""
    out: list[tuple[str, list[int]] | None] = [message(a, o) if message is not None else None
                                              for a, o in zip(agents, outputs)]
    plain: dict[int, list[int]] = {}  # agent -> indices of its plain messages
    for i, (agent, templated) in enumerate(zip(agents, out)):
        if templated is None:
            plain.setdefault(agent, []).append(i)
    for agent, rows in plain.items():
        texts = [response_text(outputs[i]) for i in rows]
        for i, text, ids in zip(rows, texts, encode_text(agent, texts)):
            out[i] = (text, ids)
    return out  # type: ignore[return-value]


def call_record(call: ToolCall | CallError, result: ToolResult) -> dict:
    """One call as plain data (what envs and feedback see, and the per-turn metrics count)."""
    parsed = isinstance(call, ToolCall)
    return {"name": call.name if parsed else None, "arguments": call.arguments if parsed else None,
            "output": result.text, "error": result.error, "seconds": result.seconds,
            "inserted": True}  # False: the turn had no room left to read the result (it ends at the call)


def resume_request(turn: Turn, round_: int, budget: int) -> GenerationRequest:
    """One sample resumed after its tool message with `budget` tokens of room, on a random stream of its
    own (sample k of the request, round r): the same tokens in any batch, never the first round's again."""
    req = turn.request
    seed = None if req.seed is None else stream_key(req.seed, turn.sample, round_)
    return replace(req, n=1, seed=seed, continuation=(*req.continuation, *turn.tokens()), max_new_tokens=budget)


def text_encoder(agents) -> EncodeText:
    """Tool messages as plain characters: a tool's output that spells `<|im_end|>` stays text."""
    from .conversation import encode_texts

    return lambda agent, texts: encode_texts(agents[agent], texts)


class ToolBackend:
    """A GenerationBackend whose `generate` makes the turn's tool calls (training and evaluation
    alike); every other member is the wrapped backend's. `metrics` adds the tool numbers since the
    last call (tools/calls, tools/errors/<kind>, tools/seconds, tools/call_rate)."""

    def __init__(self, inner, settings: Toolbox, encode_text: EncodeText, message: ToolMessage | None = None):
        self.inner, self.settings, self.encode_text, self.message = inner, settings, encode_text, message
        self.batch_setting = inner.batch_setting
        self.stats = ToolStats()

    @property
    def generate_calls(self) -> int:
        return self.inner.generate_calls

    @property
    def generated_tokens(self) -> int:
        return self.inner.generated_tokens

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        return generate_with_tools(self.inner, requests, params, self.settings, self.encode_text, self.stats,
                                   self.message)

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
        self.inner.close()  # the toolbox (MCP sessions) is its opener's to close (magrpo.trainer)


def with_tools(backend, toolbox: Toolbox | None, agents):
    """`backend` itself when the run has no tools (generation exactly as before), else wrapped."""
    return ToolBackend(backend, toolbox, text_encoder(agents), tool_messages(agents)) if toolbox else backend


def tool_messages(agents) -> ToolMessage:
    """Agents whose chat template shows tools (Qwen2.5/Qwen3) get each result as the template's own tool
    message (it ends the reply's message, e.g. a user turn holding <tool_response>, then reopens the
    assistant's); the others get the plain format."""
    from .conversation import tool_message, turn_template

    key, fallback = "tools.names", "use model.chat_template=never for the plain tool format"
    templates = {a.index: turn_template(a, "tool", key, fallback) for a in agents if a.shows_tools()}

    def message(agent: int, result: str) -> tuple[str, list[int]] | None:
        template = templates.get(agent)
        return None if template is None else tool_message(agents[agent], template, result)

    return message
