"""Loss options (issue 16, point 4): GSPO's sequence-level ratio, DAPO's clip-higher, overlong
masking, dynamic sampling and the entropy bonus. Expected values are computed by hand in the comments."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from magrpo.advantage import all_groups_flat
from magrpo.config import ConfigError
from magrpo.loss import kept_completions, policy_loss, sequence_log_ratio, token_entropy
from magrpo.rollout import expand_trees
from magrpo.trainer import prepare, train
from magrpo.tree import align_joint_actions, cross_joint_actions
from tests.fakes import (
    PROBLEMS,
    SAMPLING,
    TEXT,
    FakeBackend,
    FakeEnv,
    RecordingFeedback,
    loss_settings,
    serial,
    tree_settings,
)
from tests.test_train_smoke import lora_tensors, read_jsonl

# ---------------------------------------------------------------- GSPO: sequence-level ratio

# Row 0: token ratios [1.5, 0.5] (+ a padded position); row 1: one token, ratio 1.2.
LOGP = torch.log(torch.tensor([[1.5, 0.5, 7.0], [1.2, 3.0, 3.0]]))
MASK = torch.tensor([[True, True, False], [True, False, False]])


def test_sequence_log_ratio_is_the_mean_log_ratio_of_each_completion():
    # row 0: (ln 1.5 + ln 0.5) / 2 = ln(0.75) / 2, i.e. s = sqrt(0.75); row 1: s = 1.2 (padding ignored)
    got = sequence_log_ratio(LOGP, torch.zeros(2, 3), MASK)
    want = torch.tensor([[math.log(0.75) / 2] * 3, [math.log(1.2)] * 3])
    torch.testing.assert_close(got, want)


def test_gspo_clips_whole_completions_by_hand():
    # clip_eps 0.1, A = [+1, +1], seq weights [0.5, 1]:
    #   row 0: s = 0.8660 -> min(0.8660, clamp(0.8660, 0.9, 1.1) = 0.9) = 0.8660 on both tokens
    #          -> -0.5 * 2 * 0.8660 = -0.8660 (not clipped: s < 1 - eps but A > 0)
    #   row 1: s = 1.2 -> min(1.2, 1.1) = 1.1 -> -1.1 (clipped at the top: no gradient)
    # loss = -0.8660 - 1.1 = -1.9660
    # gradient, row 0: d(-s)/d logp_t = -s * 1/2 = -0.4330 per completion token, 0 at padding
    logp = LOGP.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), MASK, torch.tensor([0.5, 1.0]),
                              loss_settings(clip_eps=0.1, ratio_level="sequence"))
    s0 = math.sqrt(0.75)
    torch.testing.assert_close(loss, torch.tensor(-s0 - 1.1))
    assert float(stats["clipped_tokens"]) == 1.0 and float(stats["clipped_high_tokens"]) == 1.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0 / 2, -s0 / 2, 0.0], [0.0, 0.0, 0.0]]))


def test_token_level_ratio_differs_on_the_same_batch():
    # token level, row 0: 1.5 -> clipped to 1.1, 0.5 -> 0.5: -0.5 * (1.1 + 0.5) = -0.8; row 1 as above: -1.1
    loss, stats = policy_loss(LOGP, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), MASK, torch.tensor([0.5, 1.0]),
                              loss_settings(clip_eps=0.1))
    torch.testing.assert_close(loss, torch.tensor(-0.8 - 1.1))
    assert float(stats["clipped_tokens"]) == 2.0


def test_sequence_and_token_ratio_give_the_same_gradient_on_policy():
    # ratio 1 (ppo_epochs = 1): both are -w * A * grad log p per token
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]], requires_grad=True)
    grads = []
    for level in ("token", "sequence"):
        loss, _ = policy_loss(logp, logp.detach(), torch.tensor([2.0, -1.0]), MASK, torch.tensor([0.5, 1.0]),
                              loss_settings(clip_eps=0.2, ratio_level=level))
        grads.append(torch.autograd.grad(loss, logp)[0])
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- DAPO: clip-higher


def test_clip_higher_raises_only_the_upper_bound_by_hand():
    # A = +1, weight 1, ratios [1.25, 1.35, 0.7], clip_eps 0.2, clip_eps_high 0.28 -> range [0.8, 1.28]
    #   1.25 -> 1.25 (inside); 1.35 -> 1.28 (clipped high); 0.7 -> min(0.7, 0.8) = 0.7 (A > 0: no bite)
    #   loss = -(1.25 + 1.28 + 0.7) = -3.23; symmetric 0.2: -(1.2 + 1.2 + 0.7) = -3.1 with 2 clipped
    r = torch.tensor([[1.25, 1.35, 0.7]])
    ones = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(torch.log(r), torch.zeros(1, 3), torch.tensor([1.0]), ones, torch.ones(1),
                              loss_settings(clip_eps=0.2, clip_eps_high=0.28))
    torch.testing.assert_close(loss, torch.tensor(-3.23))
    assert float(stats["clipped_tokens"]) == 1.0 and float(stats["clipped_high_tokens"]) == 1.0
    loss, stats = policy_loss(torch.log(r), torch.zeros(1, 3), torch.tensor([1.0]), ones, torch.ones(1),
                              loss_settings(clip_eps=0.2))
    torch.testing.assert_close(loss, torch.tensor(-3.1))
    assert float(stats["clipped_tokens"]) == 2.0 and float(stats["clipped_high_tokens"]) == 2.0
    # A = -1, ratios [0.7, 1.35]: 0.7 -> -min(-0.7, -0.8) = +0.8 (clipped low); 1.35 -> -min(-1.35, -1.28) = +1.35
    loss, stats = policy_loss(torch.log(torch.tensor([[0.7, 1.35]])), torch.zeros(1, 2), torch.tensor([-1.0]),
                              torch.ones(1, 2, dtype=torch.bool), torch.ones(1), loss_settings(clip_eps=0.2,
                                                                                               clip_eps_high=0.28))
    torch.testing.assert_close(loss, torch.tensor(0.8 + 1.35))
    assert float(stats["clipped_tokens"]) == 1.0 and float(stats["clipped_high_tokens"]) == 0.0


# ---------------------------------------------------------------- entropy bonus


def test_entropy_bonus_by_hand():
    # on policy, A = 0: only the bonus: -coef * w * sum of the unmasked entropies
    # = -0.1 * 0.5 * (0.5 + 1.0) = -0.075; d loss / d entropy = -0.05 on completion tokens, 0 elsewhere
    entropy = torch.tensor([[0.5, 1.0, 2.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    logp = torch.zeros(1, 3)
    loss, _ = policy_loss(logp, logp, torch.zeros(1), mask, torch.tensor([0.5]),
                          loss_settings(clip_eps=0.2, entropy_coef=0.1), entropy=entropy)
    torch.testing.assert_close(loss, torch.tensor(-0.075))
    loss.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.05, -0.05, 0.0]]))
    off, _ = policy_loss(logp, logp, torch.zeros(1), mask, torch.tensor([0.5]), loss_settings(clip_eps=0.2),
                         entropy=entropy)
    assert float(off) == 0.0  # entropy_coef 0: no bonus


def test_token_entropy_gradient_raises_the_entropy():
    # logits [0, ln 3]: p = [1/4, 3/4], H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623 nats;
    # dH/dz_i = -p_i (ln p_i + H): [-(1/4)(-1.3863 + 0.5623), -(3/4)(-0.2877 + 0.5623)] = [0.2060, -0.2060]
    logits = torch.tensor([[[0.0, math.log(3)]]], requires_grad=True)
    h = token_entropy(logits)
    want = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(h, torch.tensor([[want]]))
    h.sum().backward()
    g = 0.25 * (math.log(0.25) + want)
    torch.testing.assert_close(logits.grad, torch.tensor([[[-g, g]]]))


# ---------------------------------------------------------------- overlong masking


def test_kept_completions_drop_only_truncated_ones_when_asked():
    finished = [True, False, True, False]
    assert kept_completions(finished, mask_truncated=True) == [0, 2]
    assert kept_completions(finished, mask_truncated=False) == [0, 1, 2, 3]
    assert kept_completions([False, False], mask_truncated=True) == []


# ---------------------------------------------------------------- dynamic sampling


def test_all_groups_flat_by_hand():
    align = align_joint_actions(2, 2)
    assert all_groups_flat(align, np.array([1.0, 1.0]), 2, "mean")
    assert not all_groups_flat(align, np.array([1.0, 2.0]), 2, "mean")
    cross = cross_joint_actions(2, 2)  # (0,0), (0,1), (1,0), (1,1)
    # rewards [1, -1, -1, 1]: agent 0 credit k0 = (1 - 1)/2 = 0, k1 = (-1 + 1)/2 = 0; agent 1 the same:
    # every group is flat although the rewards vary
    assert all_groups_flat(cross, np.array([1.0, -1.0, -1.0, 1.0]), 2, "mean")
    # [0, 1, 1, 2]: agent 0 credit [0.5, 1.5]
    assert not all_groups_flat(cross, np.array([0.0, 1.0, 1.0, 2.0]), 2, "sum")


def flat_until(uid_above: int):
    """Reward 1 (flat) while agent 0's completion has uid <= uid_above, then its sample index k."""
    def reward(problem, texts):
        k, uid = (int(x) for x in TEXT.match(texts[0]).group(2, 3))
        return float(k) if uid > uid_above else 1.0
    return reward


