"""Full-parameter agents (`agents[i].finetune=full`, issue 47): every weight of the agent's own copy
trains and nothing else moves, the KL term's reference is a frozen copy of the initial weights,
generation runs each agent through its own weights, checkpoints resume exactly, memory is stated and
checked before the copies load, and per-agent lr, LoRA rank and sampling settings reach the optimizer,
the adapter, generation and the update."""
from __future__ import annotations

import pytest
import torch

from magrpo.backends.hf import HFBackend
from magrpo.generation import GenerationRequest, SamplingParams
from magrpo.models import load_agents
from magrpo.update import AgentUpdater, TrainSample
from tests.conftest import SMALL, compose
from tests.fakes import loss_settings, update_settings
from tests.test_resume import adapters, cli, comparable, same_adapters

PROMPT = [5, 6, 7]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def team(*overrides, agents="[{finetune: full}, {}, {}]", n=3):
    """Agent 0 full, agents 1 and 2 LoRA on one shared base (float32: SMALL)."""
    return load_agents(compose([*SMALL, "lora.dropout=0.0", f"agents={agents}", *overrides]), n)


def samples():
    return [TrainSample(PROMPT, [20, 21, 22, 23], 1.0, None), TrainSample([8, 9], [30, 31], -1.0, None)]


def weights(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_every_weight_of_the_full_agent_trains_and_nothing_else_moves():
    full, lora, _ = team("trainer.kl_coef=0.1")
    assert full.model is not lora.model and lora.model is _.model  # its own copy; the LoRA agents share theirs
    before_full, before_lora, before_ref = weights(full.model), weights(lora.model), weights(full.reference)
    updater = AgentUpdater(full, 1e-3, 0.0, 0)
    assert len(updater.params) == len(list(full.model.parameters()))
    updater.step(samples(), update_settings(loss=loss_settings(kl_coef=0.1)), micro_batch_size=8)
    after = weights(full.model)
    unchanged = [n for n in before_full if torch.equal(before_full[n], after[n])]
    assert not unchanged, f"weights the update did not reach: {unchanged}"
    assert all(torch.equal(v, weights(lora.model)[n]) for n, v in before_lora.items())  # base and adapters as they were
    assert all(torch.equal(v, weights(full.reference)[n]) for n, v in before_ref.items())  # the reference stays frozen


def test_the_kl_reference_is_the_initial_weights_and_kl_grows_from_zero():
    full = team("trainer.kl_coef=0.1", agents="[{finetune: full}]", n=1)[0]
    assert full.reference is not None and full.reference is not full.model
    assert not any(p.requires_grad for p in full.reference.parameters())
    assert all(torch.equal(p, q) for p, q in zip(full.model.parameters(), full.reference.parameters()))
    updater = AgentUpdater(full, 1e-2, 0.0, 0)
    settings = update_settings(loss=loss_settings(kl_coef=0.1))
    first = updater.step(samples(), settings, micro_batch_size=8)
    second = updater.step(samples(), settings, micro_batch_size=8)
    assert first["kl"] == 0.0  # the policy is its reference before any step
    assert second["kl"] > 0.0  # after one: it moved and the reference did not
    without = team(agents="[{finetune: full}]", n=1)[0]
    assert without.reference is None  # no KL term: no second copy in memory


def test_a_full_agent_generates_from_its_own_weights():
    full, lora, _ = team()
    backend = HFBackend([full, lora, _])
    greedy = SamplingParams(max_new_tokens=8, temperature=1.0, greedy=True)
    requests = [GenerationRequest(agent=a, prompt="Count to three:", n=1) for a in range(3)]
    # at the start a full agent is its base model, and a LoRA agent (B = 0) is too: the same tokens
    first = [c[0].token_ids for c in backend.generate(requests, greedy)]
    assert first[0] == first[1] == first[2]
    with torch.no_grad():  # move only the full agent's weights: only its tokens may change
        for p in full.model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    second = [c[0].token_ids for c in backend.generate(requests, greedy)]
    assert second[1:] == first[1:] and second[0] != first[0]


def test_a_checkpoint_of_a_full_agent_resumes_exactly(tmp_path, capsys):
    agents = "agents=[{finetune: full},{}]"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert cli(capsys, straight, agents, "trainer.kl_coef=0.05", "trainer.steps=3")[0] == 0
    assert cli(capsys, resumed, agents, "trainer.kl_coef=0.05", "trainer.steps=2")[0] == 0
    stored = resumed / "checkpoints" / "step_000002" / "agent_0"
    assert torch.load(stored / "train.pt", weights_only=False)["params"] is None  # the weights are stored once
    code, err = cli(capsys, resumed, agents, "trainer.kl_coef=0.05", "trainer.steps=3", "resume=auto")
    assert code == 0, err
    assert any("resuming from" in line for line in err)
    assert comparable(resumed) == comparable(straight)
    final = adapters(straight)
    assert "model.safetensors" in {p.name for p in (straight / "adapters" / "agent_0").iterdir()}
    assert same_adapters(adapters(resumed), final)


def test_memory_that_would_not_fit_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import transformers

    from magrpo import agent_memory

    monkeypatch.setattr(agent_memory, "available_bytes", lambda device: (1e6, "MemAvailable"))
    loads = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(a) or 1 / 0))
    code, err = cli(capsys, tmp_path / "run", "agents=[{finetune: full}]")
    assert code == 2 and not loads
    assert err[-1].startswith("config error: agents[0].finetune: full: the full agents up to this one need at least "
                              "0.02 GB"), err
    assert "has 0.00 GB (MemAvailable)" in err[-1]


