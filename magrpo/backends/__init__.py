"""Generation backends by name (`backend=hf|vllm`) and the interface they share (`base`).

Each factory imports its backend module on use, so vllm stays optional and no backend module is
imported before it is picked. A new backend: a module here implementing `GenerationBackend`, and a
factory registered below (CONTRIBUTING.md, "Adding a generation backend")."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..registry import Registry
from .base import GenerationBackend

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..models import Agent
    from ..toolbox import Toolbox

__all__ = ["BACKENDS", "GenerationBackend", "make_backend"]

# name -> factory(cfg, agents). Factories import their backend module on use: vllm is optional.
BACKENDS: Registry[Callable[["TrainConfig", "list[Agent]"], GenerationBackend]] = Registry("backend")


@BACKENDS.register("hf")
def _hf(cfg: "TrainConfig", agents: "list[Agent]") -> GenerationBackend:
    from .hf import HFBackend

    return HFBackend(agents, cfg.generation.max_batch_rows, cfg.model.cpu_weights == "packed", cfg.model.cuda_graphs,
                     cfg.generation.prefix_reuse)


@BACKENDS.register("vllm")
def _vllm(cfg: "TrainConfig", agents: "list[Agent]") -> GenerationBackend:
    from .vllm import VLLMBackend

    return VLLMBackend(agents, cfg)


def make_backend(cfg: "TrainConfig", agents: "list[Agent]", toolbox: "Toolbox | None" = None) -> GenerationBackend:
    """The configured backend; with a toolbox that holds tools, wrapped by the tool loop."""
    from ..tool_loop import with_tools

    return with_tools(BACKENDS.get(cfg.backend)(cfg, agents), toolbox, agents)
