"""How hard is a reasoning-gym task for the untrained team? Sampled accuracy on the training side (issue 48).

    python experiments/reasoning_sizing.py --out runs/reasoning_sizing.json             # SmolLM2-135M, defaults
    python experiments/reasoning_sizing.py --candidates 'chain_sum:min_terms=2,max_terms=2,max_digits=1' \\
        --problems 64 --samples 2                                                          # one task, bigger
    python experiments/reasoning_sizing.py --model tiny --problems 2 --samples 1 \\
        --candidates basic_arithmetic                                                      # the pipeline in seconds

Per candidate (`task` or `task:key=value,key=value`, the keys of env.task_config), two runs through
magrpo's own config, env, feedback, backend and evaluation paths (`magrpo.evaluation.run_paths`, the
trainer's held-out evaluation without the greedy pass), on the first `--problems` problems of the
train split (env.train_seed), `--samples` sampled paths each at the model's configured sampling:
  - the team: env.num_agents=2, trainer.num_turns=2 with the env's feedback (the checker's answer is
    the team's): accuracy at turn 1 and after turn 2, and the solver's own;
  - one agent, one turn (env.num_agents=1): the single-agent baseline.
Per reply it records the tokens, the share cut at generation.max_new_tokens and the share with an
`<answer>` tag (a task at ~0 is checked for why before it is sized around). The table goes to stderr,
the result (JSON) is rewritten after every candidate, so a stopped run keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python experiments/reasoning_sizing.py` from a clean clone: this checkout's magrpo
    sys.path.insert(0, str(ROOT))

from magrpo.envs.reasoning.tasks import tag_or_last_number  # noqa: E402  (after the path line above)

STREAM = 13  # sampling stream of these paths (training 0, evaluation 1, code_learning 7, easy_difficulty 11)
CANDIDATES = (  # short verifiable answers, 2-3 difficulties each
    "basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=1",
    "basic_arithmetic:min_terms=2,max_terms=3,min_digits=1,max_digits=2",
    "chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1",
    "chain_sum:min_terms=2,max_terms=3,min_digits=1,max_digits=2",
    "leg_counting:min_animals=1,max_animals=2,max_instances=2",
    "leg_counting:min_animals=2,max_animals=3,max_instances=3",
    "simple_equations:min_terms=2,max_terms=2,min_value=1,max_value=10",
)


def parse_candidate(text: str) -> tuple[str, dict[str, Any]]:
    """'task:key=value,key=value' -> (task, {key: value}); values read as YAML scalars (ints, floats, bools)."""
    import yaml

    task, _, rest = text.partition(":")
    config = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--candidates: {item!r} in {text!r} is not key=value")
        config[key.strip()] = yaml.safe_load(value)
    return task.strip(), config


class Recorder:
    """The backend, with every generate call's completions kept (agent, Completion): run_paths makes
    one call per turn, so call t is turn t. Everything else is the backend's."""

    def __init__(self, backend: Any):
        self.backend, self.calls = backend, []

    def generate(self, requests, params):
        out = self.backend.generate(requests, params)
        self.calls.append([(r.agent, c) for r, cs in zip(requests, out) for c in cs])
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


# The tagged answer, else the reply's last number: env.answer_reading=tag_or_last_number's reading, used
# here as a diagnostic of runs that read tags.
lenient = tag_or_last_number


def reply_stats(completions: list, extract) -> dict[str, float]:
    """Tokens per reply, the share cut at max_new_tokens, the share with an <answer> tag the env reads."""
    n = len(completions) or 1
    return {"replies": len(completions),
            "tokens_per_reply": round(sum(len(c.token_ids) for c in completions) / n, 1),
            "truncated": round(sum(not c.finished for c in completions) / n, 3),
            "with_answer_tag": round(sum(extract(c.text) is not None for c in completions) / n, 3)}


@dataclass
class Paths:
    """One run's per-turn outcomes [(path index, outcomes)] and its replies per turn."""
    per_turn: dict[int, list[tuple[int, dict]]]
    replies: list[list]  # per turn: [(agent, Completion)]
    seconds: float
    tokens: int
    scored: list[list[tuple[dict, list[str]]]] = field(default_factory=list)  # per turn: (problem, joint texts)


