"""Where issue 48's held-out accuracy comes from: greedy held-out paths of one arm, untrained or with a
finished run's adapters, split by the problem's operands (both one digit, or not).

    python experiments/reasoning_breakdown.py method                       # the untrained team
    python experiments/reasoning_breakdown.py method --run OUT/runs/method/seed1   # after that run
    python experiments/reasoning_breakdown.py --training     # the training rewards, from every run's rollouts

Why: the method's team starts at about the held-out split's share of one-digit problems (80 of 216) and
stays there; this says whether the team solves those and few others, before and after training. The
settings are reasoning_learning.py's (its `overrides`), so the untrained figures must equal
OUT/untrained/<arm>.json's. Prints a table and writes OUT/breakdown/<arm>[_<run>].json with every
problem's outcome per turn.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import reasoning_learning as exp  # beside this file (it puts this checkout's magrpo on sys.path)


def kind(problem: dict) -> str:
    """'one-digit' when every operand of the expression has one digit, else 'two-digit'."""
    operands = re.findall(r"\d+", problem["metadata"]["expression"])
    return "one-digit" if all(len(x) == 1 for x in operands) else "two-digit"


def load_run_adapters(agents, run: Path) -> None:
    """Each agent's LoRA weights from a finished run's adapters/agent_<i>/ (Agent.save's format)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    for agent in agents:
        weights = load_file(str(run / "adapters" / agent.adapter / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(agent.model, weights, adapter_name=agent.adapter)
        if getattr(result, "unexpected_keys", None):
            raise SystemExit(f"breakdown: {run}: weights that fit no LoRA layer: {result.unexpected_keys[:3]}")


def breakdown(name: str, run: Path | None, out: Path, sizes: "exp.Sizes" = exp.FULL) -> dict:
    from magrpo.backends import make_backend
    from magrpo.cli import compose
    from magrpo.conversation import conversation_of
    from magrpo.evaluation import path_options, run_paths
    from magrpo.generation import SamplingParams
    from magrpo.models import load_agents
    from magrpo.rollout import TreeSettings
    from magrpo.trainer import prepare

    cfg = compose(exp.overrides(name, 0, sizes, out / "breakdown" / "scratch"))
    env, feedback = prepare(cfg)
    agents, tree, g = load_agents(cfg, env.num_agents), TreeSettings.of(cfg), cfg.generation
    if run is not None:
        load_run_adapters(agents, run)
    backend = make_backend(cfg, agents)
    problems = env.problems("eval")
    start = time.perf_counter()
    try:
        paths = run_paths(problems, env, backend, feedback, cfg.trainer.num_turns,
                          SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k, greedy=True),
                          **path_options(tree, conversation_of(cfg.external, agents)))
    finally:
        backend.close()
    kinds = [kind(p) for p in problems]
    return {"arm": name, "run": str(run) if run else None, "seconds": time.perf_counter() - start, "kinds": kinds,
            "passed": {turn: [o["passed"] for _, o in paths[turn]] for turn in sorted(paths)}}


def table(result: dict) -> str:
    kinds = result["kinds"]
    lines = ["| turn | all | one-digit | two-digit |", "|---|---|---|---|"]
    for turn, passed in result["passed"].items():
        cells = []
        for want in (None, "one-digit", "two-digit"):
            chosen = [p for p, k in zip(passed, kinds) if want is None or k == want]
            cells.append(f"{sum(x > 0 for x in chosen) / len(chosen):.3f} of {len(chosen)}")
        lines.append(f"| {int(turn) + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def training_table(runs: Path) -> str:
    """Each arm's training reward per turn (every seed's joint actions), by kind of problem and by half of the
    run: from OUT/runs/<arm>/seed*/rollouts.jsonl (kept on the machine that trained, not committed)."""
    from collections import defaultdict

    lines = ["| arm | turn | one-digit, steps 1-6 | one-digit, 7-12 | two-digit, steps 1-6 | two-digit, 7-12 |",
             "|---|---|---|---|---|---|"]
    for arm in exp.ARMS:
        rewards = defaultdict(list)
        for path in sorted(runs.glob(f"{arm}/seed*/rollouts.jsonl")):
            for line in path.open():
                record = json.loads(line)
                half = "early" if record["step"] <= exp.FULL.steps // 2 else "late"
                for node in record["nodes"]:
                    rewards[node["turn"], kind(record["problem"]), half] += [j["reward"] for j in node["joint_actions"]]
        for turn in sorted({key[0] for key in rewards}):
            cells = [f"{sum(v) / len(v):.2f} of {len(v)}" if (v := rewards[turn, k, h]) else "–"
                     for k in ("one-digit", "two-digit") for h in ("early", "late")]
            lines.append(f"| {arm} | {turn + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arm", nargs="?", choices=sorted(exp.ARMS))
    parser.add_argument("--run", type=Path, help="a finished run's folder (its adapters/); default: untrained")
    parser.add_argument("--out", type=Path, default=exp.ROOT / "experiments" / "out" / "reasoning_learning")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, smoke sizes (a check)")
    parser.add_argument("--training", action="store_true", help="the training rewards by kind (no model)")
    args = parser.parse_args(argv)
    if args.training:
        print(training_table(args.out / "runs"))
        return 0
    if args.arm is None:
        parser.error("an arm is needed (or --training)")
    if args.run is not None and not (args.run / "adapters").is_dir():
        raise SystemExit(f"breakdown: --run {args.run}: no adapters/ folder (a run writes it when it finishes)")
    result = breakdown(args.arm, args.run, args.out, exp.SMOKE if args.smoke else exp.FULL)
    label = f"{args.arm}_{args.run.name}" if args.run else args.arm
    path = args.out / "breakdown" / f"{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result) + "\n")
    print(f"{args.arm}, {'after ' + str(args.run) if args.run else 'untrained'} ({result['seconds']:.0f} s; {path}):")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
