"""model.cpu_weights=packed (magrpo/backends/hf_linear.py): while a decode runs, each frozen bfloat16 linear
weight is multiplied in oneDNN's blocked layout, packed once. Only weights whose packed product gives the
same bits as F.linear here are packed, so a decode samples the same tokens with the same log-probs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from magrpo.backends import hf_linear, make_backend
from magrpo.backends.hf import decode
from magrpo.backends.hf_linear import PackedLinears
from magrpo.generation import GenerationRequest, SamplingParams
from magrpo.models import load_agents


def bf16_reorder_here() -> bool:
    return hf_linear._pack(torch.zeros(8, 8, dtype=torch.bfloat16)) is not None


@pytest.fixture
def agents(make_cfg):
    torch.manual_seed(0)  # peft draws the adapters' A at load: the same agents in every process
    agents = load_agents(make_cfg("model.dtype=bfloat16", "model.device=cpu"), 2)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in agents[0].model.named_parameters():  # peft starts B at zero: make the adapters work
            if "lora_B" in name:
                param.normal_(std=0.05)
    return agents


def run(agents, linears):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, logprobs=True)
    with torch.no_grad():
        return decode(agents[0].model, [[5, 6, 7, 8, 9], [9, 10]], [agents[0].adapter, agents[1].adapter],
                      torch.tensor([0] * 4 + [1] * 4), params, torch.arange(8), pad_id=0, eos_ids=[-1],
                      linears=linears)


def test_a_decode_samples_the_same_tokens_and_log_probs_with_packed_weights(agents):
    linears = PackedLinears(agents[0].model)
    assert len(linears.layers) > 2  # the base layers of the LoRA modules and the head, all frozen
    plain, packed = run(agents, None), run(agents, linears)
    assert torch.equal(plain.tokens, packed.tokens) and torch.equal(plain.logprobs, packed.logprobs)
    used = sum(entry[2] is not None for entry in linears.packed.values())
    if bf16_reorder_here():  # this CPU's oneDNN packs bfloat16: the layers did multiply packed
        assert used > 0
    assert not any("forward" in vars(layer) for layer in linears.layers)  # the plain forward is back


def test_a_weight_whose_packed_product_rounds_otherwise_stays_plain(agents, monkeypatch):
    """Where oneDNN's packed kernel would round otherwise (seen without a bfloat16 instruction set on the
    49152-word head), the probe keeps the weight plain: the samples stay the same bits."""
    real = hf_linear._packed_product
    monkeypatch.setattr(hf_linear, "_packed_product", lambda x, packed, bias: real(x, packed, bias) * 1.01)
    linears = PackedLinears(agents[0].model)
    plain, packed = run(agents, None), run(agents, linears)
    assert torch.equal(plain.tokens, packed.tokens) and torch.equal(plain.logprobs, packed.logprobs)
    assert linears.packed and all(entry[2] is None for entry in linears.packed.values())


@pytest.mark.skipif(not bf16_reorder_here(), reason="this CPU's oneDNN has no bfloat16 reorder")
def test_a_weight_changed_in_place_is_packed_again():
    layer = torch.nn.Linear(64, 32, bias=True).to(torch.bfloat16).requires_grad_(False)
    linears = PackedLinears(layer)
    x = torch.randn(5, 1, 64).to(torch.bfloat16)
    with torch.no_grad():
        with linears.active() as used:
            assert used == 1
            before = layer(x)
        layer.weight.mul_(2)  # a load_state_dict or an edit in place: the version counter moves
        with linears.active():
            after = layer(x)
    assert torch.equal(before, F.linear(x, layer.weight / 2, layer.bias))
    assert torch.equal(after, F.linear(x, layer.weight, layer.bias))


def test_a_replaced_or_unfrozen_weight_is_not_multiplied_with_a_stale_pack():
    """A new weight tensor has its own version counter, which may read what the packed one's did: the cache
    must know it is another tensor. A weight unfrozen later (now trained) multiplies plain."""
    layer = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16).requires_grad_(False)
    linears = PackedLinears(layer)
    x = torch.randn(5, 1, 64).to(torch.bfloat16)
    with torch.no_grad():
        with linears.active():
            layer(x)
        version = layer.weight._version
        layer.weight = torch.nn.Parameter(layer.weight * 2, requires_grad=False)  # a load_state_dict(assign=True)
        while layer.weight._version < version:
            layer.weight.add_(0)  # the counters meet (the values stay)
        assert layer.weight._version == version
        with linears.active():
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.requires_grad_(True)
        with linears.active() as used:
            assert used == 0


def test_with_gradients_asked_for_the_layer_multiplies_plain_and_trains():
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16).requires_grad_(False)
    linears = PackedLinears(layer)
    x = torch.randn(3, 16).to(torch.bfloat16).requires_grad_(True)
    with linears.active():
        layer(x).float().sum().backward()
    assert x.grad is not None and torch.equal(x.grad, layer.weight.float().sum(0).expand(3, -1).to(x.grad.dtype))


def test_trained_float32_and_switched_off_weights_are_never_packed(make_cfg):
    trained = torch.nn.Linear(16, 8).to(torch.bfloat16)  # requires grad: a full agent's weight changes every step
    assert PackedLinears(trained).layers == []
    assert PackedLinears(torch.nn.Linear(16, 8).requires_grad_(False)).layers == []  # float32: MKL's bits stay
    frozen = torch.nn.Linear(16, 8).to(torch.bfloat16).requires_grad_(False)
    assert PackedLinears(frozen, enabled=False).layers == []
    for setting in ("plain", "packed"):  # what the config asks the backend for
        cfg = make_cfg(f"model.cpu_weights={setting}", "model.dtype=bfloat16", "model.device=cpu")
        (agent,) = load_agents(cfg, 1)
        backend = make_backend(cfg, [agent])
        backend.generate([GenerationRequest("a", 0, 1, seed=1)], SamplingParams(max_new_tokens=2))
        (linears,) = backend.linears.values()
        packed = [entry for entry in linears.packed.values() if entry[2] is not None]
        assert (len(packed) > 0) == (setting == "packed" and bf16_reorder_here()), setting


@pytest.mark.skipif(not bf16_reorder_here(), reason="this CPU's oneDNN has no bfloat16 reorder")
def test_a_strided_input_multiplies_plain():
    """F.linear with a bias rounds a strided input otherwise than the packed product (a prefill's last
    position is such a slice): it takes F.linear."""
    layer = torch.nn.Linear(64, 32, bias=True).to(torch.bfloat16).requires_grad_(False)
    linears = PackedLinears(layer)
    x = torch.randn(8, 3, 64).to(torch.bfloat16)[:, -1:]
    with torch.no_grad(), linears.active() as used:
        assert used == 1
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_bad_value_is_one_line_naming_the_allowed_values(run_cli):
    from tests.conftest import SMALL

    code, lines = run_cli(*SMALL, "model.cpu_weights=blocked")
    assert code == 2 and lines == ["config error: model.cpu_weights: 'blocked' is not allowed; choose one of: "
                                   "packed, plain"]


@pytest.mark.skipif(not bf16_reorder_here(), reason="this CPU's oneDNN has no bfloat16 reorder")
def test_only_products_of_the_probed_sizes_multiply_packed(monkeypatch):
    """The probe vouches for 1 to 64 rows: a larger product (a prefill's) takes F.linear."""
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16).requires_grad_(False)
    linears = PackedLinears(layer)
    with torch.no_grad(), linears.active() as used:
        assert used == 1

        def packed_called(*args):
            raise AssertionError("packed product")

        monkeypatch.setattr(hf_linear, "_packed_product", packed_called)
        x = torch.randn(100, 1, 64).to(torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        with pytest.raises(AssertionError, match="packed product"):
            layer(x[:64])
