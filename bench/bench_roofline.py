"""magrpo against the machine: what one decode step and one update pass would cost at this machine's own
memory bandwidth and matrix rate, and what they take.

    python bench/bench_roofline.py                                   # the tiny model, 32 rows
    python bench/bench_roofline.py --model smollm2-135m --rows 32    # SmolLM2-135M (~1 min on 2 cores)
    python bench/bench_roofline.py --model smollm2-135m --dtype bfloat16 --attention sdpa magrpo_sdpa --pairs 3
                                     # before / after magrpo/attention.py, alternating in one process
    python bench/bench_roofline.py --model smollm2-135m --dtype bfloat16 --pairs 6 \
        --attention magrpo_sdpa magrpo_sdpa_kernel_decode   # decode steps on grouped matmuls / torch's kernel
    python bench/bench_roofline.py --model smollm2-135m --dtype bfloat16 --lora-matmul-dtype float32 model --pairs 3
                                     # the update pass with lora.matmul_dtype float32 / model, alternating

The machine, measured here first (best of several repeats, torch's own threads):
* bandwidth: a copy of a 256 MB tensor (read + write = 2 x 256 MB moved);
* matrix rate: a square matmul (n = 2048) in the model's dtype, 2 n^3 floating-point operations.

One decode step of R rows at context length L (magrpo's own loop: `magrpo.backends.hf.decode`, both
agents' LoRA routed per row, no EOS so every row stays; the step time is (time of S2 steps - time of
S1 steps) / (S2 - S1), so the prefill cancels out):
* bytes: every weight once (all rows share the read: base model and both adapters) + the KV cache of
  every row (2 x layers x kv_heads x head_dim x L values per row);
* FLOPs: 2 x (matmul parameters + per-row LoRA) per row + attention 4 x layers x heads x head_dim x L
  per row (QK^T and AV); the lm_head counts (it is a matmul even when tied to the embedding).
The roofline time is max(bytes / bandwidth, FLOPs / matrix rate); magrpo's fraction = roofline / measured.

One update pass over R completions of T tokens after one shared P-token prompt (a node's samples
share theirs; `magrpo.update.forward_logprobs` with gradients, then backward of their sum: what
AgentUpdater does per micro-batch, without the optimizer): FLOPs ~ 4 x matmul parameters x tokens (the
frozen base needs gradients to its inputs only, not to its weights: forward 2, backward 2; the lm_head
at completion tokens only) + attention (forward 4, backward 8 per layer, head, head dimension and key);
bytes ~ weights twice (forward and backward) + the activations kept for backward, which this estimate
leaves out (so the bound is optimistic on bandwidth). Asserts nothing; prints a table
(docs/benchmarks.md, "Roofline").
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


def best(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls (seconds), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def machine(dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """This machine's copy bandwidth (bytes/s) and matmul rate (FLOP/s) in `dtype`."""
    src = torch.ones(64 << 20, dtype=torch.float32)  # 256 MB
    dst = torch.empty_like(src)
    copy_s = best(lambda: dst.copy_(src), repeats)
    n = 2048
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    mm_s = best(lambda: torch.mm(a, b), repeats)
    return {"bandwidth": 2 * src.nbytes / copy_s, "matmul": 2 * n ** 3 / mm_s}


def shape(model) -> dict[str, int]:
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"layers": cfg.num_hidden_layers, "heads": heads, "kv_heads": getattr(cfg, "num_key_value_heads", heads),
            "head_dim": head_dim, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size}


def counts(model, agents: int) -> dict[str, float]:
    """Parameters: those of matmuls (every linear, lm_head included even when tied; `head`: the lm_head's
    alone), LoRA per agent, and the bytes of every weight a step reads."""
    linear, lora, weight_bytes = 0, 0, 0
    head = model.get_output_embeddings().weight.numel()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if "lora_" in name:
                lora += module.weight.numel()
            else:
                linear += module.weight.numel()
    seen = set()
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            weight_bytes += param.numel() * param.element_size()
    return {"linear": linear, "head": head, "lora_per_agent": lora / agents, "weight_bytes": weight_bytes}


