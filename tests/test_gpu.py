"""The CUDA paths (marker `gpu`): skipped where torch sees no CUDA device, so CI (CPU only) skips them.
On a GPU machine: `pytest -m gpu tests/test_gpu.py`. docs/testing.md says what ran where and when.

They cover what only a GPU runs: `model.dtype=auto` resolving to bf16, a whole run (generation, the
tool loop, the update) on the device, and the loss mask of tool outputs with bf16 CUDA kernels.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ON_CUDA = ["model.device=cuda", "model.dtype=auto"]


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_auto_dtype_is_bf16_on_a_cuda_device_with_bf16():
    from magrpo.models import device_facts, resolve_dtype

    assert resolve_dtype("auto", device_facts(torch.device("cuda", 0)))[0] == "bfloat16"


def test_a_run_on_cuda_in_bf16_trains_every_adapter(make_cfg, capsys):
    from magrpo.trainer import train

    run = train(make_cfg(*ON_CUDA, "trainer.lr=1e-2"))
    assert "bfloat16" in capsys.readouterr().err  # the start-up line names the resolved dtype
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for agent in range(2):
        loss = rows[-1][f"train/agent_{agent}/loss"]
        assert loss == loss and abs(loss) < 1e6, f"agent {agent} loss {loss}"  # finite
        # LoRA B starts at zero: a nonzero B is training
        lora_b = [t for name, t in load_file(str(run / "adapters" / f"agent_{agent}" / "adapter_model.safetensors"))
                  .items() if "lora_B" in name]
        assert lora_b and any(t.abs().sum() > 0 for t in lora_b)


def test_the_tool_loop_runs_on_cuda(make_cfg):
    from magrpo.trainer import train

    run = train(make_cfg(*ON_CUDA, "env=tool_arith", "external=plain", "tools=[calculator]", "tools.max_calls=2",
                         "generation.max_new_tokens=24", "trainer.num_turns=1", "eval.at_end=false"))
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2] and all("tools/call_rate" in r for r in rows)


def test_a_tool_output_adds_no_gradient_with_bf16_cuda_kernels():
    from magrpo.models import load_agents
    from tests.conftest import SMALL, compose
    from tests.test_loss_mask import TOOL, gradient, trailing_tool

    torch.use_deterministic_algorithms(True, warn_only=True)  # run-to-run equality, so a change must be the input's
    try:
        agent = load_agents(compose([*SMALL, *ON_CUDA, "lora.dropout=0.0"]), 1)[0]
        assert next(agent.model.parameters()).dtype == torch.bfloat16
        torch.manual_seed(0)
        with torch.no_grad():
            for p in agent.trainable_parameters():
                p.add_(0.05 * torch.randn_like(p))
        before, _ = gradient(agent, trailing_tool(TOOL))
        again, _ = gradient(agent, trailing_tool(TOOL))
        after, _ = gradient(agent, trailing_tool([50, 51, 52, 53]))
        assert all(torch.equal(a, b) for a, b in zip(before, again)), "the same input gave another gradient"
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        unmasked = gradient(agent, trailing_tool(TOOL, mask=False))[0]
        unmasked_after = gradient(agent, trailing_tool([50, 51, 52, 53], mask=False))[0]
        assert not all(torch.equal(a, b) for a, b in zip(unmasked, unmasked_after))  # a leak would show
    finally:
        torch.use_deterministic_algorithms(False)
