"""A decode's KV cache with room for its new tokens, for the HF backend.

transformers' DynamicLayer grows by concatenation: every decode step copies each layer's whole cache to add
one position, O(length) work and a fresh allocation per layer and step. In a large decode that copying was
15% of the time (a py-spy profile of a 432-row greedy evaluation of SmolLM2-135M, bfloat16, 2026-11-28).
`reserve` gives each plain layer buffers with room for the decode's remaining positions once, after the
prefill; each step then writes its position in place, and the layer's `keys` and `values` are views of the
filled part, the same values a concatenation would give.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of larger buffers (made by `reserve`)."""

    room_keys: torch.Tensor
    room_values: torch.Tensor

    def make_room(self, extra: int) -> None:
        """Buffers for the current positions plus `extra` more, the current ones copied in."""
        length = self.keys.shape[-2]
        self.room_keys = self._grown(self.keys, length + extra)
        self.room_values = self._grown(self.values, length + extra)
        self._view(length)

    @staticmethod
    def _grown(part: torch.Tensor, size: int) -> torch.Tensor:
        room = part.new_empty(*part.shape[:-2], size, part.shape[-1])
        room[..., : part.shape[-2], :] = part
        return room

    def _view(self, length: int) -> None:
        self.keys, self.values = self.room_keys[..., :length, :], self.room_values[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.room_keys.shape[-2]:  # more positions than reserved: room for as many again
            self.make_room(max(end - start, start))
        self.room_keys[..., start:end, :] = key_states
        self.room_values[..., start:end, :] = value_states
        self._view(end)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`, with the same room (only the filled part is copied)."""
        length, size = self.keys.shape[-2], self.room_keys.shape[-2]
        self.keys, self.values = self.keys[indices], self.values[indices]
        self.make_room(size - length)


def reserve(cache, positions: int) -> bool:
    """Give each plain DynamicLayer of `cache` room for `positions` more positions, in place; False (nothing
    changed) for a cache with other layers (sliding windows, static caches) or none filled."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return False
    for layer in layers:
        layer.__class__ = ReservedLayer  # the same object: the cache and the model keep their references
        layer.make_room(positions)
    return True
