"""The loss mask of issue 31: inserted tokens (a tool's output) sit in a completion, are attended to,
and contribute nothing to the loss, the KL, the entropy, the importance weights or the mismatch
metrics; the loss counts the model's tokens only. The update is backend-independent: both backends
hand it `Completion`s, so these tests drive `AgentUpdater.step` with the tiny model directly.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from magrpo.distributed import World
from magrpo.models import load_agents
from magrpo.tree import Completion
from magrpo.update import AgentUpdater, TrainSample, importance_weights, pack, sampler_logprobs
from tests.fakes import loss_settings, update_settings

PROMPT = [5, 6, 7]
MODEL_A, TOOL, MODEL_B = [20, 21, 22], [40, 41, 42, 43], [23, 24]
# every per-token term on, and the sampler's log-probs slightly off the trainer's (TIS, mismatch guard)
SETTINGS = update_settings(loss=loss_settings(kl_coef=0.3, entropy_coef=0.05), tis_cap=1.5, max_new_tokens=12,
                           ppo_epochs=1, max_grad_norm=0.0, temperature=0.7)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["lora", "full"])
def agent(request):
    """A LoRA agent, and a full-weight one (whose reference is a frozen copy of its initial weights)."""
    from tests.conftest import SMALL, compose

    cfg = compose([*SMALL, "lora.dropout=0.0", "trainer.kl_coef=0.3", f"agents=[{{finetune: {request.param}}}]"])
    torch.manual_seed(0)  # peft draws the adapters' A at load: the same agent in every process
    agent = load_agents(cfg, 1)[0]
    assert agent.finetune == request.param
    torch.manual_seed(0)
    with torch.no_grad():  # LoRA B starts at zero, a full agent at its reference: move off so the KL has a gradient
        for p in agent.trainable_parameters():
            p.add_((0.05 if request.param == "lora" else 0.01) * torch.randn_like(p))
    return agent


def gradient(agent, samples: list[TrainSample], settings=SETTINGS) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The LoRA gradient of one update step (lr 0: the weights stay put, so calls compare) and its metrics."""
    updater = AgentUpdater(agent, 0.0, 0.0, 0)
    stats = updater.step(samples, settings, micro_batch_size=8)
    return [p.grad.clone() for p in updater.params], stats


def sample(completion: list[int], advantage: float, mask: list[bool] | None, logprob: float = -2.0) -> TrainSample:
    model_tokens = len(completion) if mask is None else sum(mask)
    return TrainSample(PROMPT, completion, advantage, [logprob - 0.01 * i for i in range(model_tokens)], mask)


def mid_tool(advantage: float = 1.0) -> TrainSample:
    """model text, a tool's output, model text again"""
    c = Completion.from_segments([(MODEL_A, True), (TOOL, False), (MODEL_B, True)], "", PROMPT, True,
                                 [-2.0 - 0.01 * i for i in range(5)])
    return TrainSample(PROMPT, c.token_ids, advantage, c.logprobs, c.model_mask)


def trailing_tool(tool: list[int], mask: bool = True) -> list[TrainSample]:
    """A turn that ends in a tool's output (nothing after it reads those tokens as inputs), and a plain one."""
    ids = MODEL_A + tool
    return [sample(ids, 1.0, [True] * len(MODEL_A) + [False] * len(tool) if mask else None),
            sample([30, 31, 32, 33], -1.0, None)]


# ---------------------------------------------------------------- (a) inserted tokens add no gradient


def test_changing_a_trailing_tool_output_leaves_the_gradient_unchanged(agent):
    before, _ = gradient(agent, trailing_tool(TOOL))
    after, _ = gradient(agent, trailing_tool([50, 51, 52, 53]))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # the same change without the mask moves the gradient: the test can see a leak
    unmasked_before, _ = gradient(agent, trailing_tool(TOOL, mask=False))
    unmasked_after, _ = gradient(agent, trailing_tool([50, 51, 52, 53], mask=False))
    assert not all(torch.equal(a, b) for a, b in zip(unmasked_before, unmasked_after))


def dense_scores(model, x: TrainSample, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(C,) log-probs of the completion tokens and their (C, V) logits, from one unpadded forward."""
    ids = torch.tensor([x.prompt_ids + x.completion_ids], device=model.device)  # the model's device: also on a GPU
    p, c = len(x.prompt_ids), len(x.completion_ids)
    logits = model(input_ids=ids).logits[0, p - 1 : p + c - 1].float() / temperature
    return logits.log_softmax(-1).gather(-1, ids[0, p:, None])[:, 0], logits


def reference_gradient(agent, samples: list[TrainSample], settings=SETTINGS) -> list[torch.Tensor]:
    """A dense loop: each row run whole, unpadded ([prompt | completion], no KV-cache packing), and the
    on-policy loss (ratio 1) summed over the model's tokens by hand, token_mean over model tokens."""
    model, params, s = agent.model, agent.trainable_parameters(), settings
    agent.train_mode()
    for p in params:
        p.grad = None
    model_tokens = sum(sum(x.model_mask) if x.model_mask else len(x.completion_ids) for x in samples)
    total = torch.zeros((), device=model.device)
    for x in samples:
        c = len(x.completion_ids)
        logp, logits = dense_scores(model, x, s.temperature)
        with torch.no_grad(), agent.reference_model() as reference:
            ref = dense_scores(reference, x, s.temperature)[0]
        probs = logits.softmax(-1)
        entropy = -(probs * logits.log_softmax(-1)).sum(-1)
        mask = x.model_mask or [True] * c
        sampled = iter(x.sampler_logprobs)
        for t in range(c):
            if not mask[t]:
                continue
            weight = min(float(torch.exp(logp[t].detach() - next(sampled))), s.tis_cap)
            delta = ref[t] - logp[t]
            term = (-x.advantage * weight * torch.exp(logp[t] - logp[t].detach())
                    + s.loss.kl_coef * (torch.exp(delta) - delta - 1) - s.loss.entropy_coef * entropy[t])
            total = total + term / model_tokens
    total.backward()
    return [q.grad.clone() for q in params]


def test_masked_update_matches_a_dense_reference_over_model_tokens(agent):
    samples = [mid_tool(1.0), sample([30, 31, 32, 33], -0.5, None), mid_tool(-2.0)]
    samples[2].prompt_ids = [8, 9]  # a second prompt: two packed prompt groups
    got, stats = gradient(agent, samples)
    want = reference_gradient(agent, samples)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))  # dense vs packed rounding
    assert stats["completion_len"] == (5 + 4 + 5) / 3  # model tokens per completion


