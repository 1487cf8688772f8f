"""model.dtype=auto (the default): bfloat16 where the device computes it fast, float32 elsewhere, and
the start-up line says which and why. The resolver is a pure function of the device's facts."""
from __future__ import annotations

import pytest
import torch

import magrpo.models as models
from magrpo.config import TrainConfig
from magrpo.console import startup_line
from magrpo.models import DeviceFacts, model_dtype, resolve_dtype
from tests.conftest import SMALL


@pytest.mark.parametrize("facts, want", [
    (DeviceFacts("cuda", cuda_bf16=True), ("bfloat16", "auto: CUDA with bf16")),
    (DeviceFacts("cuda", cuda_bf16=False), ("float32", "auto: GPU without bf16")),
    (DeviceFacts("cpu", cpu_amx=True), ("bfloat16", "auto: CPU with AMX")),
    (DeviceFacts("cpu", cpu_avx512_bf16=True), ("bfloat16", "auto: CPU with AVX512-BF16")),
    (DeviceFacts("cpu", cpu_amx=True, cpu_avx512_bf16=True), ("bfloat16", "auto: CPU with AMX and AVX512-BF16")),
    (DeviceFacts("cpu"), ("float32", "auto: CPU without bf16 fast path")),
    (DeviceFacts("mps"), ("float32", "auto: mps")),
])
def test_auto_picks_bfloat16_only_where_the_device_computes_it_fast(facts, want):
    assert resolve_dtype("auto", facts) == want


def test_a_dtype_set_by_the_user_is_kept_whatever_the_device():
    for facts in (DeviceFacts("cpu"), DeviceFacts("cuda", cuda_bf16=True)):
        assert resolve_dtype("bfloat16", facts) == ("bfloat16", "set by model.dtype")
        assert resolve_dtype("float32", facts) == ("float32", "set by model.dtype")


def test_auto_is_the_default_of_the_schema_and_of_every_model_option():
    from magrpo.cli import compose

    assert TrainConfig().model.dtype == "auto"
    for option in ("tiny", "smollm2-135m", "hf"):
        assert compose([f"model={option}"]).model.dtype == "auto", option


def test_the_startup_line_says_the_dtype_and_why(make_cfg, monkeypatch):
    cfg = make_cfg("model.dtype=auto", "model.device=cpu")
    monkeypatch.setattr(models, "device_facts", lambda device: DeviceFacts("cpu"))
    line = startup_line(cfg, 2, 1, (6, 24), "RUN", model_dtype(cfg.model))
    assert "; dtype float32 (auto: CPU without bf16 fast path); " in line
    monkeypatch.setattr(models, "device_facts", lambda device: DeviceFacts("cpu", cpu_amx=True))
    assert "; dtype bfloat16 (auto: CPU with AMX); " in startup_line(cfg, 2, 1, (6, 24), "RUN", model_dtype(cfg.model))


def test_the_model_loads_in_the_dtype_auto_picked(make_cfg, monkeypatch):
    monkeypatch.setattr(models, "device_facts", lambda device: DeviceFacts("cpu", cpu_avx512_bf16=True))
    agents = models.load_agents(make_cfg("model.dtype=auto", "model.device=cpu"), 1)
    assert agents[0].model.get_base_model().dtype == torch.bfloat16


def test_this_machine_reports_its_cpu_facts():
    facts = models.device_facts(torch.device("cpu"))
    assert facts.kind == "cpu" and isinstance(facts.cpu_amx, bool) and isinstance(facts.cpu_avx512_bf16, bool)


def test_a_bad_dtype_is_one_line_naming_the_allowed_values(run_cli):
    code, lines = run_cli(*SMALL, "model.dtype=fp8")
    assert code == 2 and lines == ["config error: model.dtype: 'fp8' is not allowed; choose one of: auto, bfloat16, "
                                   "float16, float32"]
