"""Per-agent policy update: batched, masked forward passes over the agent's own completions."""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from . import attention
from .distributed import World
from .loss import LossSettings, gather_logprobs, policy_loss, sequence_weights, token_entropy
from .models import Agent, cache_keyword


@dataclass
class TrainSample:
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    sampler_logprobs: list[float] | None = None  # the generation backend's log-probs of the model tokens
    model_mask: list[bool] | None = None  # Completion.model_mask: False at inserted tokens (a tool's output)

    @property
    def model_tokens(self) -> int:
        """Completion tokens the model sampled: what the loss counts."""
        return len(self.completion_ids) if self.model_mask is None else sum(self.model_mask)


def sampler_logprobs(samples: list[TrainSample], like: torch.Tensor) -> torch.Tensor | None:
    """(R, C) the backend's log-probs aligned with PackedBatch.targets (0 at padding and at inserted
    tokens, which have none); None when any is missing."""
    if any(s.sampler_logprobs is None for s in samples):
        return None
    out = torch.zeros(like.shape, dtype=like.dtype)  # filled on the CPU, moved once: one copy, not one per row
    for row, s in enumerate(samples):
        values = torch.tensor(s.sampler_logprobs, dtype=out.dtype)
        if s.model_mask is None:
            out[row, : len(s.sampler_logprobs)] = values
        else:  # one log-prob per model token, in order: scatter them to the model positions
            out[row, : len(s.model_mask)][torch.tensor(s.model_mask)] = values
    return out.to(like.device)


