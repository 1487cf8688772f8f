"""A decode's prefill keeps only the last position's logits: the output head gets that position as a
contiguous [prompts, 1, hidden] tensor. A strided slice (what `logits_to_keep=1` hands it) makes torch's
matmul copy the head's weight once per prompt (a batched product over an expanded weight: 8 copies of
SmolLM2's 57 MB head for 8 prompts), which cost more than the rest of the prefill on a CPU."""
from __future__ import annotations

import torch

from magrpo.backends.hf import decode
from magrpo.generation import SamplingParams
from magrpo.models import load_agents


def test_the_head_gets_a_contiguous_input_in_the_prefill_and_the_steps(make_cfg):
    (agent,) = load_agents(make_cfg(), 1)
    head = agent.model.get_output_embeddings()
    seen = []
    handle = head.register_forward_hook(lambda module, args, out: seen.append((args[0].shape, args[0].is_contiguous())))
    try:
        with torch.no_grad():
            decode(agent.model, [[5, 6, 7, 8], [9, 10]], [agent.adapter] * 2, torch.tensor([0, 0, 1]),
                   SamplingParams(max_new_tokens=3), torch.arange(3), pad_id=0, eos_ids=[-1])
    finally:
        handle.remove()
    assert seen[0][0][:2] == (2, 1) and len(seen) == 3  # the prefill (2 prompts, last position), then 2 steps
    assert all(contiguous for _, contiguous in seen)
    assert not head._forward_pre_hooks  # the prefill's hook is gone again
