"""A decode's frozen bfloat16 linear layers on a CPU, with their weights packed once for oneDNN.

torch's bfloat16 linear on a CPU hands oneDNN the plain weight, which oneDNN reorders into its blocked
layout at every product. With a decode step's few rows the reorder costs about as much as the product:
SmolLM2-135M's base linear layers took 22.5 ms of a 4-row decode step and 12.8 ms with packed weights, 57
and 47 ms at 32 rows (one thread, AVX512-BF16, 2026-11-28). A LoRA agent's base weights never change
during a run, so `PackedLinears` packs each frozen weight once and, while a decode runs (`active`), the
layer multiplies with the packed copy. The cost is a second copy of those weights in memory
(`model.cpu_weights=plain` keeps one).

Each weight is packed only if, on this machine, the packed product gives the same bits as `F.linear` on
a set of probe shapes (1 to 64 contiguous rows): true on the AVX512-BF16 CPU measured; oneDNN without a
bfloat16 instruction set rounded the 49152-word head differently at some row counts, and there the
weight stays plain. A product of more than 64 rows (a prefill's, where the reorder matters little), a
strided input (F.linear with a bias rounds it otherwise), a product that asks for gradients, trained
weights (full agents), other dtypes and other devices always take F.linear.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Iterator

import torch
import torch.nn.functional as F

PROBE_ROWS = (1, 3, 8, 31, 32, 64)  # decode batches of every size class oneDNN may pick a kernel for
MAX_ROWS = max(PROBE_ROWS)  # larger products (a prefill's) take F.linear: no probe vouches for their bits


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of `weight`, or None where this torch or CPU has no bfloat16 reorder."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    except (AttributeError, RuntimeError):  # no mkldnn ops in this build; a CPU without bf16 support in oneDNN
        return None


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def same_bits(layer: torch.nn.Linear, packed: torch.Tensor) -> bool:
    """Whether the packed product equals F.linear bit for bit on the probe shapes (fixed random inputs)."""
    make = torch.Generator().manual_seed(0)
    for rows in PROBE_ROWS:
        x = torch.randn(rows, 1, layer.in_features, generator=make).to(layer.weight.dtype)
        if not torch.equal(_packed_product(x, packed, layer.bias), F.linear(x, layer.weight, layer.bias)):
            return False
    return True


class PackedLinears:
    """The frozen bfloat16 `torch.nn.Linear` layers of one model on a CPU, each with its packed weight,
    made at the first decode and again whenever the weight changed in place (its version counter moved)."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True):
        found = model.modules() if enabled else ()
        self.layers = [m for m in found if type(m) is torch.nn.Linear and self._eligible(m)]
        # id(layer) -> (the weight packed, its version then, the packed copy or None). The weight itself is
        # kept: a new tensor (load_state_dict(assign=True)) may show the old one's version number.
        self.packed: dict[int, tuple[torch.Tensor, int, torch.Tensor | None]] = {}

    @staticmethod
    def _eligible(layer: torch.nn.Linear) -> bool:
        w = layer.weight
        return w.device.type == "cpu" and w.dtype == torch.bfloat16 and not w.requires_grad

    def _current(self, layer: torch.nn.Linear) -> torch.Tensor | None:
        if not self._eligible(layer):  # unfrozen or moved since: it changes, so it multiplies plain
            return None
        weight = layer.weight
        known = self.packed.get(id(layer))
        if known is None or known[0] is not weight or known[1] != weight._version:
            packed = _pack(weight)
            if packed is not None and not same_bits(layer, packed):
                packed = None
            known = self.packed[id(layer)] = (weight, weight._version, packed)
        return known[2]

    @contextmanager
    def active(self) -> Iterator[int]:
        """Inside, each layer with a packed weight multiplies with it (when no gradient is asked for);
        yields how many layers do."""
        swapped = []
        try:
            for layer in self.layers:
                packed = self._current(layer)
                if packed is not None:
                    layer.forward = partial(self._forward, layer, packed)  # the instance's own: hooks still run
                    swapped.append(layer)
            yield len(swapped)
        finally:
            for layer in swapped:
                del layer.forward

    @staticmethod
    def _forward(layer: torch.nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not x.is_contiguous()
                or x.numel() > MAX_ROWS * layer.in_features):
            return F.linear(x, layer.weight, layer.bias)  # F.linear with a bias rounds a strided input otherwise
        return _packed_product(x, packed, layer.bias)
