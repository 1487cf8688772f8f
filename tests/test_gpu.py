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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_captured_as_a_cuda_graph_samples_what_the_eager_loop_does(dtype, monkeypatch):
    """model.cuda_graphs (magrpo/backends/hf_graph.py) on the device: the step is captured (no fallback warning)
    and replayed; in float32 it samples the eager loop's tokens with its log-probs up to rounding; in bfloat16,
    where a batch's shape moves logits by rounding and a near tie can turn a path, most tokens agree."""
    import warnings

    from magrpo.backends import hf_graph
    from magrpo.backends.hf import decode
    from magrpo.generation import SamplingParams
    from magrpo.models import load_agents
    from tests.conftest import SMALL, compose

    agents = load_agents(compose([*SMALL, "model.device=cuda", f"model.dtype={dtype}", "lora.r=4"]), 2)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in agents[0].model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    captured = []
    real = hf_graph.StaticStep._capture
    monkeypatch.setattr(hf_graph.StaticStep, "_capture", lambda self: real(self) or captured.append(self.graph))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 40, 17, 5)]
    adapters = [agents[0].adapter] * 2 + [agents[1].adapter] * 2
    expand = torch.arange(4).repeat_interleave(3)
    for greedy in (True, False):
        params = SamplingParams(max_new_tokens=16, temperature=1.0, logprobs=True, greedy=greedy)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns: fail here instead
            eager = decode(agents[0].model, prompts, adapters, expand, params, torch.arange(12), 0, [-1])
            graphed = decode(agents[0].model, prompts, adapters, expand, params, torch.arange(12), 0, [-1],
                             static=True)
        assert captured and captured[-1] is not None
        if dtype == "float32":
            assert torch.equal(graphed.tokens, eager.tokens)
            torch.testing.assert_close(graphed.logprobs, eager.logprobs, rtol=0, atol=1e-4)
        else:
            assert (graphed.tokens == eager.tokens).float().mean() >= 0.75
