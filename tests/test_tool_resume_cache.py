"""The HF backend resumes a tool round's paused rows from the KV caches it kept (issue 31,
magrpo.backends.hf_resume): the same tokens and log-probs as prefilling the prompt and the turn so far
again, for rows of different lengths and agents in one batch with two calls per turn, for far fewer
prefilled tokens; and a kept cache lives one call at most."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import magrpo.tool_loop as tool_loop
from magrpo.backends.hf import HFBackend
from magrpo.generation import GenerationRequest, SamplingParams
from magrpo.models import load_agents
from magrpo.tool_loop import generate_with_tools, text_encoder
from magrpo.toolbox import Toolbox
from magrpo.tools import ToolCall, ToolStats, resolve
from tests.near_ties import same_up_to_a_near_tie, shared_prefix

# Prompts of different lengths, for both agents, one request with two samples.
REQUESTS = [GenerationRequest("def f(x):", 0, 2, seed=1),
            GenerationRequest("import os\nimport sys\n", 1, 1, seed=2),
            GenerationRequest("x", 1, 1, seed=3),
            GenerationRequest("class A:\n    def g(self): return 1\n", 0, 1, seed=4)]


@pytest.fixture(scope="module")
def agents():
    from tests.conftest import SMALL, compose

    torch.manual_seed(0)  # peft draws the adapters' A at load: the same agents in every process
    agents = load_agents(compose([*SMALL, "lora.r=4"]), 2)
    torch.manual_seed(0)
    for agent, scale in zip(agents, (0.2, 0.4)):  # adapters unlike the base and each other: routing matters
        for name, p in agent.model.named_parameters():
            if f"lora_B.{agent.adapter}." in name:
                p.data.normal_(0, scale)
    return agents


class Cut:
    """The backend with every generate call cut at `tokens` new tokens (each cut a forced call, as in
    bench/bench_tools.py); `reuse=False` never asks it to keep caches: every round prefills again."""

    def __init__(self, inner, tokens: int, reuse: bool):
        self.inner, self.tokens, self.reuse = inner, tokens, reuse

    def generate(self, requests, params):
        return self.inner.generate(requests, replace(params, max_new_tokens=min(params.max_new_tokens, self.tokens),
                                                     resumable=params.resumable and self.reuse))


def prefilled_tokens(model, run):
    """What `run()` returns, and the tokens its forwards of more than one position fed (prefills)."""
    fed = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: fed.append(kw["input_ids"].numel()) if kw["input_ids"].shape[1] > 1 else None,
        with_kwargs=True)
    try:
        return run(), sum(fed)
    finally:
        hook.remove()


def tool_turns(agents, params, reuse, monkeypatch):
    monkeypatch.setattr(tool_loop, "parse_call", lambda text: ToolCall("calculator", {"expression": "6*7"}))
    backend = HFBackend(agents)
    settings = Toolbox(tuple(resolve(["calculator"])), 2, 5.0, 1000, 8)
    out, fed = prefilled_tokens(agents[0].model, lambda: generate_with_tools(
        Cut(backend, 5, reuse), REQUESTS, params, settings, text_encoder(agents), ToolStats()))
    assert len(backend.kept) == 0  # the last round (max_calls) keeps nothing: no cache outlives the turn
    return [c for per_request in out for c in per_request], fed


@pytest.mark.parametrize("greedy", [True, False])
def test_resuming_from_kept_caches_gives_the_tokens_of_a_whole_prefill(agents, greedy, monkeypatch):
    params = SamplingParams(max_new_tokens=60, greedy=greedy, temperature=1.3, logprobs=True)  # no top-p: near ties
    reused, fed_reused = tool_turns(agents, params, True, monkeypatch)
    again, fed_again = tool_turns(agents, params, False, monkeypatch)
    assert fed_reused < 0.6 * fed_again  # the resumed rounds prefilled only the new tokens
    assert all(len(c.tool_calls) == 2 for c in again)  # two calls per turn, both resumed
    for got, want in zip(reused, again):
        if greedy:
            assert got.token_ids == want.token_ids and got.model_mask == want.model_mask
        else:
            assert same_up_to_a_near_tie(got.token_ids, want.token_ids), (got.token_ids, want.token_ids)
        # Float rounding only (attention over another layout of the same keys: ~1e-5 at log-probs near -5)
        m = sum(got.model_mask[: shared_prefix(got.token_ids, want.token_ids)])  # model tokens in the shared part
        torch.testing.assert_close(torch.tensor(got.logprobs[:m]), torch.tensor(want.logprobs[:m]), rtol=1e-5,
                                   atol=1e-5)


def test_a_call_may_mix_resumed_and_fresh_rows(agents):
    """A resumed row (its state from the last call, then new tokens) next to rows prefilled whole,
    longer and shorter than it, of both agents: each gets the tokens it gets alone."""
    params = SamplingParams(max_new_tokens=6, greedy=True)
    backend = HFBackend(agents)
    [[first]] = backend.generate([REQUESTS[1]], replace(params, resumable=True))
    assert len(backend.kept) == 1
    resumed = replace(REQUESTS[1], n=1, continuation=(*first.token_ids, 7, 8, 9))
    batch = [REQUESTS[3], resumed, REQUESTS[2]]
    got = backend.generate(batch, params)
    assert len(backend.kept) == 0  # taken or dropped by the next call
    want = HFBackend(agents).generate(batch, params)
    assert [[c.token_ids for c in cs] for cs in got] == [[c.token_ids for c in cs] for cs in want]


def test_kept_caches_go_with_the_next_call_or_sleep(agents):
    backend = HFBackend(agents)
    params = SamplingParams(max_new_tokens=4, greedy=True, resumable=True)
    out = backend.generate(REQUESTS, params)
    paused = {(r.agent, tuple(c.prompt_ids + c.token_ids[:-1])) for r, cs in zip(REQUESTS, out) for c in cs
              if not c.finished}
    assert len(backend.kept) == len(paused) > 2  # one per unfinished row (greedy samples alike share one)
    backend.sleep()  # before the update: nothing held
    assert len(backend.kept) == 0
    backend.generate(REQUESTS, params)
    backend.generate(REQUESTS[:1], replace(params, resumable=False))
    assert len(backend.kept) == 0


def test_rows_that_pause_early_resume_from_the_states_they_left_with(agents):
    """Rows that stop at a pause string before the others leave the decode early (a quarter of the batch
    at a time), each group keeping its own copy of its states; resumed with new tokens after them, every
    row gets the tokens of a backend that prefills it whole."""
    backend = HFBackend(agents)
    params = SamplingParams(max_new_tokens=12, greedy=True)
    texts = [c.text for cs in backend.generate(REQUESTS, params) for c in cs]
    pause = max(set("".join(texts)), key=lambda ch: sum(ch in t[:8] for t in texts))  # written early by most rows
    out = backend.generate(REQUESTS, replace(params, stop=(pause,), resumable=True))
    batches = {id(state.batch) for states in backend.kept.by_agent.values() for state in states.values()}
    assert len(batches) > 1  # states left the decode at different steps
    resumed = [replace(r, n=1, seed=None, continuation=(*c.token_ids, 7, 8)) for r, cs in zip(REQUESTS, out)
               for c in cs if not c.finished]
    assert len({(r.agent, r.continuation) for r in resumed}) == len(backend.kept) > 2  # greedy twins share one
    short = replace(params, max_new_tokens=6)
    got = backend.generate(resumed, short)
    want = HFBackend(agents).generate(resumed, short)
    assert [[c.token_ids for c in cs] for cs in got] == [[c.token_ids for c in cs] for cs in want]
