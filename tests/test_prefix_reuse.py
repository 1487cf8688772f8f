"""On a CPU the HF backend carries a turn's KV caches into the next generate call (magrpo/backends/hf_resume.py,
`KeptStates.find` with `least`): a next-turn prompt that begins with a kept row's prompt (or its prompt and
reply) prefills only the rest, and samples what a whole prefill samples."""
from __future__ import annotations

import pytest
import torch

from magrpo.backends import hf_prefill
from magrpo.backends.hf import HFBackend
from magrpo.backends.hf_resume import KeptBatch, KeptStates, RowState
from magrpo.generation import GenerationRequest, SamplingParams
from magrpo.models import load_agents
from tests.test_tool_resume_cache import prefilled_tokens


def state(tokens, paused=False):
    batch = KeptBatch((), torch.ones(1, len(tokens), dtype=torch.bool), (len(tokens),))
    return RowState(tuple(tokens), batch, 0, paused)


def test_find_takes_the_longest_shared_prefix_worth_a_forward():
    kept = KeptStates()
    kept.keep(0, state([1, 2, 3, 4, 5, 6]))
    kept.keep(0, state([1, 2, 9, 9, 9, 9, 9, 9]))
    kept.keep(1, state([1, 2, 3, 4, 5, 6, 7, 8]))
    found = kept.find(0, [1, 2, 3, 4, 7, 7, 7], least=3)
    assert found.tokens == (1, 2, 3, 4) and found.row == 0 and not found.paused  # the first 4 of the first state
    assert kept.find(0, [1, 2, 3, 4, 7, 7, 7], least=5) is None  # 4 shared tokens save less than a forward
    assert kept.find(0, [1, 2, 3, 4, 7], least=float("inf")) is None  # off: an ended row's state is never used
    assert kept.find(0, [1, 2, 3, 4, 5, 6, 7, 8], least=3).tokens == (1, 2, 3, 4, 5, 6)  # a whole state
    assert kept.find(0, [1, 2, 3, 4, 5, 6], least=3).tokens == (1, 2, 3, 4, 5)  # one token left to prefill
    kept.keep(0, state([5, 5], paused=True))
    assert kept.find(0, [5, 5, 5], least=float("inf")).tokens == (5, 5)  # a paused row resumes at any length
    assert kept.find(2, [1, 2, 3], least=1) is None  # another agent's states are not its own


@pytest.fixture(scope="module")
def agents():
    from tests.conftest import SMALL, compose

    torch.manual_seed(0)  # peft draws A from the global generator
    agents = load_agents(compose([*SMALL, "lora.r=4"]), 2)
    for agent, scale in zip(agents, (0.2, 0.4)):  # adapters unlike the base and each other: routing matters
        for name, p in agent.model.named_parameters():
            if f"lora_B.{agent.adapter}." in name:
                p.data.normal_(0, scale)
    return agents


FIRST = [GenerationRequest("def f(x):\n    return x * 2 + 1\n# a test of f\n", 0, 2, seed=1),
         GenerationRequest("import os\nimport sys\nprint(sys.argv, os.getcwd())\n", 1, 2, seed=2)]


def next_turn(first, completions):
    """Turn-2 requests as history=continuation builds them (prompt ids, the reply, then feedback tokens) and as
    history=off does (the same first prompt text, then other text), for each first request."""
    out = []
    for request, samples in zip(first, completions):
        reply = samples[0]
        out.append(GenerationRequest(request.prompt, request.agent, 2, seed=request.seed + 10,
                                     continuation=(*reply.token_ids, 40, 41, 42)))
        out.append(GenerationRequest(request.prompt + " and now: try again, briefly", request.agent, 1,
                                     seed=request.seed + 20))
    return out


@pytest.mark.parametrize("greedy", [True, False])
def test_a_next_turn_prefills_only_what_its_prompts_add(agents, greedy, monkeypatch):
    """A forward priced as 4 tokens (a real model's price is ~17; the tiny one's ~2000 never reuses): the second
    call gathers each prompt's shared prefix and feeds fewer tokens, in groups of similar length left, and
    samples the tokens of a backend that prefills every prompt whole, its log-probs within float32 rounding."""
    monkeypatch.setattr(hf_prefill, "FORWARD_FLOPS", 4 * 2 * sum(p.numel() for p in agents[0].model.parameters()))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, logprobs=True, greedy=greedy)
    carried = HFBackend(agents)
    first = carried.generate(FIRST, params)
    assert len(carried.kept) > 0  # every row kept for the next call
    second = next_turn(FIRST, first)
    import magrpo.backends.hf as hf

    seen = []
    real = hf.resumed_prefill
    monkeypatch.setattr(hf, "resumed_prefill", lambda *args: seen.append(args[-1]) or real(*args))
    reused, fed_reused = prefilled_tokens(agents[0].model, lambda: carried.generate(second, params))
    assert len(seen) == 1 and len(seen[0]) >= 2  # resumed in groups of similar length
    whole, fed_whole = prefilled_tokens(agents[0].model,
                                        lambda: HFBackend(agents, prefix_reuse=False).generate(second, params))
    assert fed_reused < 0.6 * fed_whole
    for got, want in zip(reused, whole):
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_the_tiny_model_keeps_nothing_between_calls(agents):
    """Its forward costs more than any of its prompts could share: no state is kept, nothing changes."""
    backend = HFBackend(agents)
    backend.generate(FIRST, SamplingParams(max_new_tokens=4))
    assert len(backend.kept) == 0


def test_the_kept_states_go_before_the_next_decode_steps(agents, monkeypatch):
    """The second call gathers what it resumes from, then lets the first call's caches go: they are not held
    while its own cache grows."""
    import gc
    import weakref

    monkeypatch.setattr(hf_prefill, "FORWARD_FLOPS", 4 * 2 * sum(p.numel() for p in agents[0].model.parameters()))
    params = SamplingParams(max_new_tokens=6)
    backend = HFBackend(agents)
    first = backend.generate(FIRST, params)
    kept = [weakref.ref(t) for states in backend.kept.by_agent.values() for s in states.values()
            for pair in s.batch.layers for t in pair]
    assert kept
    alive_at_steps = []

    def look(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:  # a decode step, after the prefill
            gc.collect()
            alive_at_steps.append(sum(ref() is not None for ref in kept))

    hook = agents[0].model.register_forward_pre_hook(look, with_kwargs=True)
    try:
        backend.generate(next_turn(FIRST, first), params)
    finally:
        hook.remove()
    assert alive_at_steps and alive_at_steps[0] == 0


def test_new_weights_drop_the_kept_caches(agents, monkeypatch):
    """Caches computed with the weights before an update (or a checkpoint's load) would resume wrong."""
    monkeypatch.setattr(hf_prefill, "FORWARD_FLOPS", 4 * 2 * sum(p.numel() for p in agents[0].model.parameters()))
    for drop in ("sync_weights", "sleep"):
        backend = HFBackend(agents)
        backend.generate(FIRST, SamplingParams(max_new_tokens=4))
        assert len(backend.kept) > 0
        getattr(backend, drop)()
        assert len(backend.kept) == 0, drop
