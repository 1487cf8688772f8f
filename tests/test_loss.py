"""Loss masking and aggregation: collate, token log-probs, clipped surrogate, k3 KL.

A tiny random Qwen2 (no download) supplies real logits; expected values come from hand computations
or plain loops written here.
"""
from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2ForCausalLM

from magrpo.loss import k3_kl, policy_loss, sequence_weights, token_logprobs
from magrpo.update import TrainSample
from tests.fakes import loss_settings, tiny_qwen2

PAD = 63

# Three sequences: (prompt length, completion length) = (3, 2), (2, 4), (4, 1) -> widths 5, 6, 5
SAMPLES = [
    TrainSample(prompt_ids=[5, 6, 7], completion_ids=[8, 9], advantage=1.5),
    TrainSample(prompt_ids=[10, 11], completion_ids=[12, 13, 14, 15], advantage=-0.5),
    TrainSample(prompt_ids=[16, 17, 18, 19], completion_ids=[20], advantage=2.0),
]
MAX_NEW_TOKENS = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    m = tiny_qwen2(vocab_size=64, num_hidden_layers=1).eval()
    # random init is near-uniform; sharpen the output so log-probs clearly depend on the inputs
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
    return m


WIDTH = 6  # max(prompt + completion) over SAMPLES


def _spans():
    """(row, first completion position, end) from the sample lengths, independent of collate:
    rows are left-padded, so every completion ends in the last column."""
    return [(i, WIDTH - len(s.completion_ids), WIDTH) for i, s in enumerate(SAMPLES)]


# ---------------------------------------------------------------- dense rows (test scaffolding)


def collate(samples, pad_id):
    """[left padding | prompt | completion] rows and their completion mask, for feeding a model."""
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    target = torch.zeros((len(samples), width), dtype=torch.bool)
    for row, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[row, width - p - c :] = torch.tensor(s.prompt_ids + s.completion_ids)
        attention[row, width - p - c :] = 1
        target[row, width - c :] = True
    return ids, attention, target


def test_scaffold_rows_end_with_the_completion():
    _, _, target = collate(SAMPLES, pad_id=PAD)
    assert target.shape == (3, WIDTH)
    assert target.sum(dim=1).tolist() == [2, 4, 1]
    assert target[:, -1].all()


# ---------------------------------------------------------------- token_logprobs


def test_token_logprobs_matches_a_plain_loop():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=gen) * 3
    ids = torch.randint(0, 7, (2, 5), generator=gen)
    expected = torch.zeros(2, 5)
    for b in range(2):
        for t in range(1, 5):
            row = logits[b, t - 1]
            expected[b, t] = row[ids[b, t]] - math.log(sum(math.exp(float(x)) for x in row))
    got = token_logprobs(logits, ids)
    assert got.shape == (2, 5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(got[:, 0] == 0)


# ---------------------------------------------------------------- aggregation weights


@pytest.mark.parametrize(
    "agg, expected",
    [
        ("token_mean", [1 / 7, 1 / 7, 1 / 7]),  # 2 + 4 + 1 = 7 completion tokens
        ("seq_mean", [1 / (2 * 3), 1 / (4 * 3), 1 / (1 * 3)]),  # 1 / (len_i * B), B = 3
        ("dr_grpo", [1 / 18, 1 / 18, 1 / 18]),  # 1 / (B * max_new_tokens) = 1 / (3 * 6)
    ],
)
def test_sequence_weights_by_hand(agg, expected):
    w = sequence_weights(agg, torch.tensor([2, 4, 1]), MAX_NEW_TOKENS)
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float32))


# ---------------------------------------------------------------- masking through a real model


def _logp_from(model, embeds, attention, target_ids):
    """Logits from fixed input embeddings; the ids only pick the scored targets."""
    return token_logprobs(model(inputs_embeds=embeds, attention_mask=attention).logits, target_ids)


def _batch(model):
    ids, attention, target = collate(SAMPLES, pad_id=PAD)
    embeds = model.get_input_embeddings()(ids).detach()
    adv = torch.tensor([s.advantage for s in SAMPLES])
    return ids, attention, target, embeds, adv


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "dr_grpo"])
def test_on_policy_loss_value_and_gradient_match_loop_reference(model, agg):
    ids, attention, target, embeds, adv = _batch(model)
    lengths = torch.tensor([len(s.completion_ids) for s in SAMPLES])
    w = sequence_weights(agg, lengths, MAX_NEW_TOKENS)

    embeds = embeds.clone().requires_grad_(True)
    logp = _logp_from(model, embeds, attention, ids)
    loss, stats = policy_loss(logp, logp.detach(), adv, target, w, loss_settings(clip_eps=0.2))
    (grad,) = torch.autograd.grad(loss, embeds)

    # reference surrogate from the sample lengths (not the target mask): -sum_i w_i sum_t A_i logp_it
    ref_embeds = embeds.detach().clone().requires_grad_(True)
    ref_logp = _logp_from(model, ref_embeds, attention, ids)
    ref = torch.zeros(())
    value = 0.0
    for i, start, end in _spans():
        for t in range(start, end):
            ref = ref - w[i] * adv[i] * ref_logp[i, t]
            value -= float(w[i]) * float(adv[i])  # ratio is exactly 1 on policy: each token adds -w_i A_i
    (ref_grad,) = torch.autograd.grad(ref, ref_embeds)

    torch.testing.assert_close(loss, torch.tensor(value), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)
    assert ref_grad.abs().sum() > 0
    assert stats["clipped_tokens"] == 0