def run(overrides: list[str], problems: int, samples: int, seed: int, agents: list | None = None):
    """Compose and prepare the run as train.py would, then sample `samples` paths per train problem."""
    from magrpo.backends import make_backend
    from magrpo.cli import compose
    from magrpo.conversation import conversation_of
    from magrpo.evaluation import run_paths
    from magrpo.generation import SamplingParams, StopStrings
    from magrpo.models import load_agents
    from magrpo.sampling import stream_key
    from magrpo.trainer import prepare

    cfg = compose(overrides)
    env, feedback = prepare(cfg)
    chosen = env.problems("train")[:problems]
    repeated = [p for p in chosen for _ in range(samples)]  # path i: problem i // samples, sample i % samples
    agents = agents[:env.num_agents] if agents else load_agents(cfg, env.num_agents)
    g, t = cfg.generation, cfg.trainer
    backend = Recorder(make_backend(cfg, agents))
    scored: list = []
    score = env.score  # kept per call (one per turn: run_paths scores a turn at once) to read the texts back

    def recording_score(problems_, joint_completions):
        scored.append([(p, list(texts)) for p, texts in zip(problems_, joint_completions)])
        return score(problems_, joint_completions)

    env.score = recording_score
    start, tokens = time.perf_counter(), backend.generated_tokens
    try:
        per_turn = run_paths(repeated, env, backend, feedback, t.num_turns,
                             SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k),
                             seed=stream_key(seed, STREAM), early_termination_threshold=t.early_termination_threshold,
                             on_reward_error=cfg.reward.on_error, stop_on_truncation=t.stop_on_truncation,
                             conversation=conversation_of(cfg.external, agents), stop_strings=StopStrings.of(cfg))
        tokens = backend.generated_tokens - tokens
    finally:
        backend.close()
    paths = Paths(dict(per_turn), backend.calls, time.perf_counter() - start, tokens, scored)
    return cfg, env, paths, agents


def accuracy(paths: list[tuple[int, dict]], key: str, samples: int) -> dict[str, Any]:
    """Mean of outcome `key` over paths; per sample index (a 'sampling seed' of its own: its spread is
    the run-to-run noise of an evaluation on these problems), and the within-problem variance that a
    paired comparison of two arms on the same problems keeps (unbiased p(1-p) s/(s-1) per problem)."""
    import numpy as np

    values = np.array([o[key] for _, o in sorted(paths, key=lambda path: path[0])], dtype=float)
    by = values.reshape(-1, samples)  # (problems, samples)
    out = {"mean": round(float(values.mean()), 4), "per_sample": [round(float(v), 4) for v in by.mean(axis=0)]}
    if samples > 1:
        p = by.mean(axis=1)
        out["within_problem_var"] = round(float((p * (1 - p) * samples / (samples - 1)).mean()), 4)
    return out


def measure_one(text: str, model: str, problems: int, samples: int, max_new_tokens: int, seed: int,
                agents: list | None, extra: list[str], team: bool = True) -> tuple[dict, list]:
    task, config = parse_candidate(text)
    base = [f"model={model}", "env=reasoning_gym", f"env.task={task}",
            *[f"+env.task_config.{k}={json.dumps(v)}" for k, v in config.items()],
            f"env.train_size={problems}", "env.eval_size=0", "eval.at_start=false", "eval.at_end=false", "eval.every=0",
            *([f"generation.max_new_tokens={max_new_tokens}"] if max_new_tokens else []), *extra]
    runs = {}
    if team:  # 2 agents (solver, checker), 2 turns, the env's feedback
        _, _, runs["team"], agents = run([*base, "env.num_agents=2", "trainer.num_turns=2"], problems, samples, seed,
                                         agents)
    cfg, env, runs["single"], agents = run([*base, "env.num_agents=1", "trainer.num_turns=1"], problems, samples,
                                           seed, agents)
    extract = env.rg.utils.extract_answer
    n_problems = len(env.problems("train")[:problems])
    result = {
        "task": task, "task_config": config, "problems": n_problems, "samples": samples,
        "max_new_tokens": cfg.generation.max_new_tokens, "temperature": cfg.generation.temperature,
        "top_p": cfg.generation.top_p, "prompt_style": env.cfg.prompt_style, "dtype": cfg.model.dtype,
        "single": accuracy(runs["single"].per_turn[0], "passed", samples),
        "replies": {"single": reply_stats([c for _, c in runs["single"].replies[0]], extract)},
        # diagnostic: the last agent's answer read leniently (tag, else its last number), scored by the verifier
        "lenient": {"single": lenient_accuracy(env, runs["single"].scored[0])},
        "tokens": {name: paths.tokens for name, paths in runs.items()},
        "seconds": {name: round(paths.seconds, 1) for name, paths in runs.items()},
        "seconds_per_problem": round(sum(p.seconds for p in runs.values()) / (n_problems * samples), 1),
        "tokens_per_s": round(sum(p.tokens for p in runs.values()) / max(sum(p.seconds for p in runs.values()), 1e-9),
                              1),
        # every reply as it is, to see why a task scores what it does
        "transcripts": {name: transcripts(paths) for name, paths in runs.items()},
    }
    if team:
        paths = runs["team"]
        for turn in range(2):
            result[f"team_turn{turn + 1}"] = accuracy(paths.per_turn[turn], "passed", samples)
            result[f"solver_turn{turn + 1}"] = accuracy(paths.per_turn[turn], "solver_score", samples)
            result["lenient"][f"team_turn{turn + 1}"] = lenient_accuracy(env, paths.scored[turn])
            for agent, role in enumerate(("solver", "checker")):
                result["replies"][f"team_turn{turn + 1}_{role}"] = reply_stats(
                    [c for a, c in paths.replies[turn] if a == agent], extract)
    return result, agents


