"""Decode attention on a CPU in bfloat16 / float16, at float32's speed.

torch's CPU SDPA kernel can be slow for one query position in reduced precision: measured 2026-11-28
(torch 2.13, AMD EPYC with AVX512-BF16, one thread, loaded machine; 32 rows, 9 query and 3 key/value
heads of 64, 160 keys: one layer of a SmolLM2-135M decode step) 10.7-11.2 ms in bfloat16, where the
same attention as two grouped matmuls takes 1.4-2.1 ms; in bfloat16 attention was a third of a
decode step. So a call with one query position on a CPU in reduced precision computes it here:
scores from float32 copies of the query and keys, a float32 softmax, then the probabilities (cast
to the model's dtype) times the values, each query head against its own key/value head (no copy of
the cache per head). As accurate as the bfloat16 kernel: against float32 attention on the same
inputs, largest error 2.9e-3 and mean 2.4e-4, the kernel's 2.2e-3 and 2.2e-4 (transformers' eager
attention, scores rounded to bfloat16: 5.5e-3 and 4.0e-4). Every other call (a prefill, the update's
forward, float32, a GPU, dropout, a position bias) is transformers' SDPA (on a CPU with its grouped heads
handed to the kernel, below).

The update's forwards (`UPDATE`, passed by magrpo.update to the policy's and the reference's forward)
run in float32 on a CPU in reduced precision: the kernel's bfloat16 backward is ~2x slower than
float32's (measured 2026-11-28, same machine, idle, 2 threads, one SmolLM2 layer: 32 rows x 31 query
positions on 159 keys, forward + backward 29 ms against 20 ms; 8 prompts of 128 positions 24 ms against
14 ms). Float32 attention also rounds less (mean error against exact float32 1.5e-4 against 2.2e-4).
Without gradients the float32 forward is slower (64 x 300 positions: 124-142 ms against 169 ms), so
prefills keep the kernel; the reference's forward gets `UPDATE` too, so at the adapters' start the
policy's and the reference's log-probs are computed the same way.

Which decode attention is faster depends on the CPU. torch's kernel computes its bfloat16 products with
oneMKL's bf16 GEMM (`GEMM_BF16BF16F32` under MKL_VERBOSE=1), and oneMKL picks its code by CPU vendor (here
MKL_CBWR=COMPATIBLE alone makes the kernel ~2x slower): on the AMD EPYC above the kernel was ~8x slower
than the grouped matmuls, and on a 2-core Intel Xeon with AMX and AVX512-BF16 it is 1.6-3x faster
(measured 2026-11-29, idle, 2 threads, one SmolLM2 layer: 32 rows on 150 keys 519-597 us against
1051-1076 us; 8 rows on 500 keys 235-245 against 670-688; 4 rows on 300 keys 102-106 against 304-450;
64 rows on 300 keys 1757-1784 against 3094-3223; also under ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 and
ATEN_CPU_CAPABILITY=avx2). The update's float32 attention pays on both (there: forward + backward of
32 rows x 31 positions on 159 keys, 18-21 ms against 27-36 ms).

Calls of several query positions on a CPU (prefills, the update's forwards) with grouped-query heads go to
torch's kernel with `enable_gqa` (`sdpa`): transformers instead copies each key/value head once per query
head, and the backward then sums the copies. The same outputs bit for bit, the same gradients up to the
order of that sum (key/value gradients within float32 rounding under MKL_CBWR=COMPATIBLE, the pinned
kernels, and bit for bit on MKL's own path here; a reduced-precision backward stays transformers'). On
SmolLM2 (9 query heads on 3 key/value heads) one layer of the update runs 1.6x faster, the whole update
pass ~1.1x (docs/benchmarks.md).

`use_on(model)` switches a loaded model from "sdpa" to this module's attention, registered with sdpa's
masks under one of two names: `KERNEL_DECODE` (decode steps on torch's kernel) on an Intel CPU with
AVX512-BF16 (`kernel_decodes_faster`), `NAME` (decode steps on grouped matmuls) elsewhere; both run the
update's forwards in float32. The two give the same tokens up to bfloat16 near ties, and a machine always
picks the same one. Models on other attention implementations are left as they are.
"""
from __future__ import annotations

from functools import lru_cache

import torch

