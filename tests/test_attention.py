"""magrpo/attention.py: a decode step's attention in bfloat16 on a CPU computed as grouped matmuls gives
what transformers' SDPA gives, within bfloat16's own error, with grouped-query heads, padding masks and
a model's scaling; every other call is SDPA's, bit for bit; loaded models use it and saved ones do not
name it; on an Intel CPU with AVX512-BF16 the decode step goes to torch's kernel instead, bit for bit, and the
update's forwards stay float32."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from magrpo import attention


def inputs(heads: int, kv_heads: int, keys: int, dtype: torch.dtype, positions: int = 1, rows: int = 6):
    g = torch.Generator().manual_seed(heads * 100 + keys)
    q = torch.randn(rows, heads, positions, 64, generator=g).to(dtype)
    k = torch.randn(rows, kv_heads, keys, 64, generator=g).to(dtype)
    v = torch.randn(rows, kv_heads, keys, 64, generator=g).to(dtype)
    mask = torch.ones(rows, 1, positions, keys, dtype=torch.bool)
    for row in range(rows):  # left padding of different widths, as in a decode batch
        mask[row, :, :, : row * 3] = False
    return q, k, v, mask


def module(heads: int, kv_heads: int):
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("masked", [True, False])
def test_a_bfloat16_decode_step_matches_float32_attention_as_closely_as_sdpa_does(heads, kv_heads, masked):
    q, k, v, mask = inputs(heads, kv_heads, 40, torch.bfloat16)
    mask = mask if masked else None
    m = module(heads, kv_heads)
    ours, none = attention.attention(m, q, k, v, mask, scaling=0.125)
    theirs, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=0.125)
    exact, _ = sdpa_attention_forward(m, q.float(), k.float(), v.float(), mask, scaling=0.125)
    assert none is None and ours.shape == theirs.shape == (6, 1, heads, 64) and ours.dtype == torch.bfloat16
    ours_err, sdpa_err = (ours.float() - exact).abs(), (theirs.float() - exact).abs()
    # bfloat16 keeps 8 bits: both are within a few of its steps of the exact value
    assert ours_err.max() < 2e-2 and ours_err.mean() < 2 * sdpa_err.mean() + 1e-4


def test_the_scaling_and_a_float_mask_are_applied():
    q, k, v, mask = inputs(9, 3, 40, torch.bfloat16)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")).to(torch.bfloat16)
    m = module(9, 3)
    ours, _ = attention.attention(m, q, k, v, additive, scaling=0.3)
    exact, _ = sdpa_attention_forward(m, q.float(), k.float(), v.float(), mask, scaling=0.3)
    assert (ours.float() - exact).abs().max() < 2e-2
    unscaled, _ = attention.attention(m, q, k, v, mask)  # None: 1 / sqrt(head dim), as SDPA
    exact, _ = sdpa_attention_forward(m, q.float(), k.float(), v.float(), mask)
    assert (unscaled.float() - exact).abs().max() < 2e-2


@pytest.mark.parametrize("dtype,positions", [(torch.float32, 1), (torch.bfloat16, 5)])
def test_every_other_call_is_sdpa_bit_for_bit(dtype, positions):
    q, k, v, mask = inputs(9, 3, 40, dtype, positions=positions)
    m = module(9, 3)
    ours, _ = attention.attention(m, q, k, v, mask, scaling=0.125)
    theirs, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=0.125)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("mask", ["padding", "additive", "none"])
@pytest.mark.parametrize("keys", [5, 40])
def test_several_positions_are_transformers_sdpa_with_its_gradients(dtype, heads, kv_heads, mask, keys):
    """`sdpa` hands grouped heads to torch's kernel (enable_gqa) where transformers copies them: the same
    outputs and query gradients to the bit; the key / value gradients, which the kernel sums over a group's
    heads itself, to the bit on MKL's own path for this CPU and within float32 rounding on its portable one
    (MKL_CBWR=COMPATIBLE); a reduced-precision backward stays transformers' own."""
    q, k, v, padding = inputs(heads, kv_heads, keys, dtype, positions=5)
    masks = {"padding": padding, "none": None,  # none: causal, and transformers' cut of the keys past the queries
             "additive": torch.zeros(padding.shape, dtype=dtype).masked_fill(~padding, float("-inf"))}
    m = module(heads, kv_heads)
    with torch.no_grad():  # a prefill
        ours, _ = attention.sdpa(m, q, k, v, masks[mask], scaling=0.125)
        theirs, _ = sdpa_attention_forward(m, q, k, v, masks[mask], scaling=0.125)
    assert ours.shape == theirs.shape == (6, 5, heads, 64) and torch.equal(ours, theirs)
    grad = torch.randn(6, 5, heads, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for function in (attention.sdpa, sdpa_attention_forward):  # the update's forward and backward
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = function(m, *leaves, masks[mask], scaling=0.125)
        out.backward(grad)
        results.append([out, *(t.grad for t in leaves)])
    (out, dq, dk, dv), (out_t, dq_t, dk_t, dv_t) = results
    assert torch.equal(out, out_t) and torch.equal(dq, dq_t)
    for ours, theirs in ((dk, dk_t), (dv, dv_t)):
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(ours, theirs)


def test_a_torch_without_enable_gqa_gets_transformers_copies(monkeypatch):
    """torch < 2.5 has no `enable_gqa` (pyproject allows 2.4): `sdpa` must not pass it there."""
    real = torch.nn.functional.scaled_dot_product_attention

    def old_torch(*args, **kwargs):
        if "enable_gqa" in kwargs:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'")
        return real(*args, **kwargs)

    q, k, v, mask = inputs(9, 3, 40, torch.float32, positions=5)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", old_torch)
    with pytest.raises(TypeError):
        attention.sdpa(module(9, 3), q, k, v, mask)
    monkeypatch.setattr(attention, "gqa_kernel", lambda: False)
    ours, _ = attention.sdpa(module(9, 3), q, k, v, mask)
    theirs, _ = sdpa_attention_forward(module(9, 3), q, k, v, mask)
    assert torch.equal(ours, theirs)


def test_a_loaded_model_uses_it_and_a_saved_one_does_not_name_it(make_cfg, tmp_path):
    from magrpo.models import cache_keyword, load_agents

    cfg = make_cfg("model.dtype=bfloat16", "agents=[{finetune: full}]")
    (agent,) = load_agents(cfg, 1)
    picked = attention.KERNEL_DECODE if attention.kernel_decodes_faster() else attention.NAME
    assert agent.model.config._attn_implementation == picked
    ids, key = torch.tensor([[5, 6, 7, 8, 9]]), cache_keyword(agent.model)

    def step() -> torch.Tensor:  # a prefill, then one decode step through the cache
        first = agent.model(input_ids=ids[:, :4], use_cache=True)
        return agent.model(input_ids=ids[:, 4:], **{key: first[key]}).logits

    with torch.no_grad():
        ours = step()
        agent.model.set_attn_implementation("sdpa")
        theirs = step()
    assert (ours.float() - theirs.float()).abs().max() < 0.1 * theirs.float().abs().max()
    agent.model.save_pretrained(tmp_path / "saved")
    assert attention.NAME not in json.dumps(json.loads((tmp_path / "saved" / "config.json").read_text()))


@pytest.mark.parametrize("positions", [1, 5])
def test_the_updates_attention_in_bfloat16_is_float32_sdpa_with_its_gradient(positions):
    q, k, v, mask = inputs(9, 3, 40, torch.bfloat16, positions=positions)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    m = module(9, 3)
    ours, _ = attention.attention(m, q, k, v, mask, scaling=0.125, **{attention.UPDATE: True})
    exact, _ = sdpa_attention_forward(m, q.float(), k.float(), v.float(), mask, scaling=0.125)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, exact.to(torch.bfloat16))
    ours.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_the_update_keyword_leaves_float32_to_sdpa_bit_for_bit():
    q, k, v, mask = inputs(9, 3, 40, torch.float32, positions=5)
    m = module(9, 3)
    ours, _ = attention.attention(m, q, k, v, mask, scaling=0.125, **{attention.UPDATE: True})
    theirs, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=0.125)
    assert torch.equal(ours, theirs)


