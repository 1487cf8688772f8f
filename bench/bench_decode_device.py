"""Where a decode step's time goes on any device: the HF backend's `decode` on a SmolLM2-135M-shaped
model (random weights, no download) with two agents' LoRA adapters, as in training.

    python bench/bench_decode_device.py                     # cuda if there is one, else cpu
    python bench/bench_decode_device.py --device cpu --rows 8 --steps 16 --layers 4

Prints ms per decode step for: the bare model (no LoRA), the peft model with both adapters routed
per row (RowAdapters, what magrpo runs), greedy and sampled with top-p, each eager and with the
fixed-shape step of `model.cuda_graphs` (magrpo/backends/hf_graph.py: a CUDA graph on a GPU, run
eagerly on a CPU), the two in turn; with --profile, the torch profiler's top operators of the routed
sampled run. It asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def smollm2_shaped(layers: int, dtype: torch.dtype):
    """SmolLM2-135M's architecture (LlamaForCausalLM, hidden 576, 9 heads, 3 KV heads) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=8192)
    return LlamaForCausalLM(config).to(dtype)


def timed(fn, repeats: int) -> float:
    """Best-of-`repeats` seconds of fn(), synchronising the device."""
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> None:
    from peft import LoraConfig, get_peft_model

    from magrpo.backends.hf import RowAdapters, decode
    from magrpo.generation import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens per row")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also print the profiler's top operators")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = smollm2_shaped(args.layers, dtype).to(device)
    prompts = [[(7 * r + t) % 49000 + 1 for t in range(args.prompt)] for r in range(args.rows // 4)]
    expand = torch.arange(len(prompts)).repeat_interleave(4)  # 4 samples per prompt, like K=4
    keys = torch.arange(len(expand))
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"{dtype}, {args.layers} layers, {len(expand)} rows, prompt {args.prompt}, {args.steps} steps, "
          f"torch {torch.__version__}")

    def run(model, params, adapters, routing=None, static=False):
        return decode(model, prompts, adapters, expand, params, keys, pad_id=0, eos_ids=[49151],
                      drop_finished=False, routing=routing, static=static)

    greedy = SamplingParams(args.steps, greedy=True)
    sampled = SamplingParams(args.steps, temperature=0.7, top_p=0.9, logprobs=True)
    graph = "CUDA graph" if device.type == "cuda" else "fixed shape, eager on cpu"
    bare = {"bare model, greedy": timed(lambda: run(base, greedy, ["x"] * len(prompts), NoRouting()), args.repeats),
            f"bare model, greedy, {graph}": timed(lambda: run(base, greedy, ["x"] * len(prompts), NoRouting(), True),
                                                   args.repeats)}
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base, lora, adapter_name="agent_0")
    model.add_adapter("agent_1", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    routing = RowAdapters(model)
    # grouped by agent, as the HF backend sorts its rows: each LoRA then runs on one slice of the batch
    adapters = [f"agent_{2 * i // len(prompts)}" for i in range(len(prompts))]
    rows = dict(bare)
    for label, params in (("greedy", greedy), ("sampled top-p + log-probs", sampled)):
        rows[f"2 LoRA agents routed, {label}"] = timed(lambda p=params: run(model, p, adapters, routing), args.repeats)
        rows[f"2 LoRA agents routed, {label}, {graph}"] = timed(
            lambda p=params: run(model, p, adapters, routing, True), args.repeats)
    for name, seconds in rows.items():
        print(f"{name:75s} {1000 * seconds / args.steps:7.2f} ms/step  "
              f"{len(expand) * args.steps / seconds:8.0f} tokens/s")
    if not args.profile:
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run(model, sampled, adapters, routing)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


class NoRouting:
    """The bare model has no adapters: route nothing."""

    def active(self):
        from contextlib import nullcontext

        return nullcontext(self)

    def rows(self, adapters):
        return {}


if __name__ == "__main__":
    main()
