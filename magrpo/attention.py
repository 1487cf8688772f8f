"""Decode attention on a CPU in bfloat16 / float16, at float32's speed.

torch's CPU SDPA kernel is slow for one query position in reduced precision: measured 2026-11-28
(torch 2.13, AMD EPYC with AVX512-BF16, one thread, loaded machine; 32 rows, 9 query and 3 key/value
heads of 64, 160 keys: one layer of a SmolLM2-135M decode step) 10.7-11.2 ms in bfloat16, where the
same attention as two grouped matmuls takes 1.4-2.1 ms; in bfloat16 attention was a third of a
decode step. So a call with one query position on a CPU in reduced precision computes it here:
scores from float32 copies of the query and keys, a float32 softmax, then the probabilities (cast
to the model's dtype) times the values, each query head against its own key/value head (no copy of
the cache per head). As accurate as the bfloat16 kernel: against float32 attention on the same
inputs, largest error 2.9e-3 and mean 2.4e-4, the kernel's 2.2e-3 and 2.2e-4 (transformers' eager
attention, scores rounded to bfloat16: 5.5e-3 and 4.0e-4). Every other call (a prefill, the update's
forward, float32, a GPU, dropout, a position bias) is transformers' SDPA, unchanged.

The update's forwards (`UPDATE`, passed by magrpo.update to the policy's and the reference's forward)
run in float32 on a CPU in reduced precision: the kernel's bfloat16 backward is ~2x slower than
float32's (measured 2026-11-28, same machine, idle, 2 threads, one SmolLM2 layer: 32 rows x 31 query
positions on 159 keys, forward + backward 29 ms against 20 ms; 8 prompts of 128 positions 24 ms against
14 ms). Float32 attention also rounds less (mean error against exact float32 1.5e-4 against 2.2e-4).
Without gradients the float32 forward is slower (64 x 300 positions: 124-142 ms against 169 ms), so
prefills keep the kernel; the reference's forward gets `UPDATE` too, so at the adapters' start the
policy's and the reference's log-probs are computed the same way.

`use_on(model)` switches a loaded model from "sdpa" to this function (registered once under `NAME`,
with sdpa's masks); models on other attention implementations are left as they are.
"""
from __future__ import annotations

import torch

NAME = "magrpo_sdpa"
UPDATE = "magrpo_update"  # a forward keyword: this forward is the update's (float32 attention, see above)
REDUCED = (torch.bfloat16, torch.float16)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: query [batch, heads, q, dim], key and value
    [batch, kv_heads, keys, dim]; returns ([batch, q, heads, dim], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, positions, dim = query.shape
    kv_heads = key.shape[1]
    update = kwargs.pop(UPDATE, False)
    if update and query.device.type == "cpu" and query.dtype in REDUCED:
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.float()
        with torch.autocast("cpu", enabled=False):  # under lora.matmul_dtype=model's autocast SDPA would be bf16
            out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                  dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        return out.to(query.dtype), weights
    if (update or positions != 1 or query.device.type != "cpu" or query.dtype not in REDUCED or dropout
            or kwargs.get("position_bias") is not None or heads % kv_heads):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()  # query head h reads kv head h // groups
    scores = torch.matmul(grouped, key.float().transpose(-1, -2))
    scores *= dim ** -0.5 if scaling is None else scaling
    if attention_mask is not None:  # [batch or 1, 1, 1, >= keys]: True (or 0.0) where a key is seen
        mask = attention_mask[..., :key.shape[2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [batch, kv_heads, groups, dim]
    return out.reshape(batch, 1, heads, dim), None


def update_kwargs(model: torch.nn.Module) -> dict[str, bool]:
    """The keyword an update's forward of `model` passes: {UPDATE: True} when its attention is this
    module's, else nothing (another implementation would not know the keyword)."""
    return {UPDATE: True} if getattr(model.config, "_attn_implementation", None) == NAME else {}


def use_on(model: torch.nn.Module) -> bool:
    """Run `model`'s attention through `attention` where it runs through sdpa; True when it does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
