"""How hard is `env.dataset=easy` for an untrained model? Sampled pass@1 on the first training problems.

    python experiments/easy_difficulty.py --out runs/easy_difficulty.json            # SmolLM2-135M, ~20 min on 2 cores
    python experiments/easy_difficulty.py --model tiny --problems 2 --samples 2     # the pipeline in seconds

One turn, one agent writes the entry point (or two agents: --agents 2), `samples` sampled paths per
problem at the model's configured temperature, through magrpo's own config, backend, env and
evaluation paths (`magrpo.evaluation.run_paths`). Only training problems are sampled: the
generator's difficulty is tuned on them, never on `heldout`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python experiments/easy_difficulty.py` from a clean clone: this checkout's magrpo
    sys.path.insert(0, str(ROOT))

STREAM = 11  # sampling stream of these paths (training uses 0, evaluation 1, code_learning's selection 7)
CHUNK = 8  # problems per generate call: a progress line, bounded batches


def measure(model: str, problems: int, samples: int, max_new_tokens: int, agents: int, seed: int = 0) -> dict:
    from magrpo.backends import make_backend
    from magrpo.cli import compose
    from magrpo.evaluation import run_paths
    from magrpo.generation import SamplingParams
    from magrpo.models import load_agents
    from magrpo.sampling import stream_key
    from magrpo.trainer import prepare

    cfg = compose([f"model={model}", "env.dataset=easy", f"env.num_agents={agents}", "trainer.num_turns=1",
                   f"env.train_split='train[:{problems}]'", "env.eval_split=heldout",
                   f"generation.max_new_tokens={max_new_tokens}", "eval.at_end=false"])
    env, feedback = prepare(cfg)
    chosen = list(env.problems("train"))
    g = cfg.generation
    sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k)
    start = time.perf_counter()
    backend = make_backend(cfg, load_agents(cfg, env.num_agents))
    outcomes: list[tuple[dict, dict]] = []  # (problem, outcome) per sampled path
    try:
        for first in range(0, len(chosen), CHUNK):
            chunk = chosen[first:first + CHUNK]
            repeated = [p for p in chunk for _ in range(samples)]
            paths = run_paths(repeated, env, backend, feedback, 1, sampling, seed=stream_key(seed, STREAM, first))[0]
            outcomes += [(repeated[i], outcome) for i, outcome in paths]
            passed = sum(o["passed"] for _, o in outcomes)
            print(f"easy difficulty: {first + len(chunk)}/{len(chosen)} problems, pass@1 so far "
                  f"{passed / len(outcomes):.3f} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    finally:
        backend.close()
    by_template: dict[str, list[float]] = defaultdict(list)
    for problem, outcome in outcomes:
        by_template[problem["template"]].append(outcome["passed"])
    mean = lambda xs: round(sum(xs) / len(xs), 4)  # noqa: E731
    return {
        "pass@1": mean([o["passed"] for _, o in outcomes]),
        "reward": mean([o["reward"] for _, o in outcomes]),
        "syntax_ok": mean([o["syntax_ok"] for _, o in outcomes]),
        "by_template": {name: mean(v) for name, v in sorted(by_template.items())},
        "problems": len(chosen), "samples": samples, "agents": agents, "model": model,
        "temperature": g.temperature, "top_p": g.top_p, "max_new_tokens": g.max_new_tokens, "seed": seed,
        "seconds": round(time.perf_counter() - start, 1), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--problems", type=int, default=40, help="the first N problems of the train split")
    parser.add_argument("--samples", type=int, default=4, help="sampled paths per problem")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--agents", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)
    result = measure(args.model, args.problems, args.samples, args.max_new_tokens, args.agents)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
