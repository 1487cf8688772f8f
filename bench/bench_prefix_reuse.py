"""A greedy held-out evaluation with the next turn's prompts prefilled from the last turn's kept KV caches
(`generation.prefix_reuse=true`, the default) and prefilled whole (false), in turn in one process.

    python bench/bench_prefix_reuse.py                         # issue 48's method arm, 32 problems, 2 rounds
    python bench/bench_prefix_reuse.py --problems 64 --rounds 3 -- external.history=continuation

The run's settings are experiments/reasoning_learning.py's (SmolLM2-135M, 2 agents, 2 turns; reasoning-gym's
task); overrides after `--` are added. Prints per round and setting the seconds, the tokens that prefills
fed, and the greedy pass rate per turn (the same up to a near tie: a resumed prefill rounds otherwise).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import torch

    from experiments import reasoning_learning as experiment
    from magrpo.backends import make_backend
    from magrpo.cli import compose
    from magrpo.conversation import conversation_of
    from magrpo.evaluation import evaluate, path_options
    from magrpo.generation import SamplingParams
    from magrpo.models import load_agents
    from magrpo.rollout import TreeSettings
    from magrpo.trainer import prepare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", default="method", choices=sorted(experiment.ARMS))
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose([*experiment.overrides(args.arm, 0, experiment.FULL, Path(run_dir)), *args.overrides])
    env, feedback = prepare(cfg)
    agents, tree, g = load_agents(cfg, env.num_agents), TreeSettings.of(cfg), cfg.generation
    problems = env.problems("eval")[: args.problems]
    fed: list[int] = []

    def count(module, args_, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            fed.append(ids.numel())

    hook = agents[0].model.register_forward_pre_hook(count, with_kwargs=True)
    print(f"{args.arm} arm, {len(problems)} problems, {cfg.model.name} {cfg.model.dtype}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    for round_ in range(args.rounds):
        for reuse in ((True, False) if round_ % 2 == 0 else (False, True)):
            cfg.generation.prefix_reuse = reuse
            backend = make_backend(cfg, agents)
            fed.clear()
            start = time.perf_counter()
            metrics = evaluate(env, backend, feedback, problems, cfg.trainer.num_turns,
                               SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k), 0,
                               **path_options(tree, conversation_of(cfg.external, agents)))
            seconds = time.perf_counter() - start
            backend.close()
            turns = " ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in sorted(metrics.items())
                             if k.endswith("/pass@1_greedy") and k.startswith("eval/turn_"))
            print(f"round {round_ + 1} prefix_reuse={str(reuse).lower():5s} {seconds:7.1f} s  "
                  f"prefilled {sum(fed):7d} tokens  {turns}", flush=True)
    hook.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
