"""How hard is `env.dataset=easy` for an untrained model? Sampled pass@1 on the first training problems.

    python experiments/easy_difficulty.py --out runs/easy_difficulty.json            # SmolLM2-135M (see below)
    python experiments/easy_difficulty.py --model tiny --problems 2 --samples 2     # the pipeline in seconds

One turn, one agent writes the entry point (or two agents: --agents 2), `samples` sampled paths per
problem at the model's configured temperature, through magrpo's own config, backend, env and
evaluation paths (`magrpo.evaluation.run_paths`). Only training problems are sampled: the
generator's difficulty is tuned on them, never on `heldout`. The result (JSON) is rewritten after
every chunk of 8 problems, so a stopped run keeps what it measured; `--start-at N` continues it with
the same sampling streams. Nearly every SmolLM2 completion runs to the token limit (prose after the
code), so the cost is problems x samples x max_new_tokens: 40 x 4 x 128 = 20k tokens, minutes at the
~65 tokens/s of 2 idle cores, but 8 problems took 6-25 minutes on 2 cores shared with other jobs.
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


def summary(outcomes: list[tuple[dict, dict]]) -> dict:
    """pass@1 (the share of sampled paths that pass), reward and syntax rates, overall and per template,
    and each problem's passes, from (problem, outcome) pairs."""
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    by_template: dict[str, list[float]] = defaultdict(list)
    by_problem: dict[str, list[float]] = defaultdict(list)
    for problem, outcome in outcomes:
        by_template[problem["template"]].append(outcome["passed"])
        by_problem[problem["task_id"]].append(outcome["passed"])
    return {
        "pass@1": mean([o["passed"] for _, o in outcomes]),
        "reward": mean([o["reward"] for _, o in outcomes]),
        "syntax_ok": mean([o["syntax_ok"] for _, o in outcomes]),
        "paths": len(outcomes),
        "by_template": {name: mean(v) for name, v in sorted(by_template.items())},
        "passes_by_problem": {task_id: int(sum(v)) for task_id, v in by_problem.items()},
    }


def measure(model: str, problems: int, samples: int, max_new_tokens: int, agents: int, seed: int = 0,
            start_at: int = 0, out: Path | None = None, stop: tuple[str, ...] = (),
            templates: tuple[str, ...] = (), split: str = "train") -> dict:
    from magrpo.backends import make_backend
    from magrpo.cli import compose
    from magrpo.evaluation import run_paths
    from magrpo.generation import SamplingParams, StopStrings
    from magrpo.models import load_agents
    from magrpo.sampling import stream_key
    from magrpo.trainer import prepare

    cfg = compose([f"model={model}", "env.dataset=easy", f"env.num_agents={agents}", "trainer.num_turns=1",
                   f"env.train_split='{split}{'' if templates else f'[:{problems}]'}'", "env.eval_split=heldout",
                   f"generation.max_new_tokens={max_new_tokens}", "eval.at_end=false",
                   *([f"generation.stop={json.dumps(list(stop))}"] if stop else [])])
    env, feedback = prepare(cfg)
    chosen = list(env.problems("train"))
    if templates:  # the first `problems` training problems of these templates (e.g. new ones, to tune them)
        unknown = set(templates) - {p["template"] for p in chosen}
        if unknown:
            raise SystemExit(f"--templates: no training problems of {sorted(unknown)}")
        chosen = [p for p in chosen if p["template"] in templates][:problems]
    chosen = chosen[start_at:]
    g = cfg.generation
    settings = {"problems": f"{split}[{start_at}:{problems}]", "templates": list(templates), "samples": samples,
                "agents": agents, "model": model, "temperature": g.temperature, "top_p": g.top_p,
                "max_new_tokens": g.max_new_tokens, "seed": seed, "stop": list(stop)}
    sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k)
    start = time.perf_counter()
    backend = make_backend(cfg, load_agents(cfg, env.num_agents))
    outcomes: list[tuple[dict, dict]] = []  # (problem, outcome) per sampled path
    try:
        for first in range(0, len(chosen), CHUNK):
            chunk = chosen[first:first + CHUNK]
            repeated = [p for p in chunk for _ in range(samples)]
            # the stream is keyed by the problem's index in the split: a resumed run (--start-at) draws the same
            key = stream_key(seed, STREAM, start_at + first)
            paths = run_paths(repeated, env, backend, feedback, 1, sampling, seed=key,
                              stop_strings=StopStrings.of(cfg))[0]
            outcomes += [(repeated[i], outcome) for i, outcome in paths]
            result = {**summary(outcomes), **settings, "seconds": round(time.perf_counter() - start, 1),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            if out:  # after every chunk: a stopped run keeps what it measured
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=1) + "\n")
            print(f"easy difficulty: {first + len(chunk)}/{len(chosen)} problems, pass@1 so far "
                  f"{result['pass@1']:.3f} ({result['seconds']:.0f} s)", file=sys.stderr, flush=True)
    finally:
        backend.close()
    return result


def main(argv: list[str] | None = None) -> dict:
    from magrpo.generation import unescape

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--problems", type=int, default=40, help="the first N problems of the split")
    parser.add_argument("--split", default="train", help="a training split of the easy dataset: train | train_reach")
    parser.add_argument("--start-at", type=int, default=0, help="skip the first problems (continue a stopped run)")
    parser.add_argument("--samples", type=int, default=4, help="sampled paths per problem")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--agents", type=int, default=1)
    parser.add_argument("--templates", nargs="*", default=[], help="only problems of these templates (the first "
                        "--problems of them in the train split), e.g. to measure new ones")
    parser.add_argument("--stop", nargs="*", default=[], help="generation.stop strings (\\n read as a newline), "
                        "e.g. --stop '\\n```\\n'")
    parser.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)
    result = measure(args.model, args.problems, args.samples, args.max_new_tokens, args.agents,
                     start_at=args.start_at, out=args.out,
                     stop=tuple(unescape(s) for s in args.stop), templates=tuple(args.templates), split=args.split)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
