"""A decode step of fixed shape, replayed as a CUDA graph (`model.cuda_graphs=true`, the HF backend on a GPU).

On a GPU the HF decode loop is bound by kernel launches, not by the GPU: SmolLM2-135M's shape at 32 rows
took 69 ms per step on an H200 with two agents' LoRA routed per row (27 ms for the bare model), its profile
`cudaLaunchKernel` (docs/benchmarks.md, "On a GPU"). A CUDA graph launches a step's ~1000 kernels at once,
but it replays the memory and shapes it was captured with, so the step here keeps both fixed:

- each layer's keys and values live in one buffer with room for the whole decode (prompt and new tokens);
  a step writes its position at the column a device tensor holds (`index_copy_`), not at a Python int;
- attention reads the whole room through a [rows, 1, 1, room] bool mask whose next column the loop sets
  before each step (transformers uses a 4D mask as given); unwritten columns are masked out;
- no row leaves the batch: a finished row feeds pad tokens to the end (the eager loop drops finished rows
  once a quarter have finished), and each row keeps the agent it was routed to.

The sampler, stop strings and EOS bookkeeping stay outside the graph, as in the eager loop. A step is the
eager loop's forward over more (masked) keys and more rows, so its logits match the eager loop's up to
float rounding (the same tokens; tests/test_static_decode.py). Without CUDA the same step runs eagerly:
that is what the CPU tests check. Where the capture fails (a model or adapter path that syncs with the
host, which a graph cannot hold), the step says so once and runs eagerly.
"""
from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import DynamicLayer

WARMUPS = 2  # eager runs on a side stream before the capture, as torch's docs ask (lazy init, autotuning)


class ColumnLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are the whole room; `update` writes at `column` (a device tensor)."""

    column: torch.Tensor

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values


def column_room(cache, extra: int, column: torch.Tensor) -> bool:
    """Make each plain layer of `cache` a ColumnLayer with room for `extra` more positions, written at `column`,
    in place; False (nothing changed) for a cache with other layers (sliding windows) or none filled."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return False
    for layer in layers:
        length = layer.keys.shape[-2]
        keys, values = layer.keys, layer.values
        layer.__class__ = ColumnLayer  # the same object: the cache keeps its reference
        layer.keys = keys.new_zeros(*keys.shape[:-2], length + extra, keys.shape[-1])
        layer.values = values.new_zeros(*values.shape[:-2], length + extra, values.shape[-1])
        layer.keys[..., :length, :] = keys
        layer.values[..., :length, :] = values
        layer.column = column
    return True


def static_step(model: torch.nn.Module, cache, cache_key: str, attention: torch.Tensor, steps: int, route: dict,
                capture: bool) -> StaticStep | None:
    """A StaticStep over `cache` (its layers made fixed room), or None for a cache that cannot take it (sliding
    windows, a cache already given room)."""
    column = torch.tensor([attention.shape[1]], device=attention.device)  # where the next position's keys go
    if not column_room(cache, steps, column):
        return None
    return StaticStep(model, cache, cache_key, attention, column, steps, route, capture)


class StaticStep:
    """One decode forward of all rows at fixed shapes and addresses; `step(tokens)` returns the next logits.

    `attention`: the rows' mask after the prefill, [rows, width] (left padding 0); `cache`: their KV cache, its
    layers ColumnLayers writing at `column` (`column_room`), with room for `steps` more positions. `capture`:
    record the forward as a CUDA graph at the first step and replay it after (on a CUDA device); False: run it
    eagerly each step."""

    def __init__(self, model: torch.nn.Module, cache, cache_key: str, attention: torch.Tensor, column: torch.Tensor,
                 steps: int, route: dict, capture: bool):
        rows, width = attention.shape
        device = attention.device
        self.model, self.cache, self.cache_key, self.route = model, cache, cache_key, route
        self.column = column
        self.mask = torch.zeros(rows, 1, 1, width + steps, dtype=torch.bool, device=device)
        self.mask[:, 0, 0, :width] = attention.bool()
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = attention.sum(-1, keepdim=True)  # each row's next position (left padding has none)
        self.capture = capture
        self.graph = None
        self.logits: torch.Tensor | None = None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row's token (rows, ); returns the logits of the position after it (rows, vocab), which the
        next step overwrites."""
        self.ids.copy_(tokens[:, None])
        self.mask.index_fill_(3, self.column, True)
        if self.graph is not None:
            self.graph.replay()
        elif self.capture:
            self._capture()
        else:
            self.logits = self._forward()
        self.column += 1
        self.positions += 1
        return self.logits

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=self.positions, use_cache=True,
                         **{self.cache_key: self.cache}, **self.route)
        return out.logits[:, -1]

    def _capture(self) -> None:
        """Warm up on a side stream, capture one forward, replay it: the step's result. The warm-ups feed the same
        inputs, so they write the same keys and values at the same column as the replay does."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUPS):
                self.logits = self._forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                logits = self._forward()
        except RuntimeError as error:  # a host sync inside the forward: nothing ran, so the warm-ups' result stands
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            warnings.warn(f"model.cuda_graphs: the decode step could not be captured ({first_line[:200]}); "
                          "decodes run eagerly where this happens", RuntimeWarning, stacklevel=2)
            self.capture = False
            return
        graph.replay()
        self.graph, self.logits = graph, logits
