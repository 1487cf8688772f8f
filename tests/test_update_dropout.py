"""The update trains the LoRA adapter only: the base model's own dropout stays off, LoRA's is on."""
from __future__ import annotations

import torch

from magrpo.models import load_agents
from magrpo.update import AgentUpdater, TrainSample
from tests.fakes import update_settings


def test_only_lora_dropout_is_active_during_the_update():
    from tests.conftest import SMALL, compose

    agent = load_agents(compose([*SMALL, "lora.dropout=0.1"]), 1)[0]
    seen: dict[str, list[bool]] = {"base": [], "lora": []}
    for name, module in agent.model.named_modules():
        if name.endswith("layers.0.self_attn"):  # Qwen2 attention: its dropout follows .training
            module.register_forward_pre_hook(lambda m, args: seen["base"].append(m.training))
        if name.endswith("layers.0.self_attn.q_proj.lora_dropout.agent_0"):
            module.register_forward_pre_hook(lambda m, args: seen["lora"].append(m.training))
    samples = [TrainSample([5, 6, 7], [8, 9], 1.0), TrainSample([5, 6, 7], [10, 11, 12], -1.0)]
    torch.manual_seed(0)
    AgentUpdater(agent, 1e-3, 0.0, 0).step(samples, update_settings(max_new_tokens=4), micro_batch_size=8)
    assert seen["base"] and not any(seen["base"])
    assert seen["lora"] and all(seen["lora"])
