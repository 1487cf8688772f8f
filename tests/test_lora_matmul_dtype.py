"""lora.matmul_dtype: with `model`, the update's LoRA products on a bfloat16 model run in bfloat16 (the
adapters and their gradients stay float32) and give the float32 way's log-probs and gradients within
bfloat16's error; the reference is computed the same way; a float32 model and the default are unchanged;
a bad value is one line."""
from __future__ import annotations

import torch

from magrpo.models import load_agents
from magrpo.update import TrainSample, UpdateSettings, forward_logprobs, pack


def batch_of(agent):
    samples = [TrainSample([5, 6, 7, 8], [9, 10, 11], 1.0), TrainSample([5, 6, 7, 8], [12, 13], -1.0),
               TrainSample([14, 15], [16, 17, 18, 19], 0.5)]
    return pack(samples, agent.tokenizer.pad_token_id)


def trained_adapters(make_cfg, dtype: str, *overrides: str):
    cfg = make_cfg(f"model.dtype={dtype}", *overrides)
    (agent,) = load_agents(cfg, 1)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in agent.model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: make the adapters do something
                param.normal_(std=0.05)
    agent.train_mode()
    return cfg, agent


def logprobs_and_grads(agent, in_model_dtype: bool, seen: list | None = None):
    batch = batch_of(agent)
    hooks = []
    if seen is not None:  # the input dtype of every LoRA A product
        for name, module in agent.model.named_modules():
            if name.endswith(f"lora_A.{agent.adapter}"):
                hooks.append(module.register_forward_hook(lambda m, args, out: seen.append(args[0].dtype)))
    logp, _ = forward_logprobs(agent.model, batch, lora_in_model_dtype=in_model_dtype)
    for hook in hooks:
        hook.remove()
    logp[batch.target_mask].sum().backward()
    grads = {n: p.grad.clone() for n, p in agent.model.named_parameters() if p.grad is not None}
    agent.model.zero_grad(set_to_none=True)
    return logp.detach()[batch.target_mask], grads


def test_model_runs_the_lora_products_in_bfloat16_and_keeps_the_float32_ways_numbers_within_its_error(make_cfg):
    cfg, agent = trained_adapters(make_cfg, "bfloat16", "lora.matmul_dtype=model")
    assert UpdateSettings.of(cfg).lora_in_model_dtype
    seen32, seen16 = [], []
    exact, exact_grads = logprobs_and_grads(agent, False, seen32)
    fast, fast_grads = logprobs_and_grads(agent, True, seen16)
    assert set(seen32) == {torch.float32} and set(seen16) == {torch.bfloat16}
    assert (fast - exact).abs().max() < 0.1  # a bfloat16 model's own rounding is of this size
    assert exact_grads.keys() == fast_grads.keys() and all(g.dtype == torch.float32 for g in fast_grads.values())
    diff = sum(float((fast_grads[k] - exact_grads[k]).norm() ** 2) for k in exact_grads) ** 0.5
    norm = sum(float(exact_grads[k].norm() ** 2) for k in exact_grads) ** 0.5
    assert 0 < diff < 0.1 * norm


def test_the_reference_matches_the_policy_at_the_adapters_start(make_cfg):
    cfg, agent = trained_adapters(make_cfg, "bfloat16", "lora.matmul_dtype=model")
    with torch.no_grad():
        for name, param in agent.model.named_parameters():
            if "lora_B" in name:
                param.zero_()
    batch = batch_of(agent)
    policy, _ = forward_logprobs(agent.model, batch, lora_in_model_dtype=True)
    with torch.no_grad(), agent.reference_model() as reference:
        ref, _ = forward_logprobs(reference, batch, lora_in_model_dtype=True)
    assert torch.equal(policy.detach(), ref)


def test_a_float32_model_and_the_default_are_unchanged(make_cfg):
    cfg, agent = trained_adapters(make_cfg, "float32", "lora.matmul_dtype=model")
    a, ga = logprobs_and_grads(agent, False)
    b, gb = logprobs_and_grads(agent, True)
    assert torch.equal(a, b) and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert not UpdateSettings.of(make_cfg()).lora_in_model_dtype


def test_a_bad_value_is_one_line_naming_the_choices(run_cli):
    from tests.conftest import SMALL

    code, lines = run_cli(*SMALL, "lora.matmul_dtype=bf16")
    assert code == 2 and lines == ["config error: lora.matmul_dtype: 'bf16' is not allowed; choose one of: float32, "
                                   "model"]


def test_a_full_agent_is_left_as_it_is(make_cfg):
    (agent,) = load_agents(make_cfg("model.dtype=bfloat16", "agents=[{finetune: full}]", "lora.matmul_dtype=model"), 1)
    agent.train_mode()
    batch = batch_of(agent)
    a, _ = forward_logprobs(agent.model, batch)
    b, _ = forward_logprobs(agent.model, batch, lora_in_model_dtype=True)
    assert torch.equal(a, b)