@dataclass
class PackedBatch:
    """A micro-batch whose rows share prompts: each distinct prompt is run once, then its rows'
    completions attend to that prompt's KV cache. Gradients flow back through the shared prompt.

    prompt_ids, prompt_mask: (U, P) distinct prompts, left-padded (positions from the mask, as in
    generation); expand: (R,) row -> prompt; inputs: (R, C-1) completion tokens but the last,
    right-padded; attention: (R, P + C-1); positions: (R, C-1); targets, target_mask: (R, C).
    target_mask marks the model's tokens: inserted ones (a tool's output) are attended to, as inputs,
    but every loss term reads target_mask and so skips them.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    expand: torch.Tensor
    inputs: torch.Tensor
    attention: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    target_mask: torch.Tensor

    def to(self, device: torch.device) -> "PackedBatch":
        return PackedBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def pack(samples: list[TrainSample], pad_id: int) -> PackedBatch:
    prompts: dict[tuple[int, ...], int] = {}
    expand = [prompts.setdefault(tuple(s.prompt_ids), len(prompts)) for s in samples]
    width = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    prompt_mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    c = max(len(s.completion_ids) for s in samples)
    targets = torch.full((len(samples), c), pad_id, dtype=torch.long)
    present = torch.zeros((len(samples), c), dtype=torch.bool)  # every completion token, inserted ones too
    target_mask = torch.zeros((len(samples), c), dtype=torch.bool)
    for row, s in enumerate(samples):
        targets[row, : len(s.completion_ids)] = torch.tensor(s.completion_ids)
        present[row, : len(s.completion_ids)] = True
        target_mask[row, : len(s.completion_ids)] = True if s.model_mask is None else torch.tensor(s.model_mask)
    expand_t = torch.tensor(expand)
    prompt_len = prompt_mask.sum(-1)[expand_t]
    return PackedBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        expand=expand_t,
        inputs=targets[:, :-1],
        attention=torch.cat([prompt_mask[expand_t], present[:, :-1].long()], dim=-1),
        positions=prompt_len[:, None] + torch.arange(c - 1)[None, :],
        targets=targets,
        target_mask=target_mask,
    )


# Model types whose logits are exactly lm_head(last hidden state): for them the update runs the head
# on the model's own tokens only. Others (Gemma's soft-capping, Cohere's logit scale, Granite's
# scaling, remote code) go through the model's whole forward, whose logits include such transforms.
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "smollm3"})


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, lm_head) when the model's logits are lm_head(decoder's last hidden state), else None.
    `model` may be a peft model: its LoRA layers sit inside the decoder, so both paths train them."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_TYPES or not hasattr(model, "get_decoder"):
        return None
    head = model.get_output_embeddings()
    return (model.get_decoder(), head) if head is not None else None


@contextmanager
def lora_matmuls(model: torch.nn.Module, in_model_dtype: bool) -> Iterator[None]:
    """lora.matmul_dtype=model: a reduced-precision model's forward under torch.autocast in its dtype, with peft's
    casts of each adapted layer's input to the adapters' float32 switched off, so the LoRA products run in the
    model's dtype (the adapters and their gradients stay float32). Otherwise, on a float32 model and on one
    without adapters (finetune=full: its products are in its dtype already), nothing."""
    first = next(model.parameters())  # the base model's embedding: its dtype and device
    if not in_model_dtype or first.dtype not in attention.REDUCED or not hasattr(model, "peft_config"):
        yield
        return
    from peft.helpers import disable_input_dtype_casting

    with disable_input_dtype_casting(model), torch.autocast(first.device.type, dtype=first.dtype):
        yield


def forward_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0, with_entropy: bool = False,
                     entropy_grad: bool = False, lora_in_model_dtype: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(R, C) log p(completion token t | prompt, tokens < t) under the sampling temperature (logits /
    temperature, as the tokens were drawn; TRL and verl score the same way); read with
    batch.target_mask, and 0 where it is False. Logits, log-softmax and entropy are computed at the
    model's own tokens only: prompts, padding and inserted tokens (a tool's output) cost no lm_head or
    softmax work. With `with_entropy`, also the (R, C) policy entropy per position (with its gradient
    when entropy_grad: the entropy bonus). `lora_in_model_dtype`: lora.matmul_dtype=model (`lora_matmuls`)."""
    split = _decoder_and_head(model)
    keep = batch.target_mask
    with lora_matmuls(model, lora_in_model_dtype):
        if split is None:  # the model's whole forward, logits at every completion position
            logits = _completion_outputs(model, batch, "logits", logits_to_keep=1)[keep]
        else:
            decoder, head = split
            logits = head(_completion_outputs(decoder, batch, "last_hidden_state")[keep])  # (N, V): model tokens only
    picked = gather_logprobs(logits, batch.targets[keep], temperature)
    logp = picked.new_zeros(keep.shape).masked_scatter(keep, picked)
    if not with_entropy:
        return logp, None
    entropy = token_entropy(logits if entropy_grad else logits.detach(), temperature)
    return logp, entropy.new_zeros(keep.shape).masked_scatter(keep, entropy)


