"""The narrow interface every generation backend implements (hf, vllm): what the trainer, the
rollout, evaluation and the out-of-memory guard call on a backend, and nothing else.

A request (magrpo.generation) is one agent's prompt at one node; the backend returns `n` sampled
completions for it, with their token ids (and sampling log-probs when asked). Backends batch all
requests of a call together, whatever the agents, nodes and trees they come from.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from ..generation import GenerationRequest, SamplingParams
from ..tree import Completion


class GenerationBackend(Protocol):
    generate_calls: int  # model-level generate calls so far (batching is tested against it)
    generated_tokens: int  # completion tokens returned so far (tokens/s)
    batch_setting: str  # the config key an out-of-memory in generate names (and halve_batch lowers)

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        """One list of `request.n` completions per request, in request order."""
        ...

    def halve_batch(self) -> int | None:
        """After an out-of-memory in generate: generate in smaller batches for the rest of the run and
        return the new value of `batch_setting`; None where the running backend cannot shrink (the
        run then stops and names `batch_setting` for the user to lower)."""
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
    per agent for its distinct prompts (its chat template applied), then the request's `continuation`.
    Every backend sends these ids, so `Completion.prompt_ids` are exactly what the update scores."""
    by_agent: dict[int, dict[str, list[int]]] = {}  # agent -> prompt -> the requests asking it (a tool round's
    for r in ids:                                   # resumed samples share their node's prompt)
        by_agent.setdefault(requests[r].agent, {}).setdefault(requests[r].prompt, []).append(r)
    out = {}
    for agent, prompts in by_agent.items():
        for rs, tokens in zip(prompts.values(), agents[agent].encode_prompts(list(prompts))):
            for r in rs:
                out[r] = tokens + list(requests[r].continuation)
    return out
