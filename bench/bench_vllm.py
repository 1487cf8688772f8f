"""Throughput of one full tree level through magrpo's vLLM backend against the same prompts sent
straight to `vllm.LLM.generate`, and the prefix-cache hit rate, for align and cross.

Prints numbers and the ratio magrpo / raw; asserts nothing. Run it with the vLLM venv's python:

    bash scripts/setup_vllm.sh
    ~/.cache/magrpo/vllm-venv/bin/python bench/bench_vllm.py            # ~3 min on 2 CPU cores
    ~/.cache/magrpo/vllm-venv/bin/python bench/bench_vllm.py --help     # --problems, --k, --max-new-tokens, ...

What is held equal
- Engine: the backend's own `vllm.LLM` (one LoRA per agent, prefix caching on); raw calls reuse it
  and its LoRARequests, so both sides serve the same adapters with the same KV cache size.
- Level: turn 1 (the expanded level) of T=2 trees on the code env (HumanEval prompts, N=2 agents,
  plain feedback), recorded from one magrpo rollout that also warms the engine up. align: B*K nodes,
  cross: B*K^2 nodes; every node asks each agent for K samples.
- Prompts: the token ids magrpo sends (`Agent.encode_prompts`), as `TokensPrompt`s for both.
- Sampling: the same `vllm.SamplingParams` per request (n=K, max_tokens, stop at EOS, temperature 1,
  sampled-token log-probs, no detokenization: magrpo decodes the text itself, inside its timing).
- Cache: `reset_prefix_cache()` before every timed call, so neither side reuses the other's blocks;
  the hit rate is what one level gets from its own K samples and shared prompt prefixes.
- Timing: wall clock of the call (magrpo: `backend.generate`, which includes the stale-adapter check,
  encoding, building Completions and decoding texts); best of --repeats.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Recorder:
    """Delegates to a backend and keeps the requests of every generate call (one per turn)."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def generate(self, requests, params):
        self.calls.append(list(requests))
        return self.backend.generate(requests, params)


def raw_generate(backend, requests, params):
    """The same level straight through vllm.LLM.generate: returns generated tokens."""
    from vllm.inputs import TokensPrompt

    llm = next(iter(backend.engines.values()))
    prompts, sampling, loras = [], [], []
    for req in requests:
        agent = backend.agents[req.agent]
        prompts.append(TokensPrompt(prompt_token_ids=agent.encode_prompts([req.prompt])[0]))
        sampling.append(backend._sampling(params, req, sorted(agent.eos_ids())))
        loras.append(backend.lora[req.agent])
    outs = llm.generate(prompts, sampling, lora_request=loras, use_tqdm=False)
    return sum(len(o.token_ids) for out in outs for o in out.outputs)


def timed(fn, backend, repeats):
    """Best (tokens/s, hit rate) of `repeats` calls, each from an empty prefix cache."""
    llm = next(iter(backend.engines.values()))
    best = (0.0, 0.0)
    for _ in range(repeats):
        llm.reset_prefix_cache()
        backend.metrics()  # start a new hit-rate window
        start = time.perf_counter()
        tokens = fn()
        rate = tokens / (time.perf_counter() - start)
        best = max(best, (rate, backend.metrics().get("perf/prefix_cache_hit_rate", 0.0)))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="align,cross")
    parser.add_argument("--problems", type=int, default=2, help="trees (B)")
    parser.add_argument("--k", type=int, default=4, help="samples per agent per node (K)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128, help="tiny model hidden size (256 with --layers 8: ~9M)")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    import torch
    import vllm

    import magrpo.envs
    import magrpo.external  # noqa: F401  (fills the feedback registry)
    from magrpo.backends import make_backend
    from magrpo.cli import compose
    from magrpo.envs.code.env import CodeEnv
    from magrpo.feedback import Feedback
    from magrpo.generation import SamplingParams
    from magrpo.models import load_agents
    from magrpo.rollout import TreeSettings, expand_trees

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the shipped HumanEval copy
    cfg = compose(["env=code", "model=tiny", "backend=vllm", "logging.wandb.mode=disabled",
                   f"model.tiny_hidden_size={args.hidden}", f"model.tiny_layers={args.layers}"])
    env = CodeEnv(CodeEnv.Config())
    agents = load_agents(cfg, env.num_agents)
    backend = make_backend(cfg, agents)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, logprobs=True)
    problems = env.problems("train")[: args.problems]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"vllm {vllm.__version__}, tiny model hidden {args.hidden} x {args.layers} layers, "
          f"B={args.problems} K={args.k} N={env.num_agents} max_new_tokens={args.max_new_tokens}")
    print(f"{'mode':6} {'seqs':>5} {'magrpo tok/s':>13} {'raw tok/s':>10} {'ratio':>6} "
          f"{'hit magrpo':>11} {'hit raw':>8}")
    try:
        for mode in args.modes.split(","):
            recorder = Recorder(backend)
            expand_trees(problems, env, recorder, Feedback(cfg.external, env),
                         replace(TreeSettings.of(cfg), num_generations=args.k, num_turns=2, joint_mode=mode), params)
            level = recorder.calls[1]
            seqs = sum(r.n for r in level)

            def ours(level=level):
                return sum(len(c.token_ids) for cs in backend.generate(level, params) for c in cs)

            mine, mine_hit = timed(ours, backend, args.repeats)
            raw, raw_hit = timed(lambda level=level: raw_generate(backend, level, params), backend, args.repeats)
            print(f"{mode:6} {seqs:5d} {mine:13.0f} {raw:10.0f} {mine / raw:6.2f} {mine_hit:11.2f} {raw_hit:8.2f}")
    finally:
        backend.close()


if __name__ == "__main__":  # the engine core is a spawned process: it re-imports this module
    main()