def _completion_outputs(model: torch.nn.Module, batch: PackedBatch, field: str, **kwargs) -> torch.Tensor:
    """(R, C, ...) the `field` output of `model` at the positions that predict completion tokens 0..C-1:
    each distinct prompt is run once (its last position predicts token 0), then the rows' completions
    run on their prompt's KV cache."""
    kwargs.update(attention.update_kwargs(model))  # the update's attention (magrpo/attention.py)
    out = model(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask,
                position_ids=(batch.prompt_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, **kwargs)
    first = out[field][:, -1:][batch.expand]  # (R, 1, ...): predicts completion token 0
    if batch.inputs.shape[1] == 0:
        return first
    cache_key = cache_keyword(model)
    cache = out[cache_key]
    cache.batch_select_indices(batch.expand)  # differentiable gather: rows share their prompt's KV
    kwargs.pop("logits_to_keep", None)
    rest = model(input_ids=batch.inputs, attention_mask=batch.attention, position_ids=batch.positions,
                 use_cache=True, **{cache_key: cache}, **kwargs)[field]
    return torch.cat([first, rest], dim=1)


def micro_batches(samples: list[TrainSample], rows: list[int], size: int) -> list[list[int]]:
    """Chunks of at most `size` rows that keep the rows of one prompt together when they fit."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in rows:
        groups.setdefault(tuple(samples[i].prompt_ids), []).append(i)
    batches: list[list[int]] = []
    current: list[int] = []
    for key in sorted(groups, key=len):  # similar prompt lengths together: less padding
        for start in range(0, len(groups[key]), size):
            part = groups[key][start : start + size]
            if current and len(current) + len(part) > size:
                batches.append(current)
                current = []
            current = current + part
    return batches + ([current] if current else [])


MISMATCH_KEYS = ("tokens", "abs_sum", "weight_sum", "capped")


def importance_weights(logp: torch.Tensor, samples: list[TrainSample], mask: torch.Tensor,
                       tis_cap: float) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Per-token p_trainer / p_sampler (R, C), capped at tis_cap (truncated importance sampling,
    Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"), or
    None when tis_cap is 0; and the sampler/trainer mismatch sums (MISMATCH_KEYS; empty when the
    backend returned no log-probs)."""
    behaviour = sampler_logprobs(samples, logp)
    if behaviour is None:
        return None, {}
    maskf = mask.float()
    weight = torch.exp(logp - behaviour)
    stats = {"tokens": float(maskf.sum()), "abs_sum": float(((logp - behaviour).abs() * maskf).sum()),
             "weight_sum": float((weight * maskf).sum()), "capped": 0.0}
    if tis_cap <= 0:
        return None, stats
    stats["capped"] = float(((weight > tis_cap).float() * maskf).sum())
    return weight.clamp(max=tis_cap), stats


def trained_rows(samples: list[TrainSample], kl_coef: float) -> list[int]:
    """Zero-advantage sequences add nothing to the policy gradient: skip their forward unless a
    per-token term needs it (kl_coef: the sum of the KL and entropy coefficients)."""
    return [i for i, s in enumerate(samples) if s.advantage != 0.0 or kl_coef > 0]


@dataclass(frozen=True)
class UpdateSettings:
    """How each agent's update turns its samples into a step (trainer.* and generation.* keys; every
    default lives in magrpo.config)."""

    loss: LossSettings
    loss_agg: str
    max_new_tokens: int
    ppo_epochs: int
    max_grad_norm: float
    tis_cap: float
    temperature: float  # the sampling temperature: log-probs are scored under it
    lora_in_model_dtype: bool = False  # lora.matmul_dtype=model

    @property
    def per_token_coef(self) -> float:
        """Nonzero when a per-token term (KL, entropy bonus) trains zero-advantage rows too."""
        return self.loss.kl_coef + self.loss.entropy_coef

    @classmethod
    def of(cls, cfg, temperature: float | None = None) -> "UpdateSettings":
        """From the config; `temperature`: an agent's own (agents[i].temperature), else generation's."""
        trainer = cfg.trainer
        return cls(loss=LossSettings.of(cfg), loss_agg=trainer.loss_agg, max_new_tokens=cfg.generation.max_new_tokens,
                   ppo_epochs=trainer.ppo_epochs, max_grad_norm=trainer.max_grad_norm, tis_cap=trainer.tis_cap,
                   temperature=temperature or cfg.generation.temperature,
                   lora_in_model_dtype=cfg.lora.matmul_dtype == "model")


@dataclass
class FirstPass:
    """What an update's first epoch records per micro-batch, before the weights move: the behaviour
    log-probs (the clip's old policy), the reference's, the importance weights, and sums for metrics."""

    old_logps: list[torch.Tensor] = field(default_factory=list)
    ref_logps: list[torch.Tensor | None] = field(default_factory=list)
    is_weights: list[torch.Tensor | None] = field(default_factory=list)
    entropy_sum: float = 0.0
    mismatch: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MISMATCH_KEYS, 0.0))


