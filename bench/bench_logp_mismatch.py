"""How far the HF backend's sampling log-probs are from the update's log-probs of the same tokens.

    python bench/bench_logp_mismatch.py                                   # SmolLM2-135M, model.dtype=auto
    python bench/bench_logp_mismatch.py --top-p 1.0 0.9 --float32-head    # and with a float32 output head
    python bench/bench_logp_mismatch.py --model tiny --dtype float32      # seconds

Two agents on one base model, each adapter's B drawn from N(0, --lora-std) so the adapters do something
(peft starts B at zero); --prompts HumanEval prompts (envs/code/data), --samples completions per prompt and
agent of --tokens tokens at --temperature, drawn by the HF backend (`HFBackend.generate`, the decode a run
uses). Each completion is then scored as the update scores it (`magrpo.update.forward_logprobs`, the agent's
adapter active, under the sampling temperature), and the bench prints the mean, median and largest
|log p_update - log p_sampler| per token: what a run logs as `train/agent_{a}/logp_mismatch` on its first
step. With top-p < 1 the sampler's log-probs are under the truncated distribution (by design, as vLLM's
`processed_logprobs`) and the update's are not, so the figure also holds the truncated mass.

Variants, each for every --top-p: --attention implementations for the decode (magrpo/attention.py; the
update keeps the one loaded), and --float32-head: the output head in float32 in both (a float32 copy of its
weight), to see how much of the mismatch is the rounding of the logits to the model's dtype.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class Float32Head(torch.nn.Module):
    """An output head that multiplies in float32 and returns float32 logits."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight32 = weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight32)


@contextmanager
def float32_head(base: torch.nn.Module, on: bool) -> Iterator[None]:
    """`base.lm_head` swapped for a Float32Head inside (when `on`)."""
    if not on:
        yield
        return
    head = base.lm_head
    base.lm_head = Float32Head(head.weight)
    try:
        yield
    finally:
        base.lm_head = head


def mismatch(agents, prompts: list[str], samples: int, params, decode_attention: str) -> torch.Tensor:
    """|log p_update - log p_sampler| of every sampled token (finite ones: a token top-p removed has -inf), the
    decode on `decode_attention`, the scoring on the attention the model was loaded with."""
    from magrpo.backends.hf import HFBackend
    from magrpo.generation import GenerationRequest
    from magrpo.update import TrainSample, forward_logprobs, pack

    model = agents[0].model
    base = model.get_base_model()
    loaded = base.config._attn_implementation
    requests = [GenerationRequest(p, a, samples) for p in prompts for a in range(len(agents))]
    base.set_attn_implementation(decode_attention)
    try:
        out = HFBackend(agents).generate(requests, params)
    finally:
        base.set_attn_implementation(loaded)
    gaps = []
    for request, completions in zip(requests, out):
        model.set_adapter(agents[request.agent].adapter)
        batch = pack([TrainSample(c.prompt_ids, c.token_ids, 0.0) for c in completions],
                     agents[0].tokenizer.pad_token_id)
        with torch.no_grad():
            scored, _ = forward_logprobs(model, batch, params.temperature)
        for row, c in enumerate(completions):
            gap = (scored[row][batch.target_mask[row]] - torch.tensor(c.logprobs)).abs()
            gaps.append(gap[torch.isfinite(gap)])
    return torch.cat(gaps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a configs/model group: smollm2-135m | tiny")
    parser.add_argument("--dtype", default="auto", help="model.dtype (auto: bfloat16 on a CPU with a bf16 fast path)")
    parser.add_argument("--prompts", type=int, default=2, help="HumanEval prompts (default 2)")
    parser.add_argument("--samples", type=int, default=2, help="completions per prompt and agent (default 2)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per completion (default 64)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.9])
    parser.add_argument("--attention", nargs="+", help="decode attention implementations to compare (default: "
                        "the one magrpo loads on this machine)")
    parser.add_argument("--float32-head", action="store_true", help="also with the output head in float32")
    parser.add_argument("--lora-std", type=float, default=0.02, help="std of the adapters' B (default 0.02)")
    args = parser.parse_args(argv)

    from magrpo.cli import compose
    from magrpo.generation import SamplingParams
    from magrpo.models import load_agents

    torch.manual_seed(0)
    cfg = compose([f"model={args.model}", f"model.dtype={args.dtype}", "model.device=cpu"])
    agents = load_agents(cfg, 2)
    torch.manual_seed(0)
    for name, param in agents[0].model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, args.lora_std)
    data = ROOT / "envs" / "code" / "data" / "HumanEval.jsonl.gz"
    prompts = [json.loads(line)["prompt"] for line in gzip.open(data, "rt")][:args.prompts]
    model = agents[0].model.eval()
    base = model.get_base_model()
    loaded = base.config._attn_implementation
    print(f"{args.model} {next(model.parameters()).dtype}, {len(prompts)} prompts x 2 agents x {args.samples} "
          f"samples x {args.tokens} tokens, temperature {args.temperature}, torch {torch.__version__}")
    for top_p in args.top_p:
        params = SamplingParams(max_new_tokens=args.tokens, temperature=args.temperature, top_p=top_p,
                                logprobs=True)
        for head32 in (False, True) if args.float32_head else (False,):
            for impl in args.attention or [loaded]:
                with float32_head(base, head32):
                    gaps = mismatch(agents, prompts, args.samples, params, impl)
                label = f"top-p {top_p}, decode attention {impl}" + (", float32 head" if head32 else "")
                print(f"  {label}: mean {gaps.mean():.5f}, median {gaps.median():.5f}, max {gaps.max():.4f} "
                      f"nats per token ({gaps.numel()} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
