"""What one decode step's model forward costs, and what two ideas for cutting it would give.

    python bench/bench_decode_step.py steps      # tiny model: dynamic cache, static cache, compiled (~3 min)
    python bench/bench_decode_step.py prefill    # SmolLM2-135M: a code-env turn-2 prefill, whole and shared
    python bench/bench_decode_step.py lora-prefill  # SmolLM2-135M, 2 LoRA agents: the hook's buffers reused or fresh
    python bench/bench_decode_step.py split-prefill # SmolLM2-135M, 2 LoRA agents: prompts of mixed length
    python bench/bench_decode_step.py products      # SmolLM2-135M: one decode step's base products alone
    python bench/bench_decode_step.py small-ops     # a decode's small operations, caches warm and evicted

`steps`: the tiny model with two agents' LoRA adapters (routed per row by the HF backend's
RowAdapters, as in training), a 16-token prompt per row, then 32 greedy decode steps, timed per step
for: the eager forward with the dynamic KV cache (what magrpo runs), the eager forward with a
`StaticCache`, and that forward through `torch.compile` at a fixed shape (compile time printed). It
prints min and median ms per step over repeats and whether the three gave the same tokens.

`prefill`: SmolLM2-135M prefills of the shapes a code-env tree's second turn needs (8 prompts of
~350 tokens: 4 nodes x 2 agents) against the same work with each agent's ~170-token shared prefix run
once (2 x 170, then 8 x 180), min of 3; plus one decode step at 32 rows for scale. It asserts nothing.

`lora-prefill`: SmolLM2-135M as `model.dtype=auto` loads it (bfloat16 on a CPU with a bf16 fast path) with
two agents' LoRA adapters (float32, as in training), a routed prefill of --prompts prompts of --length
tokens, half per agent, as an evaluation's turn 2 runs it: RowAdapters with the batched hook's
intermediates in reused buffers (what magrpo runs) against fresh tensors, interleaved, min and median
of --repeats, and whether both gave the same logits bit for bit.

`split-prefill`: the same model and adapters, a decode of one greedy token after --prompts prompts whose
lengths are spread evenly from --length / 2 to --length (an evaluation's second turn: 150-377 tokens for
issue 48's task), half per agent: the prefill split into groups of similar length (what magrpo runs on a
CPU) against one left-padded prefill, interleaved, min and median of --repeats, and how many tokens
differ (in bfloat16 some do at near ties: the shapes round otherwise).

`products`: the model as `model.dtype=auto` loads it, and only its base linear layers (the head included):
one decode step's products of --rows rows each, in layer order (each weight read from memory, as a step
reads them) and the same number of products on the first decoder layer's weights (in cache), with the
weights packed for oneDNN (`model.cpu_weights=packed`, where this machine gives the same bits) and plain
(`F.linear`), min of --repeats; and a read of every weight (a sum over each) for the machine's own read rate
of those bytes. What a decode step at these rows cannot go below without other kernels.

`small-ops`: transformers' LlamaRMSNorm of SmolLM2's width (7 small operations) on --rows rows in bfloat16,
timed alone (everything it touches in cache), right after a read of 24 MB (more than a core's L2), and right
after a packed product with one of 24 weights in turn (42 MB), as in a decode step, where every layer's
weights stream through the caches between its small operations. Median of --repeats means of 100 calls.
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def decode_steps(model, ids: torch.Tensor, steps: int, forward, static: bool) -> tuple[float, torch.Tensor]:
    """Seconds for `steps` greedy decode steps after a prefill of `ids`, and the tokens."""
    from transformers import StaticCache

    from magrpo.models import cache_keyword

    prompt, key = ids.shape[1], cache_keyword(model)
    cache = StaticCache(config=model.config, max_cache_len=prompt + steps + 1) if static else None
    out = model(input_ids=ids, use_cache=True, cache_position=torch.arange(prompt), **{key: cache})
    cache, nxt, tokens = out[key], out.logits[:, -1].argmax(-1, keepdim=True), []
    start = time.perf_counter()
    for step in range(steps):
        nxt = forward(nxt, cache, torch.tensor([prompt + step]))[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
    return time.perf_counter() - start, torch.cat(tokens, 1)


def steps(args) -> None:
    from magrpo.backends.hf import RowAdapters
    from magrpo.cli import compose
    from magrpo.models import cache_keyword, load_agents

    torch.manual_seed(0)
    agents = load_agents(compose(["model=tiny", "env=length_ratio", "external=length_ratio"]), 2)
    model = agents[0].model.eval()
    for name, param in model.named_parameters():  # peft starts B at zero: make the adapters change something
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    routing = RowAdapters(model)
    key = cache_keyword(model)

    def eager(nxt, cache, position):
        return model(input_ids=nxt, use_cache=True, cache_position=position,
                     position_ids=position[None].expand(nxt.shape[0], 1), **{key: cache}).logits

    with torch.no_grad(), routing.active():
        for rows in args.rows:
            ids = torch.randint(10, 1000, (rows, 16))
            routing.rows([agents[0].adapter] * (rows // 2) + [agents[1].adapter] * (rows - rows // 2))
            compiled = torch.compile(eager, dynamic=False)
            start = time.perf_counter()
            decode_steps(model, ids, args.steps, compiled, static=True)
            compile_s = time.perf_counter() - start
            kinds = {"dynamic cache": (eager, False), "static cache": (eager, True),
                     "static cache, compiled": (compiled, True)}
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            tokens = {}
            for _ in range(args.repeats):  # interleaved: drifts in machine speed hit all three alike
                for kind, (forward, static) in kinds.items():
                    seconds, tokens[kind] = decode_steps(model, ids, args.steps, forward, static)
                    times[kind].append(seconds / args.steps * 1000)
            same = all(torch.equal(t, tokens["dynamic cache"]) for t in tokens.values())
            print(f"{rows} rows (compiling took {compile_s:.1f} s; same tokens: {'yes' if same else 'NO'}):")
            for kind, ms in times.items():
                print(f"  {kind:<24} min {min(ms):6.2f} ms/step, median {sorted(ms)[len(ms) // 2]:6.2f}")


def prefill(args) -> None:
    from transformers import AutoModelForCausalLM

    from magrpo.models import cache_keyword
    from magrpo.pretrained import offline_model_path

    model = AutoModelForCausalLM.from_pretrained(offline_model_path("smollm2-135m"), dtype=torch.float32).eval()
    key = cache_keyword(model)
    with torch.no_grad():
        for label, rows, length in [("turn-2 prefill, whole prompts", 8, 350), ("shared prefixes", 2, 170),
                                    ("the rest of each prompt", 8, 180)]:
            ids = torch.randint(100, 40000, (rows, length))
            seconds = []
            for _ in range(3):
                start = time.perf_counter()
                model(input_ids=ids, logits_to_keep=1)
                seconds.append(time.perf_counter() - start)
            print(f"{label:<32} {rows} x {length} tokens: min {min(seconds):.3f} s")
        out = model(input_ids=torch.randint(100, 40000, (32, 400)), use_cache=True, logits_to_keep=1)
        seconds = []
        for _ in range(10):
            start = time.perf_counter()
            out = model(input_ids=torch.randint(100, 40000, (32, 1)), use_cache=True, **{key: out[key]})
            seconds.append(time.perf_counter() - start)
        print(f"{'one decode step':<32} 32 rows, 400 cached: min {min(seconds):.3f} s")


def lora_prefill(args) -> None:
    from magrpo.backends.hf import RowAdapters

    agents = lora_agents(args.model)
    model = agents[0].model.eval()
    ids = torch.randint(3, min(40000, model.config.vocab_size), (args.prompts, args.length))
    rows = [agents[0].adapter] * (args.prompts // 2) + [agents[1].adapter] * (args.prompts - args.prompts // 2)
    kinds = {"reused buffers": RowAdapters(model), "fresh tensors": RowAdapters(model, reuse_buffers=False)}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    logits = {}
    print(f"{args.model} {next(model.parameters()).dtype}, {torch.get_num_threads()} thread(s), {args.prompts} "
          f"prompts x {args.length} tokens, torch {torch.__version__}")
    with torch.no_grad():
        for _ in range(args.repeats):  # interleaved: drifts in machine speed hit both alike
            for kind, routing in kinds.items():
                with routing.active():
                    start = time.perf_counter()
                    logits[kind] = model(input_ids=ids, logits_to_keep=1, **routing.rows(rows)).logits
                    times[kind].append(time.perf_counter() - start)
    same = torch.equal(*logits.values())
    for kind, seconds in times.items():
        print(f"  {kind:<16} min {min(seconds):6.2f} s, median {sorted(seconds)[len(seconds) // 2]:6.2f} s")
    print(f"  same logits: {'yes' if same else 'NO'}")


def lora_agents(model: str):
    """The model as model.dtype=auto loads it, with two agents' LoRA adapters that change something."""
    from magrpo.cli import compose
    from magrpo.models import load_agents

    torch.manual_seed(0)
    cfg = compose([f"model={model}", "model.dtype=auto", "model.device=cpu", "env=length_ratio",
                   "external=length_ratio"])
    agents = load_agents(cfg, 2)
    for name, param in agents[0].model.named_parameters():  # peft starts B at zero
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return agents


