"""The update runs lm_head, log-softmax and entropy at the model's own completion tokens only: not at
padding, not at inserted tokens (a tool's output), not at prompts. Its numbers must be those of the
model's whole forward (the path models with transformed logits take), and zero where target_mask is
False."""
from __future__ import annotations

import pytest
import torch

from magrpo import update
from magrpo.update import TrainSample, forward_logprobs, pack
from tests.fakes import lora_tiny_qwen2

PAD = 0
P1, P2 = [5, 6, 7, 8], [9, 10]
SAMPLES = [  # other lengths (padding) and inserted tokens (model_mask False) in two rows
    TrainSample(P1, [11, 12, 13, 21, 22, 14], 1.0, model_mask=[True, True, False, False, True, True]),
    TrainSample(P2, [14], -1.0),
    TrainSample(P1, [15, 16], 0.5),
    TrainSample(P2, [17, 23, 24, 25, 18, 19], 2.0, model_mask=[True, False, False, False, True, True]),
]


@pytest.fixture(scope="module")
def model():
    return lora_tiny_qwen2()


def run(model, batch):
    """log-probs, entropy and the LoRA gradients of a loss that uses both (temperature 0.7)."""
    model.zero_grad()
    logp, entropy = forward_logprobs(model, batch, temperature=0.7, with_entropy=True, entropy_grad=True)
    weights = torch.tensor([s.advantage for s in SAMPLES])[:, None]
    ((logp * weights + 0.1 * entropy) * batch.target_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp.detach(), entropy.detach(), grads


def test_the_head_runs_on_model_tokens_only(model):
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1]))
    try:
        forward_logprobs(model, pack(SAMPLES, PAD), with_entropy=True)
    finally:
        hook.remove()
    assert rows == [torch.Size([sum(s.model_tokens for s in SAMPLES)])]  # 4 + 1 + 2 + 3 = 10 of 4 x 6


def test_model_token_path_equals_the_whole_forward(model, monkeypatch):
    batch = pack(SAMPLES, PAD)
    fast = run(model, batch)
    monkeypatch.setattr(update, "PLAIN_HEAD_TYPES", frozenset())  # qwen2 now takes the whole-forward path
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1]))
    try:
        whole = run(model, batch)
    finally:
        hook.remove()
    assert rows == [torch.Size([2, 1]), torch.Size([4, 5])]  # the fallback did run lm_head everywhere
    keep = batch.target_mask
    for got, want in zip(fast[:2], whole[:2]):
        torch.testing.assert_close(got[keep], want[keep], atol=1e-6, rtol=1e-6)
        assert not got[~keep].any()  # zero where no model token is: nothing reads it
    assert fast[2].keys() == whole[2].keys() and fast[2]
    for name in fast[2]:
        torch.testing.assert_close(fast[2][name], whole[2][name], atol=1e-6, rtol=1e-5)