def test_token_mean_loss_value_by_hand():
    # on policy, token_mean: -(1/7) * (2*1.5 + 4*(-0.5) + 1*2.0) = -(3 - 2 + 2)/7 = -3/7
    ids, _, target = collate(SAMPLES, pad_id=PAD)
    logp = torch.randn(ids.shape)
    w = sequence_weights("token_mean", torch.tensor([2, 4, 1]), MAX_NEW_TOKENS)
    loss, _ = policy_loss(logp, logp.clone(), torch.tensor([1.5, -0.5, 2.0]), target, w, loss_settings(clip_eps=0.2))
    torch.testing.assert_close(loss, torch.tensor(-3 / 7))


def _off_policy_loss(model, target_ids, embeds_override=None):
    """Loss with frozen old log-probs (from the unmodified batch) so the value depends on every
    scored log-prob; clip_eps is huge so the clip never hides a change."""
    ids, attention, target, embeds, adv = _batch(model)
    with torch.no_grad():
        old = _logp_from(model, embeds, attention, ids) - 0.3
        e = embeds if embeds_override is None else embeds_override
        logp = _logp_from(model, e, attention, target_ids)
        w = sequence_weights("seq_mean", torch.tensor([2, 4, 1]), MAX_NEW_TOKENS)
        loss, _ = policy_loss(logp, old, adv, target, w, loss_settings(clip_eps=1e6))
    return loss


def test_padding_and_prompt_targets_do_not_change_the_loss(model):
    ids, *_ = _batch(model)
    base = _off_policy_loss(model, ids)

    pad_changed = ids.clone()
    pad_changed[0, 0] = 3  # row 0: 5 tokens in width 6, position 0 is padding
    pad_changed[2, 0] = 4  # row 2: likewise
    torch.testing.assert_close(_off_policy_loss(model, pad_changed), base, rtol=0, atol=0)

    prompt_changed = ids.clone()
    prompt_changed[0, 1:4] = torch.tensor([40, 41, 42])  # prompt targets (after the left padding)
    prompt_changed[1, 0:2] = torch.tensor([43, 44])
    prompt_changed[2, 1:5] = torch.tensor([45, 46, 47, 48])
    torch.testing.assert_close(_off_policy_loss(model, prompt_changed), base, rtol=0, atol=0)


@pytest.mark.parametrize("row, pos", [(0, 5), (1, 5), (2, 5)])
def test_last_completion_token_contributes(model, row, pos):
    # left padding: every row's last completion token sits in the last column (for row 2 the only one)
    ids, *_ = _batch(model)
    base = _off_policy_loss(model, ids)
    changed = ids.clone()
    changed[row, pos] = (int(ids[row, pos]) + 17) % 63
    assert abs(float(_off_policy_loss(model, changed)) - float(base)) > 1e-6


def test_padding_inputs_are_invisible_and_get_no_gradient(model):
    ids, attention, target, embeds, adv = _batch(model)
    w = sequence_weights("token_mean", torch.tensor([2, 4, 1]), MAX_NEW_TOKENS)
    x = embeds.clone().requires_grad_(True)
    logp = _logp_from(model, x, attention, ids)
    loss, _ = policy_loss(logp, logp.detach(), adv, target, w, loss_settings(clip_eps=0.2))
    (grad,) = torch.autograd.grad(loss, x)
    for i, _start, end in _spans():
        pads = WIDTH - len(SAMPLES[i].prompt_ids) - len(SAMPLES[i].completion_ids)
        # left padding is masked out as keys: nothing depends on it
        assert torch.all(grad[i, :pads] == 0), f"row {i}"
        # the last real position predicts nothing: no scored target depends on it
        assert torch.all(grad[i, end - 1 :] == 0), f"row {i}"
        # every real position before it conditions a scored completion token
        assert torch.all(grad[i, pads : end - 1].abs().sum(-1) > 0), f"row {i}"

    # replacing the padding inputs themselves leaves the loss unchanged (masked keys)
    noisy = embeds.clone()
    noisy[0, 0] += 5.0
    noisy[2, 0] -= 5.0
    torch.testing.assert_close(_off_policy_loss(model, ids, noisy), _off_policy_loss(model, ids), rtol=0, atol=0)


# ---------------------------------------------------------------- clipped surrogate by hand