def split_prefill(args) -> None:
    from magrpo.backends.hf import RowAdapters, decode
    from magrpo.backends.hf_prefill import group_cost, length_groups
    from magrpo.generation import SamplingParams

    agents = lora_agents(args.model)
    model = agents[0].model.eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [args.length // 2 + (args.length - args.length // 2) * i // max(1, args.prompts - 1)
               for i in range(args.prompts)]
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]  # agents' lengths mixed
    prompts = [torch.randint(3, min(40000, model.config.vocab_size), (n,), generator=gen).tolist() for n in lengths]
    adapters = [agents[0].adapter] * (args.prompts // 2) + [agents[1].adapter] * (args.prompts - args.prompts // 2)
    groups = length_groups(lengths, group_cost(model))
    padded = len(lengths) * max(lengths)
    grouped = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    print(f"{args.model} {next(model.parameters()).dtype}, {torch.get_num_threads()} thread(s), {args.prompts} "
          f"prompts of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all; one prefill computes {padded}, "
          f"{len(groups)} group(s) {grouped}, a forward priced at {group_cost(model)} tokens), "
          f"torch {torch.__version__}")
    routing = RowAdapters(model)
    params = SamplingParams(max_new_tokens=1, greedy=True)
    times: dict[str, list[float]] = {"split into groups": [], "one prefill": []}
    tokens = {}
    with torch.no_grad():
        for _ in range(args.repeats):  # interleaved: drifts in machine speed hit both alike
            for kind, split in (("split into groups", True), ("one prefill", False)):
                start = time.perf_counter()
                tokens[kind] = decode(model, prompts, adapters, torch.arange(len(prompts)), params,
                                      torch.arange(len(prompts)), pad_id=0, eos_ids=[-1], routing=routing,
                                      split_prefill=split).tokens
                times[kind].append(time.perf_counter() - start)
    for kind, seconds in times.items():
        print(f"  {kind:<18} min {min(seconds):6.2f} s, median {sorted(seconds)[len(seconds) // 2]:6.2f} s")
    differ = int((tokens["split into groups"] != tokens["one prefill"]).sum())
    print(f"  same tokens: {'yes' if not differ else f'{differ} of {len(prompts)} differ'} (in bfloat16 a batch's "
          f"shape moves logits by its rounding: one prompt alone differs from one prefill as often)")


def products(args) -> None:
    import torch.nn.functional as F
    from bench_roofline import best

    from magrpo.backends.hf_linear import PackedLinears

    agents = lora_agents(args.model)
    model = agents[0].model.eval()
    names = {m: n for n, m in model.named_modules()}
    layers = [m for m in model.modules()  # the base layers and the head, not the adapters' own
              if type(m) is torch.nn.Linear and "lora_" not in names[m]]
    first = [m for m in layers if ".layers.0." in names[m]]
    repeated = [first[i % len(first)] for i in range(len(layers))]  # as many products, weights in cache
    weights = [m.weight for m in layers]
    size = sum(w.numel() * w.element_size() for w in weights)
    linears = PackedLinears(model)

    def run(order, inputs, packed: bool) -> None:
        for m in order:  # inside linears.active() a packed layer's own forward multiplies with its packed copy
            m(inputs[m.in_features]) if packed else F.linear(inputs[m.in_features], m.weight)

    with torch.no_grad():
        read = best(lambda: [w.sum() for w in weights], args.repeats)
        with linears.active() as packed:
            print(f"{args.model} {weights[0].dtype}, {torch.get_num_threads()} thread(s), {len(layers)} linear "
                  f"layers ({packed} packed), {size / 1e6:.0f} MB of weights; reading them (a sum over each): "
                  f"{read * 1e3:.1f} ms ({size / read / 1e9:.1f} GB/s), torch {torch.__version__}")
        for rows in args.rows:
            inputs = {n: torch.randn(rows, 1, n, dtype=weights[0].dtype) for n in {m.in_features for m in layers}}
            line = []
            for kind in ("packed", "plain"):
                with linears.active() if kind == "packed" else nullcontext():
                    cold = best(lambda: run(layers, inputs, kind == "packed"), args.repeats)  # noqa: B023 (called here)
                    warm = best(lambda: run(repeated, inputs, kind == "packed"), args.repeats)  # noqa: B023
                line.append(f"{kind}: in layer order {cold * 1e3:6.1f} ms ({size / cold / 1e9:4.1f} GB/s), "
                            f"one layer's repeated {warm * 1e3:6.1f} ms")
            print(f"  {rows:3d} rows: " + "; ".join(line))


def product_in_turn(x: torch.Tensor, packed: list, turn) -> None:
    from magrpo.backends.hf_linear import _packed_product

    _packed_product(x, packed[next(turn) % len(packed)], None)


def small_ops(args) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from magrpo.backends.hf_linear import _pack

    width, dtype = 576, torch.bfloat16  # SmolLM2-135M's hidden size and a CPU decode's dtype
    norm = LlamaRMSNorm(width).to(dtype)
    big = torch.zeros(12 << 20, dtype=dtype)  # 24 MB
    weights = [torch.randn(1536, width, dtype=dtype) for _ in range(24)]  # 42 MB, read in turn: from memory
    packed = [_pack(w) for w in weights]
    print(f"LlamaRMSNorm({width}) in {dtype}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    with torch.no_grad():
        for rows in args.rows:
            x = torch.randn(rows, 1, width, dtype=dtype)
            turn = iter(range(1 << 62))
            before = {"alone": lambda: None, "after a 24 MB read": big.sum}
            if packed[0] is not None:  # a CPU or torch build without oneDNN's bfloat16 reorder has none
                before["after a product (24 weights in turn)"] = partial(product_in_turn, x, packed, turn)
            line = []
            for kind, first in before.items():
                medians = []
                for _ in range(args.repeats):
                    spent = 0
                    for _ in range(100):
                        first()
                        start = time.perf_counter_ns()
                        norm(x)
                        spent += time.perf_counter_ns() - start
                    medians.append(spent / 100 / 1e3)
                line.append(f"{kind} {sorted(medians)[len(medians) // 2]:6.1f} us")
            print(f"  {rows:3d} rows: " + ", ".join(line))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["steps", "prefill", "lora-prefill", "split-prefill", "products", "small-ops"])
    p.add_argument("--rows", type=int, nargs="+", default=[2, 8, 32], help="steps, products, small-ops: rows per "
                   "decode (default 2 8 32)")
    p.add_argument("--steps", type=int, default=32, help="steps: decode steps per run (default 32)")
    p.add_argument("--repeats", type=int, default=7,
                   help="steps, lora-prefill, split-prefill, products, small-ops: timed runs of each kind (default 7)")
    p.add_argument("--model", default="smollm2-135m", help="lora-prefill, split-prefill, products: a configs/model "
                   "group (default smollm2-135m; tiny for a quick check)")
    p.add_argument("--prompts", type=int, default=16, help="lora-prefill, split-prefill: prompts (default 16)")
    p.add_argument("--length", type=int, default=300, help="lora-prefill: tokens per prompt; split-prefill: the "
                   "longest prompt (default 300)")
    args = p.parse_args(argv)
    probes = {"steps": steps, "prefill": prefill, "lora-prefill": lora_prefill, "split-prefill": split_prefill,
              "products": products, "small-ops": small_ops}
    probes[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