def test_the_update_passes_the_keyword_to_the_policy_and_the_reference(make_cfg, monkeypatch):
    """Every attention call of the update's forwards (the policy's with gradients, the reference's
    without) carries the keyword, so both compute attention the same way; a decode does not."""
    from transformers import AttentionInterface

    from magrpo.models import load_agents
    from magrpo.update import TrainSample, forward_logprobs, pack

    (agent,) = load_agents(make_cfg("model.dtype=bfloat16"), 1)
    seen = []

    def spy(*args, **kwargs):
        seen.append(bool(kwargs.get(attention.UPDATE)))
        return attention.attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, agent.model.config._attn_implementation, spy)
    samples = [TrainSample([5, 6, 7], [8, 9, 10], 1.0), TrainSample([5, 6, 7], [11, 12], -1.0)]
    batch = pack(samples, agent.tokenizer.pad_token_id)
    policy, _ = forward_logprobs(agent.model, batch)
    assert seen and all(seen)
    seen.clear()
    with torch.no_grad(), agent.reference_model() as reference:
        ref, _ = forward_logprobs(reference, batch)
    assert seen and all(seen)
    # LoRA starts as the identity: the policy's and the reference's log-probs are the same numbers
    assert torch.equal(policy.detach(), ref)
    seen.clear()
    with torch.no_grad():
        agent.model(input_ids=torch.tensor([[5, 6, 7]]))
    assert seen == [False] * len(seen) and seen


def test_the_kernel_decode_variant_is_sdpa_for_a_bfloat16_decode_and_the_grouped_module_otherwise():
    m = module(9, 3)
    q, k, v, mask = inputs(9, 3, 40, torch.bfloat16)
    got, _ = attention.kernel_decode(m, q, k, v, mask, scaling=0.125)
    want, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=0.125)
    grouped, _ = attention.attention(m, q, k, v, mask, scaling=0.125)
    assert torch.equal(got, want) and not torch.equal(got, grouped)  # the two round apart: which one ran shows
    update, _ = attention.kernel_decode(m, q, k, v, mask, scaling=0.125, **{attention.UPDATE: True})
    exact, _ = sdpa_attention_forward(m, q.float(), k.float(), v.float(), mask, scaling=0.125)
    assert torch.equal(update, exact.to(torch.bfloat16))  # the update's float32 attention
    q, k, v, mask = inputs(9, 3, 40, torch.float16)
    got, _ = attention.kernel_decode(m, q, k, v, mask, scaling=0.125)
    assert torch.equal(got, attention.attention(m, q, k, v, mask, scaling=0.125)[0])  # float16: grouped


@pytest.mark.parametrize("faster", [True, False])
def test_a_loaded_model_takes_the_decode_attention_its_cpu_runs_faster(make_cfg, monkeypatch, faster):
    from magrpo.models import load_agents

    monkeypatch.setattr(attention, "kernel_decodes_faster", lambda: faster)
    (agent,) = load_agents(make_cfg("model.dtype=bfloat16"), 1)
    assert agent.model.config._attn_implementation == (attention.KERNEL_DECODE if faster else attention.NAME)
    assert attention.update_kwargs(agent.model) == {attention.UPDATE: True}