def decode_cost(s: dict, c: dict, rows: int, context: int, dtype_bytes: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step of `rows` rows at context length `context`."""
    kv = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * context * dtype_bytes
    flops = rows * (2 * (c["linear"] + c["lora_per_agent"]) + 4 * s["layers"] * s["heads"] * s["head_dim"] * context)
    return c["weight_bytes"] + rows * kv, flops


def update_cost(s: dict, c: dict, rows: int, prompt: int, tokens: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one forward + backward over `rows` completions of `tokens` tokens after one shared
    `prompt`-token prompt (a node's K samples share theirs: it runs once). Forward 2, backward 2 (inputs
    only) per matmul parameter and token, the lm_head at completion tokens only; attention forward 4 and
    backward 8 per layer, head, head dimension and key."""
    body = c["linear"] - c["head"] + c["lora_per_agent"]
    attention = 12 * s["layers"] * s["heads"] * s["head_dim"]
    flops = (prompt * (4 * body + attention * prompt / 2)
             + rows * tokens * (4 * (body + c["head"]) + attention * (prompt + tokens / 2)))
    return 2 * c["weight_bytes"], flops


def measure_decode(agents, rows: int, prompt: int, steps: tuple[int, int], linears=None) -> float:
    """Seconds per decode step of magrpo's loop (two lengths, the prefill cancels out); `linears`: the
    model's PackedLinears (model.cpu_weights=packed) or None (plain)."""
    from magrpo.backends.hf import RowAdapters, decode
    from magrpo.generation import SamplingParams

    model = agents[0].model
    routing = RowAdapters(model)
    ids = [list(range(10, 10 + prompt))] * 2  # one prompt per agent; half the rows through each adapter
    adapters = [agents[0].adapter, agents[1].adapter]
    expand = torch.tensor([0] * (rows // 2) + [1] * (rows - rows // 2))
    keys = torch.arange(rows)

    def run(n: int) -> None:
        decode(model, ids, adapters, expand, SamplingParams(max_new_tokens=n), keys, pad_id=0, eos_ids=[-1],
               routing=routing, linears=linears)

    short, long = steps
    return (best(lambda: run(long), 2) - best(lambda: run(short), 2)) / (long - short)


def measure_update(agents, rows: int, prompt: int, tokens: int, lora_in_model_dtype: bool = False) -> float:
    """Seconds for one forward with gradients and backward over `rows` completions (one micro-batch)."""
    from magrpo.update import TrainSample, forward_logprobs, pack

    model = agents[0].model
    model.train()
    samples = [TrainSample(list(range(10, 10 + prompt)), [(r * 7 + t) % 1000 + 10 for t in range(tokens)], 1.0)
               for r in range(rows)]
    batch = pack(samples, 0)

    def step() -> None:
        logprobs, _ = forward_logprobs(model, batch, lora_in_model_dtype=lora_in_model_dtype)
        logprobs[batch.target_mask].sum().backward()
        model.zero_grad(set_to_none=True)

    seconds = best(step, 2)
    model.eval()
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a configs/model group: tiny | smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (decode: the context at the start)")
    parser.add_argument("--tokens", type=int, default=32, help="completion tokens (update)")
    parser.add_argument("--steps", type=int, nargs=2, default=(4, 20), help="decode steps of the short and long run")
    parser.add_argument("--attention", nargs="+", help="attention implementations to time the decode step with, "
                        "in turn (sdpa: transformers' own; magrpo_sdpa: magrpo/attention.py with decode steps on "
                        "grouped matmuls; magrpo_sdpa_kernel_decode: with decode steps on torch's kernel; magrpo "
                        "loads the latter on an Intel CPU with AVX512-BF16, the former elsewhere)")
    parser.add_argument("--cpu-weights", nargs="+", default=["packed"], choices=["packed", "plain"],
                        help="model.cpu_weights of the decode step, each in turn for --pairs rounds (packed: the "
                        "default; plain: oneDNN reorders each bfloat16 weight at every product)")
    parser.add_argument("--pairs", type=int, default=1, help="rounds of the --attention implementations, the "
                        "--cpu-weights and the --lora-matmul-dtype values, each in turn")
    parser.add_argument("--cpu-memory", default="system", help="model.cpu_memory: system (glibc's own malloc "
                        "settings, magrpo's default) | keep (compare the two in separate processes, in turn)")
    parser.add_argument("--lora-matmul-dtype", nargs="+", default=["float32"], choices=["float32", "model"],
                        help="lora.matmul_dtype of the update pass, each in turn for --pairs rounds (float32: the "
                        "default; model: the LoRA products in the model's dtype)")
    args = parser.parse_args(argv)

    from magrpo.backends.hf_linear import PackedLinears
    from magrpo.cli import compose
    from magrpo.models import load_agents

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    cfg = compose([f"model={args.model}", f"model.dtype={args.dtype}", "env=length_ratio", "external=length_ratio",
                   f"model.cpu_memory={args.cpu_memory}"])
    agents = load_agents(cfg, 2)
    for name, param in agents[0].model.named_parameters():  # peft starts B at zero: make the adapters do work
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    box = machine(dtype)
    s, c = shape(agents[0].model), counts(agents[0].model, 2)
    context = args.prompt + sum(args.steps) // 2
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    rows = []
    base = agents[0].model.get_base_model()
    loaded = base.config._attn_implementation
    linears = {"packed": PackedLinears(agents[0].model), "plain": None}  # packed once, kept across rounds
    with torch.no_grad():
        for _ in range(args.pairs):  # in turn, so a drift of the machine's load hits each alike
            for impl in args.attention or [loaded]:
                base.set_attn_implementation(impl)
                for weights in args.cpu_weights:
                    decode_s = measure_decode(agents, args.rows, args.prompt, tuple(args.steps), linears[weights])
                    name = f"decode, {impl}" + ("" if args.cpu_weights == ["packed"] else f", {weights}")
                    rows.append((name, *decode_cost(s, c, args.rows, context, dtype_bytes), decode_s))
    base.set_attn_implementation(loaded)
    for _ in range(args.pairs):
        for lora_dtype in args.lora_matmul_dtype:
            update_s = measure_update(agents, args.rows, args.prompt, args.tokens, lora_dtype == "model")
            name = "update pass" + ("" if args.lora_matmul_dtype == ["float32"] else f", lora {lora_dtype}")
            rows.append((name, *update_cost(s, c, args.rows, args.prompt, args.tokens), update_s))

    print(f"machine: {torch.get_num_threads()} threads, copy bandwidth {box['bandwidth'] / 1e9:.1f} GB/s, "
          f"{args.dtype} matmul {box['matmul'] / 1e9:.1f} GFLOP/s")
    print(f"model: {args.model} ({c['weight_bytes'] / 1e6:.1f} MB of weights, {c['linear'] / 1e6:.2f}M matmul "
          f"parameters), {args.rows} rows, prompt {args.prompt}, {args.dtype}, cpu_memory={args.cpu_memory}")
    print(f"{'':28} {'MB moved':>9} {'GFLOP':>8} {'bw bound ms':>11} {'flop bound ms':>13} {'measured ms':>11} "
          f"{'roofline share':>14}")
    for name, moved, flops, seconds in rows:
        by_bytes, by_flops = moved / box["bandwidth"], flops / box["matmul"]
        print(f"{name:28} {moved / 1e6:9.1f} {flops / 1e9:8.2f} {by_bytes * 1e3:11.2f} {by_flops * 1e3:13.2f} "
              f"{seconds * 1e3:11.2f} {max(by_bytes, by_flops) / seconds:13.1%}")


if __name__ == "__main__":
    main()
