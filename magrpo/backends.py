"""Generation backends by name (`backend=hf|vllm`): each factory imports its module on use, so
vllm stays optional and no backend module is imported before it is picked."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .generation import GenerationBackend
from .registry import Registry

if TYPE_CHECKING:
    from .config import TrainConfig
    from .models import Agent


# name -> factory(cfg, agents). Factories import their backend module on use: vllm is optional.
BACKENDS: Registry[Callable[["TrainConfig", "list[Agent]"], GenerationBackend]] = Registry("backend")


@BACKENDS.register("hf")
def _hf(cfg: "TrainConfig", agents: "list[Agent]") -> GenerationBackend:
    from .hf_backend import HFBackend

    return HFBackend(agents, cfg.generation.max_batch_rows)


@BACKENDS.register("vllm")
def _vllm(cfg: "TrainConfig", agents: "list[Agent]") -> GenerationBackend:
    from .vllm_backend import VLLMBackend

    return VLLMBackend(agents, cfg)


def make_backend(cfg: "TrainConfig", agents: "list[Agent]") -> GenerationBackend:
    return BACKENDS.get(cfg.backend)(cfg, agents)
