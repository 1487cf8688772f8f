"""Every backend implements the whole `GenerationBackend` protocol, and the trainer reaches a backend
only through it: no backend names, no backend-specific config keys in trainer.py."""
from __future__ import annotations

import ast
import inspect
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from magrpo.backends import BACKENDS, GenerationBackend
from magrpo.backends.hf import HFBackend
from magrpo.backends.vllm import VLLMBackend  # importable without vllm: it is imported on use
from magrpo.errors import TrainingError
from magrpo.guards import oom_retry

# One class per registered backend name: a new backend is added here, and then checked like these.
CLASSES = {"hf": HFBackend, "vllm": VLLMBackend}


def protocol_members() -> tuple[set[str], set[str]]:
    """(methods, attributes) of GenerationBackend."""
    methods = {name for name, value in vars(GenerationBackend).items()
               if inspect.isfunction(value) and not name.startswith("_")}
    return methods, set(GenerationBackend.__annotations__)


def attributes_set_by_init(cls: type) -> set[str]:
    """Names the class defines, or its __init__ assigns as `self.<name> = ...`."""
    tree = ast.parse(inspect.getsource(cls.__init__).lstrip())
    targets = [t for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets]
    targets += [node.target for node in ast.walk(tree) if isinstance(node, ast.AnnAssign)]
    assigned = {t.attr for t in targets if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"}
    return assigned | set(dir(cls))


def test_every_registered_backend_is_checked_here():
    assert set(BACKENDS.names()) == set(CLASSES)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_backend_implements_every_method_and_attribute_of_the_protocol(name):
    cls = CLASSES[name]
    methods, attributes = protocol_members()
    assert {"generate", "halve_batch", "sync_weights", "sleep", "metrics", "close"} <= methods
    assert sorted(m for m in methods if not callable(getattr(cls, m, None))) == []
    assert sorted(attributes - attributes_set_by_init(cls)) == []


def test_batch_settings_are_config_keys():
    from magrpo.config import TrainConfig, flatten

    keys = set(flatten(asdict(TrainConfig())))
    assert {cls.batch_setting for cls in CLASSES.values()} <= keys


def test_the_trainer_names_no_backend_and_no_backend_setting():
    source = (Path(__file__).resolve().parent.parent / "magrpo" / "trainer.py").read_text()
    for name in CLASSES:
        assert f'"{name}"' not in source
    for cls in CLASSES.values():
        assert cls.batch_setting not in source
    assert "getattr(self.backend" not in source


def test_out_of_memory_in_a_running_vllm_engine_stops_and_names_its_setting():
    """A vLLM engine sizes its batches when it starts: nothing to halve, the run stops with the key."""
    engine = object.__new__(VLLMBackend)  # halve_batch needs no engine

    def generate():
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    with pytest.raises(TrainingError, match="^out of memory; lower vllm.gpu_memory_utilization;"):
        oom_retry(generate, engine.halve_batch, engine.batch_setting)
