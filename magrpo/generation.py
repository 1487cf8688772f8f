"""What a generate call asks for: one `GenerationRequest` per agent prompt, and the `SamplingParams`
shared by the call. The backends that answer them live in magrpo.backends.

A request's `seed` keys its random streams (magrpo.sampling): the HF backend then draws the same
random numbers in any batch, and so the same tokens, up to a near tie where another batch shape
rounds the logits otherwise (docs/long-runs.md, Reproducibility); vLLM seeds the request's own
generator with it (its streams differ from HF's, with the same caveat).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str  # the agent's prompt text (chat template applied by the backend)
    agent: int  # selects the agent's adapter (and base model)
    n: int  # samples to draw
    seed: int | None = None  # key of this request's random streams (sample k uses stream_key(seed, k)); None: drawn
    continuation: tuple[int, ...] = ()  # token ids after the encoded prompt: a turn resumed after a tool's output
    # What tools see of the request's problem (env.tool_context(problem)); backends ignore it, and it
    # takes no part in equality or hashing: a problem is a dict, and two requests are alike without it.
    context: Mapping[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    logprobs: bool = False  # also return each sampled token's log-prob under the sampling distribution
    greedy: bool = False  # argmax decoding (evaluation); temperature/top-k/top-p then only shape log-probs
    stop: tuple[str, ...] = ()  # end a completion once its text contains one of these (kept in it)
    # The caller may resume this call's unfinished completions in its next call (a tool loop): a backend
    # may keep their state until then (the HF backend: their KV caches, magrpo.backends.hf_resume).
    resumable: bool = False
