"""What a generate call asks for: one `GenerationRequest` per agent prompt, and the `SamplingParams`
shared by the call. The backends that answer them live in magrpo.backends.

A request's `seed` keys its random streams (magrpo.sampling): the HF backend then draws the same
random numbers in any batch, and so the same tokens, up to a near tie where another batch shape
rounds the logits otherwise (docs/long-runs.md, Reproducibility); vLLM seeds the request's own
generator with it (its streams differ from HF's, with the same caveat).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str  # the agent's prompt text (chat template applied by the backend)
    agent: int  # selects the agent's adapter (and base model)
    n: int  # samples to draw
    seed: int | None = None  # key of this request's random streams (sample k uses stream_key(seed, k)); None: drawn
    continuation: tuple[int, ...] = ()  # token ids after the encoded prompt: a turn resumed after a tool's output
    stop: tuple[str, ...] = ()  # the agent's stop strings: end the completion, finished (kept in it)
    # This request's own budget of new tokens, at most the call's (SamplingParams.max_new_tokens): a
    # resumed tool turn's room left. None: the call's. A completion cut here is not finished.
    max_new_tokens: int | None = None
    # What tools see of the request's problem (env.tool_context(problem)); backends ignore it, and it
    # takes no part in equality or hashing: a problem is a dict, and two requests are alike without it.
    context: Mapping[str, Any] | None = field(default=None, compare=False)

    def budget(self, params: SamplingParams) -> int:
        """New tokens this request may take in a call with `params`: its own budget, never the call's more."""
        own = self.max_new_tokens
        return params.max_new_tokens if own is None else min(own, params.max_new_tokens)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    logprobs: bool = False  # also return each sampled token's log-prob under the sampling distribution
    greedy: bool = False  # argmax decoding (evaluation); temperature/top-k/top-p then only shape log-probs
    # Pause markers (a tool call's end): end a completion once its text holds one, kept in it, with
    # `finished` False (the turn goes on after the tool). The request's own `stop` ends it finished;
    # whichever ends first in the text wins, the request's on a tie.
    stop: tuple[str, ...] = ()
    # The caller may resume this call's unfinished completions in its next call (a tool loop): a backend
    # may keep their state until then (the HF backend: their KV caches, magrpo.backends.hf_resume).
    resumable: bool = False


@dataclass(frozen=True)
class StopStrings:
    """Each agent's stop strings (`GenerationRequest.stop`): `default` (generation.stop) unless its
    entry in `own` (agents[i].stop) is not None."""

    default: tuple[str, ...] = ()
    own: tuple[tuple[str, ...] | None, ...] = ()

    @classmethod
    def of(cls, cfg: Any) -> StopStrings:
        """From a TrainConfig, escapes read (`unescape`)."""
        def strings(values) -> tuple[str, ...]:
            return tuple(unescape(s) for s in values)

        return cls(strings(cfg.generation.stop), tuple(None if a.stop is None else strings(a.stop) for a in cfg.agents))

    def of_agent(self, agent: int) -> tuple[str, ...]:
        own = self.own[agent] if agent < len(self.own) else None
        return self.default if own is None else own


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """A stop string as written on the command line: Hydra keeps `\\n` in a quoted value as a backslash
    and an n, so \\n, \\t, \\r and \\\\ are read here as in a Python literal (other backslashes stay)."""
    return re.sub(r"\\(.)", lambda m: ESCAPES.get(m[1], m[0]), text, flags=re.S)
