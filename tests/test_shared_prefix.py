"""The update's packed forward: rows that share a prompt run it once and attend to its KV cache.
It must give the same log-probs and the same LoRA gradients as running every row on its own."""
from __future__ import annotations

import pytest
import torch

from magrpo.loss import gather_logprobs
from magrpo.update import TrainSample, forward_logprobs, micro_batches, pack
from tests.fakes import lora_tiny_qwen2

PAD = 0
P1, P2 = [5, 6, 7, 8], [9, 10]
SAMPLES = [
    TrainSample(P1, [11, 12, 13], 1.0),
    TrainSample(P2, [14], -1.0),
    TrainSample(P1, [15, 16], 0.5),
    TrainSample(P2, [17, 18, 19, 20], 2.0),
]


@pytest.fixture(scope="module")
def model():
    return lora_tiny_qwen2()


def test_pack_layout_by_hand():
    b = pack(SAMPLES, PAD)
    assert b.prompt_ids.tolist() == [P1, [PAD, PAD] + P2]  # distinct prompts, left-padded
    assert b.prompt_mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert b.expand.tolist() == [0, 1, 0, 1]
    assert b.targets.tolist() == [[11, 12, 13, PAD], [14, PAD, PAD, PAD], [15, 16, PAD, PAD], [17, 18, 19, 20]]
    assert b.target_mask.sum(-1).tolist() == [3, 1, 2, 4]
    assert b.inputs.tolist() == [[11, 12, 13], [14, PAD, PAD], [15, 16, PAD], [17, 18, 19]]
    # completion positions continue after each row's own prompt length (4 or 2)
    assert b.positions.tolist() == [[4, 5, 6], [2, 3, 4], [4, 5, 6], [2, 3, 4]]
    assert b.attention[1].tolist() == [0, 0, 1, 1] + [1, 0, 0]


def reference_logprobs(model, sample):
    """The plain way: one unpadded row, full forward, shift by one."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    logits = model(input_ids=ids).logits[:, len(sample.prompt_ids) - 1 : -1]
    return gather_logprobs(logits, torch.tensor([sample.completion_ids]))[0]


def lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_packed_logprobs_and_gradients_equal_row_by_row(model):
    batch = pack(SAMPLES, PAD)
    model.zero_grad()
    logp, _ = forward_logprobs(model, batch)
    weights = torch.tensor([s.advantage for s in SAMPLES])[:, None]
    (logp * batch.target_mask * weights).sum().backward()
    packed = lora_grads(model)

    model.zero_grad()
    total = 0
    for row, s in enumerate(SAMPLES):
        ref = reference_logprobs(model, s)
        torch.testing.assert_close(logp[row][batch.target_mask[row]], ref, atol=1e-5, rtol=1e-5)
        total = total + (ref * s.advantage).sum()
    total.backward()
    reference = lora_grads(model)
    assert packed.keys() == reference.keys() and packed
    for name in packed:
        torch.testing.assert_close(packed[name], reference[name], atol=1e-5, rtol=1e-4)
    assert any(float(g.abs().sum()) > 0 for g in packed.values())


def test_single_token_completions_need_no_second_forward(model):
    batch = pack([TrainSample(P1, [3], 1.0), TrainSample(P1, [4], 1.0)], PAD)
    assert batch.inputs.shape == (2, 0)
    logp, _ = forward_logprobs(model, batch)
    torch.testing.assert_close(logp[:, 0], torch.stack([reference_logprobs(model, TrainSample(P1, [t], 0))[0]
                                                        for t in (3, 4)]), atol=1e-5, rtol=1e-5)


def test_micro_batches_keep_prompt_groups_together_within_size():
    samples = [TrainSample([1] * (i % 3 + 1), [2], 1.0) for i in range(9)]  # 3 prompts x 3 rows
    batches = micro_batches(samples, list(range(9)), size=6)
    assert sorted(i for b in batches for i in b) == list(range(9))
    assert all(len(b) <= 6 for b in batches)
    for b in batches:  # every group lies whole in one batch
        keys = {tuple(samples[i].prompt_ids) for i in b}
        assert all(sum(tuple(samples[i].prompt_ids) == k for i in range(9)) == sum(
            tuple(samples[i].prompt_ids) == k for i in b) for k in keys)
    # a group larger than the micro-batch is split
    assert [len(b) for b in micro_batches(samples, [0, 3, 6], size=2)] == [2, 1]