def step_metrics(summed: dict[str, float], mismatch: dict[str, float], tis_cap: float, *, grad_norm: float,
                 lr: float, skipped: int, mean_length: float) -> dict[str, float]:
    """An update's numbers from its sums over all ranks."""
    tokens = max(1.0, summed["trained_tokens"])
    out = {
        "loss": summed["loss"],
        "clip_frac": summed["clipped_tokens"] / tokens,
        "clip_frac_high": summed["clipped_high_tokens"] / tokens,
        "kl": summed["kl_sum"] / tokens,
        "grad_norm": grad_norm,
        "lr": lr,
        "completion_len": mean_length,
        "trained_seqs": summed["trained_seqs"],
        "skipped_updates": float(skipped),
    }
    if summed["masked_rows"]:  # some completion carried inserted tokens (tools): their share, out of the loss
        out["masked_token_share"] = summed["inserted_tokens"] / max(1.0, summed["completion_tokens"])
    if summed["trained_seqs"]:  # entropy of the policy on the tokens it trained on (none trained: no number)
        out["entropy"] = summed["entropy_sum"] / tokens
    if mismatch["tokens"]:  # the backend returned log-probs: how far its sampler is from the trainer
        out["logp_mismatch"] = mismatch["abs_sum"] / mismatch["tokens"]
        out["is_weight_mean"] = mismatch["weight_sum"] / mismatch["tokens"]
        if tis_cap > 0:
            out["tis_clip_frac"] = mismatch["capped"] / mismatch["tokens"]
    return out


