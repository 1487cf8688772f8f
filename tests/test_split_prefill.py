"""On a CPU a decode prefills prompts of similar length together (magrpo/backends/hf_prefill.py): the groups
cost fewer computed tokens than one left-padded batch, and the decode samples what one prefill gives."""
from __future__ import annotations

import pytest
import torch

from magrpo.backends.hf import decode
from magrpo.backends.hf_prefill import group_cost, length_groups
from magrpo.generation import SamplingParams
from magrpo.models import load_agents
from tests.near_ties import same_up_to_a_near_tie, shared_prefix


def cost(lengths, groups, group_cost):
    return sum(len(g) * max(lengths[i] for i in g) + group_cost for g in groups)


@pytest.mark.parametrize("lengths", [[10, 300, 310, 12, 150, 305, 11, 160], [100] * 5, [5], [7, 9, 400, 3, 380]])
@pytest.mark.parametrize("group_cost", [0, 64, 10_000])
def test_length_groups_split_every_prompt_once_at_the_least_cost(lengths, group_cost):
    groups = length_groups(lengths, group_cost)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g == sorted(g) for g in groups)  # index order: one agent's prompts stay together
    assert cost(lengths, groups, group_cost) <= cost(lengths, [list(range(len(lengths)))], group_cost)
    if group_cost == 10_000 or len(set(lengths)) == 1:
        assert len(groups) == 1  # a forward costs more than any padding saved; or there is no padding
    # no single cut of the sorted lengths does better (the optimum over all cuts is at least as good)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for cut in range(1, len(lengths)):
        two = [sorted(order[:cut]), sorted(order[cut:])]
        assert cost(lengths, groups, group_cost) <= cost(lengths, two, group_cost)
    if lengths[:2] == [10, 300] and group_cost == 64:
        assert len(groups) == 3  # ~10, ~155 and ~305 tokens


def test_a_forward_costs_fewer_tokens_of_a_larger_model():
    small, large = torch.nn.Linear(10, 10), torch.nn.Linear(1000, 1000)
    assert group_cost(small) > group_cost(large) >= 1
    assert len(length_groups([5, 400, 6, 390], group_cost(small))) == 1  # a tiny model's forward costs more


@pytest.fixture(scope="module")
def agents():
    from tests.conftest import SMALL, compose

    torch.manual_seed(0)  # peft draws the adapters' A at load: the same agents in every process
    agents = load_agents(compose([*SMALL, "lora.r=4"]), 2)
    torch.manual_seed(0)
    for name, param in agents[0].model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: make the adapters change something
            param.data.normal_(0, 0.2)
    return agents


@pytest.mark.parametrize("greedy", [True, False])
def test_a_split_prefill_samples_what_one_prefill_does(agents, greedy, monkeypatch):
    """Prompts of 3 to 60 tokens, both agents, 3 samples each: split into groups (a forward priced as 64 of
    its tokens, as for a real model: the tiny one's own price never splits), the same tokens (sampled: up to a
    near tie), and log-probs within float rounding of one left-padded prefill's."""
    import magrpo.backends.hf as hf
    from magrpo.backends import hf_prefill

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 60, 5, 58, 31, 4)]
    adapters = [agents[0].adapter] * 3 + [agents[1].adapter] * 3
    expand = torch.arange(len(prompts)).repeat_interleave(3)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, logprobs=True, greedy=greedy)
    seen = []
    real = hf.length_groups
    monkeypatch.setattr(hf, "length_groups", lambda *args: seen.append(real(*args)) or seen[-1])
    monkeypatch.setattr(hf_prefill, "FORWARD_FLOPS", 64 * 2 * sum(p.numel() for p in agents[0].model.parameters()))

    def run(split):
        with torch.no_grad():
            return decode(agents[0].model, prompts, adapters, expand, params, torch.arange(len(expand)), pad_id=0,
                          eos_ids=[-1], split_prefill=split)

    whole, split = run(False), run(True)
    assert not seen[:-1] and len(seen[-1]) >= 2  # only the split decode grouped, into two or more groups
    for row in range(len(expand)):  # another batch shape: a sampled token may swap at a near tie (near_ties.py)
        got, want = split.tokens[row].tolist(), whole.tokens[row].tolist()
        assert got == want if greedy else same_up_to_a_near_tie(got, want), (row, got, want)
        n = shared_prefix(got, want)
        torch.testing.assert_close(split.logprobs[row, :n], whole.logprobs[row, :n], rtol=0, atol=1e-5)


def test_the_joined_cache_is_one_prefills_where_rows_attend_and_zeros_elsewhere(agents):
    """Where rows attend, the joined cache is as close to the exact (float64) cache as one prefill's: the two
    float32 computations round apart by tens of ulps of keys and values up to ~10 (2.5e-5 for some adapters),
    so the reference is float64, not the other float32 one."""
    import copy

    from magrpo.backends.hf import RowAdapters, prefill

    model = agents[0].model.eval()
    prompts = [[5, 6, 7], [8] * 20, [9, 10, 11, 12], [13] * 18]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    adapters = [agents[0].adapter] * 2 + [agents[1].adapter] * 2
    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():
        with RowAdapters(model).active() as routing:
            logits, whole = prefill(model, ids, attention, {}, adapters, routing, [])
            split_logits, joined = prefill(model, ids, attention, {}, adapters, routing, [[0, 2], [1, 3]])
        with RowAdapters(exact_model).active() as routing:
            _, exact = prefill(exact_model, ids, attention, {}, adapters, routing, [])
    torch.testing.assert_close(split_logits, logits, rtol=0, atol=1e-5)
    errors = {"whole": 0.0, "joined": 0.0}
    for a, b, c in zip(whole.layers, joined.layers, exact.layers):
        for side in ("keys", "values"):
            got, want, truth = getattr(b, side), getattr(a, side), getattr(c, side)
            assert got.shape == want.shape
            real = attention.bool()[:, None, :, None].expand_as(got)
            errors["whole"] = max(errors["whole"], (want[real].double() - truth[real]).abs().max().item())
            errors["joined"] = max(errors["joined"], (got[real].double() - truth[real]).abs().max().item())
            short = torch.zeros_like(real)
            short[[0, 2], :, : width - 4] = True  # left of the short group's own width: never computed
            assert not got[short].any()
    assert 0 < errors["joined"] <= 2 * errors["whole"] + 2e-6 and errors["joined"] < 1e-4, errors


def test_a_model_with_sliding_window_layers_prefills_once(monkeypatch):
    """Its cache cannot be joined from groups (a window's layer keeps other columns): one prefill, not the
    groups' forwards and then one more."""
    from transformers import LlamaConfig, MistralConfig, MistralForCausalLM

    from magrpo.backends import hf_prefill

    assert hf_prefill.joinable(LlamaConfig(num_hidden_layers=2)) and not hf_prefill.joinable(MistralConfig())
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4096)
    model = MistralForCausalLM(config).eval()
    monkeypatch.setattr(hf_prefill, "FORWARD_FLOPS", 1.0)  # a forward costs nothing: any padding would split
    prefills = []
    model.register_forward_pre_hook(lambda module, args, kwargs: prefills.append(kwargs["input_ids"].shape[1] > 1),
                                    with_kwargs=True)
    prompts = [[5] * 3, [6] * 40, [7] * 4, [8] * 38]
    with torch.no_grad():
        decode(model, prompts, ["x"] * 4, torch.arange(4), SamplingParams(max_new_tokens=2, greedy=True),
               torch.arange(4), pad_id=0, eos_ids=[-1])
    assert sum(prefills) == 1