def test_the_memory_line_is_said_at_start_up(tmp_path, capsys):
    code, err = cli(capsys, tmp_path / "run", "agents=[{finetune: full}]", "trainer.steps=1", "eval.every=0",
                    "trainer.kl_coef=0.1")
    assert code == 0, err
    line = next(x for x in err if x.startswith("magrpo: agent 0 trains all"))
    assert "weights of tiny (float32, set by model.dtype)" in line
    assert "weights 0.00 + gradients 0.00 + AdamW 0.01 + reference 0.00" in line


def test_per_agent_lr_and_lora_rank(tmp_path, capsys):
    lora = team(agents="[{lora_r: 4, lr: 0.5}, {}]", n=2)
    ranks = {a.index: {p.shape[0] for n, p in a.model.named_parameters() if f"lora_A.{a.adapter}." in n} for a in lora}
    assert ranks == {0: {4}, 1: {16}}
    code, err = cli(capsys, tmp_path / "run", "agents=[{lr: 0.5},{finetune: full, lr: 1e-4}]", "trainer.steps=1",
                    "eval.every=0")
    assert code == 0, err
    import json

    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["train/agent_0/lr"] == 0.5 and metrics["train/agent_1/lr"] == 1e-4


def test_per_agent_sampling_reaches_generation_and_the_update(tmp_path, capsys):
    """Agent 0 samples at temperature 0.5 with top-k 5, agent 1 at the run's 1.0: each completion's
    sampling log-probs are its own agent's distribution, and each agent's update scores them under the
    same temperature, so the trainer/sampler mismatch stays at rounding for both (scored under the
    run's temperature instead, agent 0's is far off)."""
    import json

    from magrpo.sampling import sampling_logprobs

    agents = team(agents="[{temperature: 0.5, top_k: 5}, {}]", n=2)
    assert agents[0].sampling == {"temperature": 0.5, "top_k": 5} and agents[1].sampling == {}
    backend = HFBackend(agents)
    out = backend.generate([GenerationRequest("Count to three:", a, 2, seed=1) for a in (0, 1)],
                           SamplingParams(max_new_tokens=6, logprobs=True))
    for agent, completions in zip(agents, out):
        params = agent.sampling_params(SamplingParams(max_new_tokens=6))
        for c in completions:
            ids = torch.tensor([c.prompt_ids + c.token_ids])
            with torch.no_grad():
                logits = agent.model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1]
            want = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
            want = want.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=1e-4)
    code, err = cli(capsys, tmp_path / "run", "agents=[{temperature: 0.5},{}]", "trainer.steps=1", "eval.every=0")
    assert code == 0, err
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["train/agent_0/logp_mismatch"] < 1e-3 and metrics["train/agent_1/logp_mismatch"] < 1e-3


@pytest.mark.parametrize("overrides, line", [
    (["agents=[{finetune: half}]"],
     "config error: agents[0].finetune: 'half' is not allowed; choose one of: lora, full"),
    (["agents=[{finetune: full, lora_r: 8}]"], "config error: agents[0].lora_r: is a LoRA rank, and this agent has "
                                             "finetune=full"),
    (["agents=[{lr: 0}]"], "config error: agents[0].lr: must be > 0"),
    (["agents=[{lora_r: 0}]"], "config error: agents[0].lora_r: must be >= 1"),
    (["agents=[{temperature: 0}]"], "config error: agents[0].temperature: must be > 0"),
    (["agents=[{},{top_p: 1.5}]"], "config error: agents[1].top_p: must be in (0, 1]"),
    (["agents=[{top_k: -1}]"], "config error: agents[0].top_k: must be >= 0"),
])
def test_bad_agent_settings_are_one_line(tmp_path, capsys, overrides, line):
    code, err = cli(capsys, tmp_path / "run", *overrides)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err