def test_tis_and_the_mismatch_guard_skip_inserted_positions():
    # inserted positions have no sampling log-prob: whatever a backend might put there cannot reach TIS
    samples = [mid_tool(1.0)]
    batch = pack(samples, pad_id=0)
    behaviour = sampler_logprobs(samples, torch.zeros(batch.targets.shape))
    assert behaviour[0, 3:7].eq(0).all()  # the tool's four positions
    trainer = behaviour + 0.1 * batch.target_mask  # p_trainer / p_sampler = e^0.1 at model tokens
    trainer[0, 3:7] = 5.0  # wildly off, at the masked positions only
    weights, seen = importance_weights(trainer, samples, batch.target_mask, 2.0)
    assert seen["tokens"] == 5 and seen["capped"] == 0
    assert abs(seen["abs_sum"] - 0.5) < 1e-5


# ---------------------------------------------------------------- (b) the mask lines up with the tokens


def test_mask_is_true_exactly_at_the_model_segments_token_for_token():
    segments = [([11, 12], True), ([13], False), ([14, 15, 16], True), ([17, 18], False)]
    c = Completion.from_segments(segments, "", PROMPT, True, logprobs=[-0.11, -0.12, -0.14, -0.15, -0.16])
    assert c.token_ids == [11, 12, 13, 14, 15, 16, 17, 18]
    assert c.model_mask == [True, True, False, True, True, True, False, False]
    x = TrainSample(c.prompt_ids, c.token_ids, 1.0, c.logprobs, c.model_mask)
    batch = pack([x, TrainSample(PROMPT, [11], 1.0, [-0.11])], pad_id=0)
    assert batch.target_mask[0].tolist() == c.model_mask
    assert batch.target_mask[1].tolist() == [True] + [False] * 7
    # inserted tokens stay inputs: attended to like model tokens (all but the last completion token)
    assert batch.attention[0, len(PROMPT):].tolist() == [1] * 7
    # each model token's sampling log-prob sits at its own position (-token / 100 here)
    behaviour = sampler_logprobs([x], batch.targets[:1].float())[0]
    for t, (token, model) in enumerate(zip(c.token_ids, c.model_mask)):
        assert behaviour[t].item() == pytest.approx(-token / 100 if model else 0.0)


def test_a_turn_without_inserted_tokens_has_no_mask():
    c = Completion.from_segments([([1, 2], True), ([3], True)], "", PROMPT, True, [-1.0, -1.0, -1.0])
    assert c.model_mask is None and c.token_ids == [1, 2, 3]


@pytest.mark.parametrize("mask, logprobs, words", [
    ([True, False], None, "2 entries for 3 tokens"),
    ([True, False, True], [-1.0, -1.0, -1.0], "3 sampling log-probs for 2 model tokens"),
])
def test_a_misaligned_mask_is_refused(mask, logprobs, words):
    with pytest.raises(ValueError, match=words):
        Completion([1, 2, 3], "", PROMPT, True, logprobs, mask)


# ---------------------------------------------------------------- counts, metrics


def test_loss_normalisers_and_metrics_count_model_tokens_only(agent):
    samples = [mid_tool(1.0), sample([30, 31, 32, 33], -0.5, None)]
    updater = AgentUpdater(agent, 0.0, 0.0, 0)
    assert updater.batch_counts(samples, 0.0, World()) == (2.0, 9.0, 2.0)  # 5 + 4 model tokens
    _, stats = gradient(agent, samples)
    assert stats["masked_token_share"] == pytest.approx(4 / 13)
    _, plain = gradient(agent, [sample([30, 31, 32, 33], -0.5, None)])
    assert "masked_token_share" not in plain  # runs without tools log what they did before


# ---------------------------------------------------------------- (c) no mask: the update as before


def test_an_all_model_mask_gives_the_bit_identical_update(agent):
    plain = [sample([30, 31, 32, 33], 1.0, None), sample([34, 35], -1.0, None)]
    masked = [sample([30, 31, 32, 33], 1.0, [True] * 4), sample([34, 35], -1.0, [True] * 2)]
    for agg in ("token_mean", "seq_mean", "dr_grpo"):
        settings = replace(SETTINGS, loss_agg=agg)
        (g0, s0), (g1, s1) = gradient(agent, plain, settings), gradient(agent, masked, settings)
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
        assert s1.pop("masked_token_share") == 0.0 and s0 == s1


def test_the_trainer_hands_the_mask_to_the_update():
    from types import SimpleNamespace

    import numpy as np

    from magrpo.trainer import _samples_of

    c = Completion.from_segments([(MODEL_A, True), (TOOL, False)], "", PROMPT, True, [-1.0] * 3)
    node = SimpleNamespace(completions=[[c]], advantages=np.ones((1, 1)))
    assert _samples_of(SimpleNamespace(nodes=[node]), 0)[0].model_mask == c.model_mask
