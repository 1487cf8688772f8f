"""Policy-gradient loss pieces: pure tensor functions, no model.

Shapes: B sequences, L positions. A batch row is [prompt | completion | right padding]; the
`target_mask` marks the positions whose *token* is a completion token (EOS included), so prompt and
padding never contribute and the last completion token is scored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from . import vocab
from .registry import Registry

# weights(lengths (B,), max_new_tokens, num_sequences, num_tokens) -> per-token weight of each
# sequence (B,). The loss is sum_i w_i * sum_t l_it, so micro-batches (and data-parallel ranks, which
# pass the global num_sequences and num_tokens) simply add up to the full-batch loss.
LOSS_AGGS: Registry[Callable[[torch.Tensor, int, int, int], torch.Tensor]] = Registry("loss_agg")


@LOSS_AGGS.register("token_mean")
def token_mean_weights(lengths: torch.Tensor, max_new_tokens: int, num_sequences: int, num_tokens: int) -> torch.Tensor:
    """Every completion token of the agent's batch counts equally (DAPO-style)."""
    return torch.full_like(lengths, 1.0 / max(1, num_tokens), dtype=torch.float32)


@LOSS_AGGS.register("seq_mean")
def seq_mean_weights(lengths: torch.Tensor, max_new_tokens: int, num_sequences: int, num_tokens: int) -> torch.Tensor:
    """Mean over tokens within a sequence, then over sequences (original GRPO)."""
    return 1.0 / (lengths.float().clamp(min=1) * num_sequences)


@LOSS_AGGS.register("dr_grpo")
def dr_grpo_weights(lengths: torch.Tensor, max_new_tokens: int, num_sequences: int, num_tokens: int) -> torch.Tensor:
    """Constant normaliser (Dr. GRPO, arXiv:2503.20783): no length bias."""
    return torch.full_like(lengths, 1.0 / (num_sequences * max_new_tokens), dtype=torch.float32)


def sequence_weights(agg: str, lengths: torch.Tensor, max_new_tokens: int, num_sequences: int | None = None,
                     num_tokens: int | None = None, timeout_s: float = 0) -> torch.Tensor:
    """(B,) per-token weight for each of the agent's B sequences this step. The counts default to
    these B sequences; a data-parallel rank passes the counts over all ranks. A plugin's aggregation
    runs under limits.user_code_timeout_s (`timeout_s`)."""
    num_sequences = len(lengths) if num_sequences is None else num_sequences
    num_tokens = int(lengths.sum()) if num_tokens is None else num_tokens
    return LOSS_AGGS.hook(agg, timeout_s)(lengths, max_new_tokens, num_sequences, num_tokens)


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (B, L, V) predicting targets (B, L) -> (B, L) float32 log-probs of the targets under
    logits / temperature: gather - logsumexp, a few rows at a time (magrpo/vocab.py)."""
    return vocab.target_logprobs(logits, targets, temperature)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (B, L, V) -> (B, L) entropy of softmax(logits / temperature), in nats (magrpo/vocab.py)."""
    return vocab.entropy(logits, temperature)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logits (B, L, V), input_ids (B, L) -> (B, L): log p(input_ids[:, t] | < t); position 0 is 0."""
    return torch.nn.functional.pad(gather_logprobs(logits[:, :-1], input_ids[:, 1:]), (1, 0))


# log_ratio(logp, old_logp, target_mask) -> (B, L) log of the importance ratio each token is clipped with.
RATIO_LEVELS: Registry[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = Registry("ratio_level")


@RATIO_LEVELS.register("token")
def token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) of each token (PPO, GRPO)."""
    return logp - old_logp


@RATIO_LEVELS.register("sequence")
def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): every token of a completion carries log s_i, the
    mean of the completion's per-token log-ratios (the length-normalised sequence likelihood ratio),
    so the whole completion is clipped together; the gradient flows through the mean."""
    mask = target_mask.float()
    seq = ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return seq[:, None].expand_as(logp)


def kept_completions(finished: Sequence[bool], mask_truncated: bool) -> list[int]:
    """Indices of the completions that enter the loss: all, or with mask_truncated only those that
    ended with EOS (DAPO's overlong filtering, arXiv:2503.14476: a completion cut at max_new_tokens
    is not judged on an answer it never finished)."""
    return [i for i, done in enumerate(finished) if done or not mask_truncated]


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref) (Schulman): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


@dataclass(frozen=True)
class LossSettings:
    """The policy loss's own knobs (trainer.*; every default lives in magrpo.config)."""

    clip_eps: float
    clip_eps_high: float | None  # None: clip_eps
    ratio_level: str  # token | sequence (GSPO): RATIO_LEVELS
    kl_coef: float
    entropy_coef: float
    user_code_timeout_s: float = 0  # a plugin's ratio level (limits.user_code_timeout_s; 0: no limit)

    @classmethod
    def of(cls, cfg: Any) -> "LossSettings":
        trainer = cfg.trainer
        return cls(clip_eps=trainer.clip_eps, clip_eps_high=trainer.clip_eps_high, ratio_level=trainer.ratio_level,
                   kl_coef=trainer.kl_coef, entropy_coef=trainer.entropy_coef,
                   user_code_timeout_s=cfg.limits.user_code_timeout_s)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    target_mask: torch.Tensor,
    seq_weights: torch.Tensor,
    settings: LossSettings,
    ref_logp: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate (PPO/GRPO) plus optional k3 KL and entropy bonus, aggregated with
    per-sequence weights.

    logp, old_logp, target_mask, ref_logp, is_weights, entropy: (B, L); advantages, seq_weights: (B,).
    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high None: clip_eps), per
    token or per sequence (`RATIO_LEVELS`). is_weights (detached, e.g. truncated p_trainer /
    p_sampler) scale the policy-gradient term only. `entropy` (with gradient) enters as
    -entropy_coef * entropy per token; the KL needs `ref_logp`. With old_logp = logp.detach() the
    ratio is 1 and the gradient is the plain -A * grad log p. Returns the scalar loss and detached
    token sums for logging (clipped tokens, those clipped at the upper bound, KL).
    """
    clip_eps, kl_coef, entropy_coef = settings.clip_eps, settings.kl_coef, settings.entropy_coef
    high = clip_eps if settings.clip_eps_high is None else settings.clip_eps_high
    mask = target_mask.float()
    log_ratio = RATIO_LEVELS.hook(settings.ratio_level, settings.user_code_timeout_s)
    ratio = torch.exp(log_ratio(logp, old_logp, target_mask))
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights
    weights = seq_weights[:, None] * mask
    # Tokens whose gradient the clip removes: ratio beyond the trust region in the advantage's direction.
    clipped_high = (ratio > 1 + high) & (adv > 0)
    is_clipped = clipped_high | ((ratio < 1 - clip_eps) & (adv < 0))
    stats = {"clipped_tokens": (is_clipped.float() * mask).sum().detach(),
             "clipped_high_tokens": (clipped_high.float() * mask).sum().detach()}
    if entropy is not None and entropy_coef > 0:
        per_token = per_token - entropy_coef * entropy
    if ref_logp is not None and kl_coef > 0:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + kl_coef * kl
        stats["kl_sum"] = (kl * mask).sum().detach()
    loss = (per_token * weights).sum()
    stats["loss"] = loss.detach()
    return loss, stats
