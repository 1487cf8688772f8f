"""Evaluation through all T turns: greedy paths and sampled paths on the eval split.

A path is a tree with K=1: each turn every agent writes one completion, the feedback function
writes the next prompts. Per turn we report the env's outcomes (mean over paths), and, when the env
reports "passed", pass@1 of the greedy paths and unbiased pass@k of the sampled ones. A path that
early termination stops (as in training) keeps its last outcome for the later turns: its answer
stands, and every turn averages over every problem.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .backends import GenerationBackend
from .distributed import World
from .env import Environment
from .feedback import Branch
from .generation import SamplingParams, StopStrings
from .rollout import TreeSettings, expand_trees


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021, arXiv:2107.03374): 1 - C(n-c, k) / C(n, k) for n samples
    of which c pass, as a numerically stable product instead of binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def path_options(tree, conversation=None) -> dict[str, Any]:
    """run_paths' and evaluate's keywords from a rollout.TreeSettings: evaluation paths stop early, handle
    score errors, end at stop strings and time user code as the training trees do."""
    return dict(early_termination_threshold=tree.early_termination_threshold, on_reward_error=tree.on_reward_error,
                stop_on_truncation=tree.stop_on_truncation, conversation=conversation, stop_strings=tree.stop,
                user_code_timeout_s=tree.user_code_timeout_s)


def run_paths(problems, env, backend, feedback, num_turns, sampling, seed: int | None = None,
              world: World | None = None, early_termination_threshold: float | None = None,
              on_reward_error: str = "raise", stop_on_truncation: bool = False,
              conversation=None, stop_strings: StopStrings | None = None,
              user_code_timeout_s: float = 0,
              on_turn: Callable[[int], None] | None = None) -> dict[int, list[tuple[int, dict]]]:
    """turn -> [(problem index, outcomes)] for one K=1 path per problem, in problem order. With
    several processes each runs its share of the problems and rank 0 gets them all (others: {})."""
    world = world or World()  # one process
    start, stop = world.shard(len(problems))
    mine: dict[int, list[tuple[int, dict]]] = defaultdict(list)
    if stop > start:  # more processes than problems: some have none
        # One path per problem (K=1): each turn's single joint action, grown until the turn limit or a stop.
        settings = TreeSettings(num_generations=1, num_turns=num_turns, joint_mode="align",
                                early_termination_threshold=early_termination_threshold,
                                stop_on_truncation=stop_on_truncation, on_reward_error=on_reward_error,
                                expand="all", resample_zero_std=0,
                                cross_credit="mean", team_weight=1.0, overlap_chunks=1,
                                stop=stop_strings or StopStrings(), user_code_timeout_s=user_code_timeout_s)
        rollout = expand_trees(problems[start:stop], env, backend, feedback, settings, sampling,
                               seed=seed, tree_offset=start, conversation=conversation, on_turn=on_turn)
        last: dict[int, tuple[int, dict]] = {}
        for node in rollout.nodes:  # K=1: one joint action per node, turns in order
            last[node.tree] = (node.turn, node.outcomes[0])
            mine[node.turn].append((start + node.tree, node.outcomes[0]))
        for tree, (turn, outcome) in last.items():  # stopped early: the answer stands for the later turns
            for later in range(turn + 1, num_turns):
                mine[later].append((start + tree, outcome))
        for turn in mine:
            mine[turn].sort(key=lambda path: path[0])
    per_turn: dict[int, list[tuple[int, dict]]] = defaultdict(list)
    for part in world.gather(dict(mine)) or []:  # rank order is problem order
        for turn, paths in part.items():
            per_turn[turn].extend(paths)
    return per_turn


def evaluate(
    env: Environment,
    backend: GenerationBackend,
    feedback: Callable[[list[Branch]], list[list[str]]],
    problems: Sequence[Mapping[str, Any]],
    num_turns: int,
    sampling: SamplingParams,
    num_samples: int,
    seed: int | None = None,
    world: World | None = None,
    early_termination_threshold: float | None = None,
    on_reward_error: str = "raise",
    stop_on_truncation: bool = False,
    conversation=None,
    stop_strings: StopStrings | None = None,
    user_code_timeout_s: float = 0,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, float]:
    """Eval metrics (on rank 0 when several processes share the problems); `seed` keys the sampled
    paths' streams; paths stop early, score errors are handled, and each agent's stop strings end its
    completions, as in training. `progress(paths, turn)` after each turn of the greedy and the sampled
    paths (this process's share)."""
    start = time.perf_counter()
    out: dict[str, float] = {}
    stop = dict(early_termination_threshold=early_termination_threshold, on_reward_error=on_reward_error,
                stop_on_truncation=stop_on_truncation, conversation=conversation, stop_strings=stop_strings,
                user_code_timeout_s=user_code_timeout_s)
    def reporting(paths: str) -> Callable[[int], None] | None:
        return None if progress is None else lambda turn: progress(paths, turn)

    greedy = run_paths(problems, env, backend, feedback, num_turns, replace(sampling, greedy=True), world=world,
                       on_turn=reporting("greedy"), **stop)
    repeated = [p for p in problems for _ in range(num_samples)]
    sampled = (
        run_paths(repeated, env, backend, feedback, num_turns, sampling, seed, world, on_turn=reporting("sampled"),
                  **stop) if num_samples else {}
    )
    for turn in sorted(greedy):
        for key in greedy[turn][0][1]:
            out[f"eval/turn_{turn}/greedy_{key}_mean"] = float(np.mean([o[key] for _, o in greedy[turn]]))
        if "passed" in greedy[turn][0][1]:
            out[f"eval/turn_{turn}/pass@1_greedy"] = out[f"eval/turn_{turn}/greedy_passed_mean"]
    for turn in sorted(sampled):
        for key in sampled[turn][0][1]:
            out[f"eval/turn_{turn}/{key}_mean"] = float(np.mean([o[key] for _, o in sampled[turn]]))
        if "passed" in sampled[turn][0][1]:
            passed = defaultdict(int)
            for index, outcome in sampled[turn]:
                passed[index // num_samples] += int(outcome["passed"] > 0)
            for k in sorted({1, num_samples}):
                values = [pass_at_k(num_samples, c, k) for c in passed.values()]
                out[f"eval/turn_{turn}/pass@{k}"] = float(np.mean(values))
    last = num_turns - 1
    if f"eval/turn_{last}/pass@1_greedy" in out:
        out["eval/improvement/pass@1_greedy"] = (
            out[f"eval/turn_{last}/pass@1_greedy"] - out["eval/turn_0/pass@1_greedy"]
        )
    if f"eval/turn_{last}/pass@1" in out:
        out["eval/improvement/pass@1"] = out[f"eval/turn_{last}/pass@1"] - out["eval/turn_0/pass@1"]
    out["perf/eval_s"] = time.perf_counter() - start
    return out