NAME = "magrpo_sdpa"  # a bfloat16 / float16 decode step's attention as grouped matmuls
KERNEL_DECODE = "magrpo_sdpa_kernel_decode"  # a bfloat16 decode step's on torch's SDPA kernel
NAMES = (NAME, KERNEL_DECODE)
UPDATE = "magrpo_update"  # a forward keyword: this forward is the update's (float32 attention, see above)
REDUCED = (torch.bfloat16, torch.float16)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: query [batch, heads, q, dim], key and value
    [batch, kv_heads, keys, dim]; returns ([batch, q, heads, dim], None)."""
    batch, heads, positions, dim = query.shape
    kv_heads = key.shape[1]
    update = kwargs.pop(UPDATE, False)
    if update and query.device.type == "cpu" and query.dtype in REDUCED:
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.float()
        with torch.autocast("cpu", enabled=False):  # under lora.matmul_dtype=model's autocast SDPA would be bf16
            out, weights = sdpa(module, query.float(), key.float(), value.float(), attention_mask,
                                dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        return out.to(query.dtype), weights
    if (update or positions != 1 or query.device.type != "cpu" or query.dtype not in REDUCED or dropout
            or kwargs.get("position_bias") is not None or heads % kv_heads):
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()  # query head h reads kv head h // groups
    scores = torch.matmul(grouped, key.float().transpose(-1, -2))
    scores *= dim ** -0.5 if scaling is None else scaling
    if attention_mask is not None:  # [batch or 1, 1, 1, >= keys]: True (or 0.0) where a key is seen
        mask = attention_mask[..., :key.shape[2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [batch, kv_heads, groups, dim]
    return out.reshape(batch, 1, heads, dim), None


def kernel_decode(module, query, key, value, attention_mask, **kwargs):
    """`KERNEL_DECODE`'s function: a bfloat16 call outside the update is transformers' SDPA (torch's kernel),
    every other call `attention`'s (the update's in float32; float16, whose kernel path is unmeasured, grouped)."""
    if kwargs.get(UPDATE) or query.dtype != torch.bfloat16:
        return attention(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop(UPDATE, None)
    return sdpa(module, query, key, value, attention_mask, **kwargs)


def sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, except that on a CPU a call of several query positions with grouped-query
    heads lets torch's kernel read each key/value head for its group of query heads (`enable_gqa`, torch >= 2.5),
    where transformers copies every key/value head once per query head (`repeat_kv`; it passes `enable_gqa` only
    with no mask, made for CUDA) and a backward sums the copies' gradients back. The same outputs and query
    gradients bit for bit; key/value gradients bit for bit on MKL's own path and within float32 rounding on its
    portable one (tests/test_attention.py). One SmolLM2 layer of the update in float32, 32 rows x 31 positions on
    159 keys, forward + backward: 17 ms against 27.5 ms (2026-11-29, Intel Xeon, 2 threads). Other calls (one
    query position: transformers packs its heads; a GPU; a position bias) are transformers'."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    positions = query.shape[2]
    # in reduced precision the kernel sums a group's key/value gradients before rounding them, transformers
    # after: other bits, so a reduced-precision backward keeps transformers' way (magrpo's update runs in float32)
    reduced_backward = query.dtype != torch.float32 and torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value))
    grouped = getattr(module, "num_key_value_groups", 1) > 1 and gqa_kernel()
    if (not grouped or query.device.type != "cpu" or positions == 1 or reduced_backward
            or any(kwargs.get(name) for name in ("position_bias", "softcap", "output_attentions"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # transformers' causal flag and its cut of the keys (a prefill into an empty static cache), as it sets them
    causal = attention_mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and key.shape[2] > positions:
        key, value = key[:, :, :positions], value[:, :, :positions]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=causal,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@lru_cache(maxsize=1)
def gqa_kernel() -> bool:
    """Whether torch's SDPA takes `enable_gqa` (torch >= 2.5; pyproject allows 2.4)."""
    from transformers.utils.import_utils import is_torch_greater_or_equal

    return is_torch_greater_or_equal("2.5")


@lru_cache(maxsize=1)
def kernel_decodes_faster() -> bool:
    """Whether torch's SDPA kernel is the faster bfloat16 decode attention on this CPU (see above): an Intel
    CPU (oneMKL's bf16 path) with AVX512-BF16. A fact of the machine, so a run always takes the same path."""
    try:
        with open("/proc/cpuinfo") as info:
            intel = any(line.startswith("vendor_id") and "GenuineIntel" in line for line in info)
    except OSError:  # not Linux: the grouped matmuls, measured fast on every CPU tried
        return False
    return intel and torch.cpu._is_avx512_bf16_supported()


def update_kwargs(model: torch.nn.Module) -> dict[str, bool]:
    """The keyword an update's forward of `model` passes: {UPDATE: True} when its attention is this
    module's, else nothing (another implementation would not know the keyword)."""
    return {UPDATE: True} if getattr(model.config, "_attn_implementation", None) in NAMES else {}


def use_on(model: torch.nn.Module) -> bool:
    """Run `model`'s attention through this module where it runs through sdpa (`KERNEL_DECODE` where
    `kernel_decodes_faster`, else `NAME`); True when it does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    for name, function in ((NAME, attention), (KERNEL_DECODE, kernel_decode)):
        AttentionInterface.register(name, function)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    model.set_attn_implementation(KERNEL_DECODE if kernel_decodes_faster() else NAME)
    return True