def transcripts(paths: Paths) -> list[list[dict]]:
    return [[{"question": p["prompt"], "answer": p["answer"], "replies": texts} for p, texts in turn]
            for turn in paths.scored]


def lenient_accuracy(env, scored: list[tuple[dict, list[str]]]) -> float:
    extract = env.rg.utils.extract_answer
    return round(sum(env.verify(lenient(texts[-1], extract), p) >= 1.0 for p, texts in scored) / max(len(scored), 1), 4)


def heldout_size(within_var: float, gain: float, seeds: int, samples: int = 1, seed_sd: float = 0.0,
                 z: float = 2.0) -> float:
    """Held-out problems n for a gain `gain` between two arms' mean held-out accuracy, each the mean of
    `seeds` runs evaluated on the same n problems with `samples` sampled paths each, to exceed z standard
    errors of the difference. Per run, the evaluation's variance is within_var / (n * samples)
    (within_var = E_i[p_i (1 - p_i)], at most p (1 - p)); `seed_sd` is the spread of training itself
    (seed to seed). Var(difference) = 2 (within_var / (n samples) + seed_sd^2) / seeds <= (gain / z)^2.
    inf: no n suffices (the training spread alone is too wide for this many seeds)."""
    room = (gain / z) ** 2 * seeds / 2 - seed_sd ** 2
    return within_var / (samples * room) if room > 0 else float("inf")


def table(results: list[dict]) -> str:
    """team t1 / t2: the checker's (team's) accuracy at turn 1 / after turn 2; tag: the share of single-agent
    replies with an <answer> tag (t2: the checker's at turn 2); lenient: single-agent accuracy with the last
    number read where no tag is (a diagnostic, not the env's reward)."""
    def cell(r, key, width, sub="mean"):
        value = r.get(key)
        return f"{value[sub]:>{width}.3f}" if value else f"{'-':>{width}}"

    head = (f"{'task':<18} {'config':<46} {'n':>4} {'team t1':>7} {'team t2':>7} {'single':>6} {'tok/reply':>9} "
            f"{'cut':>4} {'tag':>4} {'tag t2':>6} {'lenient':>7} {'s/problem':>9}")
    lines = [head]
    for r in results:
        config = ",".join(f"{k}={v}" for k, v in r["task_config"].items())
        reply = r["replies"]["single"]
        t2 = r["replies"].get("team_turn2_checker")
        tag2 = f"{t2['with_answer_tag']:.2f}" if t2 else "-"
        lines.append(f"{r['task']:<18} {config:<46} {r['problems'] * r['samples']:>4} {cell(r, 'team_turn1', 7)} "
                     f"{cell(r, 'team_turn2', 7)} {cell(r, 'single', 6)} {reply['tokens_per_reply']:>9.1f} "
                     f"{reply['truncated']:>4.2f} {reply['with_answer_tag']:>4.2f} "
                     f"{tag2:>6} {r['lenient']['single']:>7.3f} "
                     f"{r['seconds_per_problem']:>9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--candidates", nargs="*", default=list(CANDIDATES),
                        help="task or task:key=value,key=value (env.task_config), e.g. chain_sum:max_terms=2")
    parser.add_argument("--problems", type=int, default=32, help="the first N problems of the train split")
    parser.add_argument("--samples", type=int, default=2, help="sampled paths per problem")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0: the model config's (smollm2-135m: 128)")
    parser.add_argument("--seed", type=int, default=0, help="keys the sampling streams")
    parser.add_argument("--single-only", action="store_true", help="one agent, one turn only (the team's 2 turns "
                        "cost ~4x the tokens)")
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("overrides", nargs="*", help="more train.py overrides, e.g. generation.temperature=1.0")
    args = parser.parse_args(argv)
    results: list[dict] = []
    agents = None  # loaded once: untrained, every candidate's team and single agent share them
    for i, text in enumerate(args.candidates):
        result, agents = measure_one(text, args.model, args.problems, args.samples, args.max_new_tokens, args.seed,
                                     agents, ["generation.max_batch_rows=0", *args.overrides], not args.single_only)
        result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        results.append(result)
        if args.out:  # after every candidate: a stopped run keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"reasoning sizing: {i + 1}/{len(args.candidates)} candidates\n{table(results)}", file=sys.stderr,
              flush=True)
    print(table(results))
    return results


if __name__ == "__main__":
    main()
