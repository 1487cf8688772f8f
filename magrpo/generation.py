"""The narrow interface every generation backend implements (hf, vllm), and the factory that picks one.

A request is one agent's prompt at one node; the backend returns `n` sampled completions for it,
with their token ids (and sampling log-probs when asked). Backends batch all requests of a call
together, whatever the agents, nodes and trees they come from. A request's `seed` keys its random
streams (magrpo.sampling): the HF backend then samples the same completions in any batch; vLLM
seeds the request's own generator with it (its streams differ from HF's, and a sample can still
change where batch composition changes the logits' last bits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from .tree import Completion


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str  # the agent's prompt text (chat template applied by the backend)
    agent: int  # selects the agent's adapter (and base model)
    n: int  # samples to draw
    seed: int | None = None  # key of this request's random streams (sample k uses stream_key(seed, k)); None: drawn


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    logprobs: bool = False  # also return each sampled token's log-prob under the sampling distribution
    greedy: bool = False  # argmax decoding (evaluation); temperature/top-k/top-p then only shape log-probs


class GenerationBackend(Protocol):
    generate_calls: int  # model-level generate calls so far (batching is tested against it)
    generated_tokens: int  # completion tokens returned so far (tokens/s)

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        """One list of `request.n` completions per request, in request order."""
        ...

    def sync_weights(self) -> None:
        """Make the latest adapter weights visible to generation (after each optimizer step)."""
        ...

    def sleep(self) -> None:
        """Free generation memory for the update (woken up by the next sync_weights)."""
        ...

    def metrics(self) -> dict[str, float]:
        """The backend's own numbers since the last call (e.g. perf/prefix_cache_hit_rate).
        With torchrun, rank 0 logs one value per key, merged by its kind (magrpo.metrics): mark each
        number Counter (summed), Gauge (averaged; unmarked numbers too) or Maximum."""
        ...

    def close(self) -> None:
        """Release engines and their processes (end of the run)."""
        ...


def encode_requests(
    agents: Sequence, requests: Sequence[GenerationRequest], ids: Sequence[int]
) -> dict[int, list[int]]:
    """Prompt token ids of requests[i] for i in ids, as the trainer will see them: one tokenizer call
    per agent (its chat template applied)."""
    by_agent: dict[int, list[int]] = {}
    for r in ids:
        by_agent.setdefault(requests[r].agent, []).append(r)
    out = {}
    for agent, rs in by_agent.items():
        for r, tokens in zip(rs, agents[agent].encode_prompts([requests[r].prompt for r in rs])):
            out[r] = tokens
    return out
