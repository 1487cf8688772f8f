"""A decode's KV cache gets room for its new tokens once (magrpo/backends/hf_cache.py): each step writes its
position in place of concatenating the whole cache, with the same keys and values, so the same samples."""
from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from magrpo.backends import hf, hf_cache
from magrpo.generation import SamplingParams
from magrpo.models import load_agents


def filled_cache(rows: int = 3, length: int = 4, layers: int = 2) -> DynamicCache:
    cache = DynamicCache()
    for i in range(layers):
        cache.update(torch.randn(rows, 2, length, 8), torch.randn(rows, 2, length, 8), i)
    return cache


def test_updates_and_row_selections_give_a_growing_cache_s_keys_and_values_in_place():
    torch.manual_seed(0)
    plain = filled_cache()
    reserved = DynamicCache()
    for i, layer in enumerate(plain.layers):
        reserved.update(layer.keys.clone(), layer.values.clone(), i)
    assert hf_cache.reserve(reserved, 5)
    first_storage = reserved.layers[0].keys.untyped_storage().data_ptr()
    for step in range(6):  # one position past the room reserved: the layer grows its buffers
        if step == 2:
            keep = torch.tensor([2, 0])
            plain.batch_select_indices(keep)
            reserved.batch_select_indices(keep)
            first_storage = reserved.layers[0].keys.untyped_storage().data_ptr()
        for i in range(len(plain.layers)):
            rows = plain.layers[i].keys.shape[0]
            new = torch.randn(rows, 2, 1, 8), torch.randn(rows, 2, 1, 8)
            want, got = plain.update(*new, i), reserved.update(*new, i)
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        if step == 4:  # in place while there was room
            assert reserved.layers[0].keys.untyped_storage().data_ptr() == first_storage
    assert reserved.get_seq_length() == plain.get_seq_length() == 10


def test_other_caches_are_left_as_they_are():
    assert not hf_cache.reserve(DynamicCache(), 4)  # nothing filled yet
    assert not hf_cache.reserve(object(), 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_samples_the_same_tokens_and_log_probs_with_and_without_the_room(make_cfg, monkeypatch, dtype):
    agents = load_agents(make_cfg(f"model.dtype={dtype}", "model.device=cpu"), 2)
    model = agents[0].model
    prompts = [[5, 6, 7, 8, 9], [9, 10], [11, 12, 13]]
    expand = torch.tensor([0, 0, 1, 1, 2, 2])
    params = SamplingParams(max_new_tokens=12, temperature=1.0, logprobs=True)
    eos = [int(t) for t in range(30, 60)]  # some rows end early: the decode drops them from its cache

    def run():
        with torch.no_grad():
            return hf.decode(model, prompts, [agents[0].adapter, agents[1].adapter, agents[0].adapter], expand,
                             params, torch.arange(6) + 7, pad_id=0, eos_ids=eos, keep_states=True)

    with_room = run()
    monkeypatch.setattr(hf_cache, "reserve", lambda cache, positions: False)
    plain = run()
    assert torch.equal(with_room.tokens, plain.tokens)
    assert torch.equal(with_room.logprobs, plain.logprobs)
    assert with_room.states.keys() == plain.states.keys() and with_room.states
    for row, (batch, at) in with_room.states.items():
        other, other_at = plain.states[row]
        for (k, v), (k2, v2) in zip(batch.layers, other.layers):
            assert torch.equal(k[at], k2[other_at]) and torch.equal(v[at], v2[other_at])