class AgentUpdater:
    """Owns one agent's optimizer and learning-rate schedule."""

    def __init__(self, agent: Agent, lr: float, weight_decay: float, warmup_steps: int):
        self.agent = agent
        self.params = agent.trainable_parameters()
        if not self.params:
            raise RuntimeError(f"agent {agent.index} has no trainable LoRA parameters (check lora.target_modules)")
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        warm = max(1, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))

    def step(self, samples: list[TrainSample], settings: UpdateSettings, micro_batch_size: int,
             world: World | None = None, counts: tuple[float, float, float] | None = None) -> dict[str, float]:
        """One optimizer step on this agent's samples (with data parallelism: this rank's share; the
        loss is normalised over all ranks' samples and the gradients summed, so every rank takes the
        step the whole batch gives). `counts`: `batch_counts` of the same samples, when the caller
        took them already (a retry after an out-of-memory must not repeat that collective). Returns
        the step's numbers over all ranks."""
        s, world = settings, world or World()
        lengths = torch.tensor([x.model_tokens for x in samples], dtype=torch.long)  # inserted tokens weigh nothing
        keep = trained_rows(samples, s.per_token_coef)
        num_sequences, num_tokens, num_kept = counts or self.batch_counts(samples, s.per_token_coef, world)
        weights = sequence_weights(s.loss_agg, lengths, s.max_new_tokens, int(num_sequences), int(num_tokens),
                                   s.loss.user_code_timeout_s)
        self.agent.train_mode()
        first = FirstPass()  # what the first epoch sees before the weights move
        totals = {"loss": 0.0, "clipped_tokens": 0.0, "clipped_high_tokens": 0.0, "kl_sum": 0.0}
        grad_norm, skipped = 0.0, 0
        for epoch in range(s.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for b, rows in enumerate(micro_batches(samples, keep, micro_batch_size)):
                stats = self._backward(samples, rows, weights, s, epoch, b, first)
                if epoch == s.ppo_epochs - 1:
                    for key in totals:
                        totals[key] += float(stats.get(key, 0.0))
            grad_norm, bad = self._apply(world, s.max_grad_norm, sums_gradients=world.size > 1 and num_kept)
            skipped |= bad
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:  # the schedule counts updates that happened
            self.scheduler.step()
        totals.update(entropy_sum=first.entropy_sum, trained_tokens=float(lengths[keep].sum()),
                      trained_seqs=float(len(keep)),
                      inserted_tokens=float(sum(len(x.completion_ids) - x.model_tokens for x in samples)),
                      completion_tokens=float(sum(len(x.completion_ids) for x in samples)),
                      masked_rows=float(sum(x.model_mask is not None for x in samples)))
        return step_metrics(world.sum_dict(totals), world.sum_dict(first.mismatch), s.tis_cap, grad_norm=grad_norm,
                            lr=lr, skipped=skipped, mean_length=num_tokens / max(1.0, num_sequences))

    def _backward(self, samples: list[TrainSample], rows: list[int], weights: torch.Tensor, s: UpdateSettings,
                  epoch: int, b: int, first: FirstPass) -> dict[str, float]:
        """Forward and backward of micro-batch `b` (`rows` of `samples`) in `epoch`; the first epoch also
        keeps its behaviour and reference log-probs, importance weights and entropy in `first`."""
        model = self.agent.model
        device = next(model.parameters()).device
        batch = pack([samples[i] for i in rows], self.agent.tokenizer.pad_token_id).to(device)
        adv = torch.tensor([samples[i].advantage for i in rows], dtype=torch.float32, device=device)
        bonus = s.loss.entropy_coef > 0  # the entropy bonus needs the entropy, with its gradient, every epoch
        logp, entropy = forward_logprobs(model, batch, s.temperature, with_entropy=epoch == 0 or bonus,
                                         entropy_grad=bonus, lora_in_model_dtype=s.lora_in_model_dtype)
        if epoch == 0:  # parameters have not moved yet: these are the behaviour log-probs
            first.entropy_sum += float((entropy.detach() * batch.target_mask).sum())
            first.old_logps.append(logp.detach())
            first.ref_logps.append(self._reference_logprobs(batch, s) if s.loss.kl_coef > 0 else None)
            weight, seen = importance_weights(logp.detach(), [samples[i] for i in rows], batch.target_mask, s.tis_cap)
            first.is_weights.append(weight)
            for key, value in seen.items():
                first.mismatch[key] += value
        loss, stats = policy_loss(logp, first.old_logps[b], adv, batch.target_mask, weights[rows].to(device), s.loss,
                                  first.ref_logps[b], first.is_weights[b], entropy if bonus else None)
        loss.backward()
        return stats

    def _apply(self, world: World, max_grad_norm: float, sums_gradients: bool) -> tuple[float, int]:
        """Sum the gradients over ranks (when any rank trained a row), clip, and step; a NaN/inf gradient
        keeps the weights and is counted. Returns (gradient norm, 1 if skipped else 0)."""
        if sums_gradients:  # no rank trained a row: no gradient anywhere, as in one process
            self._sum_gradients(world)
        clip = max_grad_norm if max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, 1
        self.optimizer.step()
        return grad_norm, 0

    def batch_counts(self, samples: list[TrainSample], kl_coef: float, world: World) -> tuple[float, float, float]:
        """(sequences, model tokens, trained sequences) over all ranks: the loss normalisers."""
        tokens = sum(s.model_tokens for s in samples)
        return tuple(world.sum_floats([len(samples), tokens, len(trained_rows(samples, kl_coef))]))

    def _sum_gradients(self, world: World) -> None:
        """All-reduce this agent's LoRA gradients as one flat buffer (a rank without rows adds zeros)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = world.sum_(torch.cat([g.reshape(-1).float() for g in grads]))
        offset = 0
        for p in self.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()

    @torch.no_grad()
    def _reference_logprobs(self, batch: PackedBatch, s: UpdateSettings) -> torch.Tensor:
        with self.agent.reference_model() as reference:  # computed as the policy's (lora.matmul_dtype too)
            return forward_logprobs(reference, batch, s.temperature, lora_in_model_dtype=s.lora_in_model_dtype)[0]