def expand(reward, resample, problems=PROBLEMS[:1], turns=1):
    env, backend = FakeEnv(2, reward), FakeBackend()
    settings = tree_settings(num_generations=2, num_turns=turns, joint_mode="align", resample_zero_std=resample)
    return expand_trees(problems, env, backend, serial(RecordingFeedback(), env), settings, SAMPLING, seed=1), backend


@pytest.mark.parametrize("resample, calls, resampled, final_uids, flat", [
    (0, 1, 0, [1, 2], True),  # off: the first samples stay
    (1, 2, 1, [5, 6], True),  # one retry (uids 5..8), still flat: kept, counted
    (3, 3, 2, [9, 10], False),  # the second retry (uids 9..12) has variance: stops there
])
def test_dynamic_sampling_regenerates_flat_nodes_up_to_r_times(resample, calls, resampled, final_uids, flat):
    # one node, 2 agents x K=2 -> 4 uids per generation; rewards vary once agent 0's uid > 8
    rollout, backend = expand(flat_until(8), resample)
    (node,) = rollout.nodes
    assert backend.generate_calls == calls and rollout.resampled_nodes == resampled
    assert [int(TEXT.match(c.text).group(3)) for c in node.completions[0]] == final_uids
    assert (node.rewards == 1.0).all() == flat


