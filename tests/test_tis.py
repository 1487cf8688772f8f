"""Train/inference mismatch: truncated importance weights from the backend's sampling log-probs,
applied to the policy-gradient term only, and the metrics they report (hand-computed values)."""
from __future__ import annotations

import math

import torch

from magrpo.loss import policy_loss
from magrpo.update import TrainSample, importance_weights, sampler_logprobs
from tests.fakes import loss_settings

# Two rows; row 1 has one completion token (the rest is padding).
TRAINER = torch.tensor([[math.log(0.5), math.log(0.2)], [math.log(0.9), 0.0]])
SAMPLES = [TrainSample([1], [5, 6], 1.0, [math.log(0.25), math.log(0.2)]), TrainSample([1], [7], 1.0, [math.log(0.3)])]
MASK = torch.tensor([[True, True], [True, False]])


def test_sampler_logprobs_align_with_targets_and_need_every_row():
    torch.testing.assert_close(sampler_logprobs(SAMPLES, TRAINER),
                               torch.tensor([[math.log(0.25), math.log(0.2)], [math.log(0.3), 0.0]]))
    assert sampler_logprobs([SAMPLES[0], TrainSample([1], [7], 1.0)], TRAINER) is None


def testimportance_weights_by_hand():
    # p_trainer / p_sampler per token: [0.5/0.25, 0.2/0.2] = [2, 1]; [0.9/0.3] = [3] (padding ignored)
    weights, totals = importance_weights(TRAINER, SAMPLES, MASK, 2.5)
    torch.testing.assert_close(weights[MASK], torch.tensor([2.0, 1.0, 2.5]))  # 3 capped at 2.5
    assert totals["tokens"] == 3 and totals["capped"] == 1
    assert math.isclose(totals["weight_sum"], 6.0, rel_tol=1e-5)  # metrics use the uncapped weights
    assert math.isclose(totals["abs_sum"], math.log(2) + 0 + math.log(3), rel_tol=1e-5)


def test_no_cap_no_weights_but_metrics_still_counted():
    weights, totals = importance_weights(TRAINER, SAMPLES, MASK, 0.0)
    assert weights is None and totals["tokens"] == 3


def test_is_weights_scale_the_policy_gradient_term_only():
    # on policy (r = 1), A = 1, weight 1: PPO part = -(w0 + w1) = -(2 + 0.5); KL part unweighted
    logp = torch.zeros(1, 2)
    ref = torch.tensor([[math.log(2), 0.0]])  # k3 = [2 - ln2 - 1, 0]
    loss, _ = policy_loss(logp, logp.clone(), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), torch.ones(1),
                          loss_settings(clip_eps=0.2, kl_coef=0.1), ref_logp=ref, is_weights=torch.tensor([[2.0, 0.5]]))
    torch.testing.assert_close(loss, torch.tensor(-2.5 + 0.1 * (1 - math.log(2))))