def test_clipped_surrogate_positive_advantage_by_hand():
    # r = [1.5, 0.7, 1.1], eps 0.2, A = +2, seq weight 0.5
    #   r=1.5: min(3.0, 1.2*2=2.4) = 2.4  (clip bites: r > 1+eps, A > 0)
    #   r=0.7: min(1.4, 0.8*2=1.6) = 1.4
    #   r=1.1: min(2.2, 2.2)       = 2.2
    # loss = -0.5 * (2.4 + 1.4 + 2.2) = -3.0 ; d loss / d logp = -w*A*r where unclipped, 0 where clipped
    logp = torch.log(torch.tensor([[1.5, 0.7, 1.1]])).requires_grad_(True)
    loss, stats = policy_loss(logp, torch.zeros(1, 3), torch.tensor([2.0]), torch.ones(1, 3, dtype=torch.bool),
                              torch.tensor([0.5]), loss_settings(clip_eps=0.2))
    torch.testing.assert_close(loss, torch.tensor(-3.0))
    assert float(stats["clipped_tokens"]) == 1.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 * 2 * 0.7, -0.5 * 2 * 1.1]]))


def test_clipped_surrogate_negative_advantage_by_hand():
    # A = -1, weight 1:
    #   r=1.5: min(-1.5, -1.2) = -1.5 -> +1.5 (no bite: r high but A < 0)
    #   r=0.7: min(-0.7, -0.8) = -0.8 -> +0.8 (clip bites: r < 1-eps, A < 0)
    #   r=1.1: -1.1 -> +1.1
    # loss = 1.5 + 0.8 + 1.1 = 3.4
    logp = torch.log(torch.tensor([[1.5, 0.7, 1.1]]))
    loss, stats = policy_loss(logp, torch.zeros(1, 3), torch.tensor([-1.0]), torch.ones(1, 3, dtype=torch.bool),
                              torch.tensor([1.0]), loss_settings(clip_eps=0.2))
    torch.testing.assert_close(loss, torch.tensor(3.4))
    assert float(stats["clipped_tokens"]) == 1.0


def test_clipped_tokens_ignore_masked_positions():
    # same as the A=+2 case with token 0 masked out: only 1.4 + 2.2 remain, no clipped token left
    logp = torch.log(torch.tensor([[1.5, 0.7, 1.1]]))
    mask = torch.tensor([[False, True, True]])
    loss, stats = policy_loss(logp, torch.zeros(1, 3), torch.tensor([2.0]), mask, torch.tensor([0.5]),
                              loss_settings(clip_eps=0.2))
    torch.testing.assert_close(loss, torch.tensor(-0.5 * (1.4 + 2.2)))
    assert float(stats["clipped_tokens"]) == 0.0


def test_clipped_tokens_count_both_directions():
    # row 0 A=+1: r = [1.3 (bites), 0.5 (no), 1.0]; row 1 A=-1: r = [1.3 (no), 0.5 (bites), 0.79 (bites)]
    r = torch.tensor([[1.3, 0.5, 1.0], [1.3, 0.5, 0.79]])
    _, stats = policy_loss(torch.log(r), torch.zeros(2, 3), torch.tensor([1.0, -1.0]),
                           torch.ones(2, 3, dtype=torch.bool), torch.ones(2), loss_settings(clip_eps=0.2))
    assert float(stats["clipped_tokens"]) == 3.0


def test_policy_loss_adds_k3_kl_by_hand():
    # on policy (r = 1), A = 1: PPO part = -3; d = ref - logp = [0, ln2, -ln2]
    # k3 = [0, 2 - ln2 - 1, 0.5 + ln2 - 1] -> sum = 0.5 ; loss = -3 + 0.1 * 0.5 = -2.95
    logp = torch.zeros(1, 3)
    ref = torch.tensor([[0.0, math.log(2), -math.log(2)]])
    loss, stats = policy_loss(logp, logp.clone(), torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool),
                              torch.ones(1), loss_settings(clip_eps=0.2, kl_coef=0.1), ref_logp=ref)
    torch.testing.assert_close(loss, torch.tensor(-2.95))
    torch.testing.assert_close(stats["kl_sum"], torch.tensor(0.5))


# ---------------------------------------------------------------- k3 KL


def test_k3_kl_zero_when_equal():
    logp = torch.tensor([-0.1, -2.0, -5.5])
    assert torch.all(k3_kl(logp, logp.clone()) == 0)


def test_k3_kl_by_hand_and_positive():
    logp = torch.tensor([0.0, 0.0, -2.0])
    ref = torch.tensor([math.log(2), -1.0, 0.0])
    # d = ref - logp = [ln2, -1, 2]: exp(d) - d - 1 = [1 - ln2, e^-1, e^2 - 3]
    expected = torch.tensor([1 - math.log(2), math.exp(-1), math.exp(2) - 3])
    got = k3_kl(logp, ref)
    torch.testing.assert_close(got, expected)
    assert torch.all(got > 0)