def test_dynamic_sampling_regenerates_only_the_flat_nodes():
    # P0 (offset 0) scores 1 everywhere, P1 scores k0 + k1 + 0.25: only P0's node is regenerated, twice
    def reward(problem, texts):
        return 1.0 if problem["offset"] == 0 else sum(int(TEXT.match(t).group(2)) for t in texts) + 0.25

    rollout, backend = expand(reward, 2, problems=PROBLEMS)
    assert backend.requests_per_call == [4, 2, 2]  # 2 nodes x 2 agents, then P0's 2 agents twice
    assert rollout.resampled_nodes == 2
    np.testing.assert_allclose(rollout.nodes[1].rewards, [0.25, 2.25])


# ---------------------------------------------------------------- config and end to end


@pytest.mark.parametrize("override, words", [
    ("trainer.ratio_level=seq", "'seq' is not allowed; choose one of: sequence, token"),
    ("trainer.clip_eps_high=0", "must be > 0"),
    ("trainer.resample_zero_std=-1", "must be >= 0"),
    ("trainer.entropy_coef=-0.1", "must be >= 0"),
])
def test_bad_loss_options_are_one_line_config_errors(make_cfg, override, words):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: .*{words}"):
        prepare(make_cfg(override))


def test_gspo_clip_higher_and_entropy_bonus_train_and_log(make_cfg):
    # a tiny clip after a big first epoch: most completions clip, half of them at the top (A > 0)
    run = train(make_cfg("trainer.ppo_epochs=2", "trainer.ratio_level=sequence", "trainer.clip_eps=0.001",
                         "trainer.clip_eps_high=0.002", "trainer.entropy_coef=0.01", "trainer.lr=1e-2",
                         "eval.at_end=false"))
    for m in read_jsonl(run / "metrics.jsonl"):
        for a in (0, 1):
            assert 0 < m[f"train/agent_{a}/clip_frac_high"] < m[f"train/agent_{a}/clip_frac"] <= 1
            assert m[f"train/agent_{a}/trained_seqs"] == 12  # the bonus trains zero-advantage rows too
            assert m[f"train/agent_{a}/grad_norm"] > 0


def test_mask_truncated_leaves_cut_completions_out_of_the_loss(make_cfg):
    # 4 new tokens: the tiny model never reaches EOS, so every completion is cut and none trains
    run = train(make_cfg("trainer.mask_truncated=true", "generation.max_new_tokens=4", "trainer.lr=1e-2",
                         "eval.at_end=false"))
    for m in read_jsonl(run / "metrics.jsonl"):
        for a in (0, 1):
            assert m[f"train/agent_{a}/truncated_frac"] == 1.0
            assert m[f"train/agent_{a}/trained_seqs"] == 0 and m[f"train/agent_{a}/grad_norm"] == 0
    for a in (0, 1):  # LoRA B matrices start at zero: still zero, nothing trained
        assert all(not t.any() for k, t in lora_tensors(run, a).items() if "lora_B" in k)


def test_dynamic_sampling_counts_every_regenerated_node(make_cfg, monkeypatch):
    from magrpo.envs.length_ratio import LengthRatioEnv

    monkeypatch.setattr(LengthRatioEnv, "rewards", lambda self, problems, joint: [0.5] * len(joint))
    run = train(make_cfg("trainer.resample_zero_std=2", "eval.at_end=false"))
    # every node is flat and stays flat: (2 roots + 4 children) x 2 regenerations per step
    assert [m["train/resampled_nodes"] for m in read_jsonl(run / "metrics.jsonl")] == [12, 12]
