"""Tree expansion: turn by turn, every active node of every tree of the batch is generated in one
backend call, scored in one env call, and expanded through one feedback call.

With `overlap_chunks` > 1 a turn's nodes are generated in that many backend calls, and each part is
scored (and, without dynamic sampling, given its feedback) in a second thread while the next part
generates: slow scoring or feedback (sandbox timeouts, an expert over HTTP) hides behind decoding.
Every sample comes from its own random stream and every score and feedback is per node, so the
rollout is the same as the sequential one."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .advantage import GROUP_BY, agent_credit, all_groups_flat, mix_rewards, own_values, pooled_advantages, tree_returns
from .backends import GenerationBackend
from .env import Environment, Scored, call_env
from .errors import RewardError, describe, qualified_name
from .feedback import Branch
from .generation import GenerationRequest, SamplingParams
from .sampling import stream_key
from .tree import Completion, Node, expanded, joint_actions


@dataclass
class TreeSettings:
    num_generations: int
    num_turns: int
    joint_mode: str
    early_termination_threshold: float | None = None
    on_reward_error: str = "raise"  # raise | zero (the joint action scores 0 and gets no child)
    expand: str = "all"  # all | top:M | random:M: which joint actions of a node get a child (tree.expanded)
    resample_zero_std: int = 0  # regenerate a node whose agent groups all got equal rewards, up to this many times
    cross_credit: str = "mean"  # how a completion is credited when checking its group for zero variance
    team_weight: float = 1.0  # with per-agent rewards: each agent's value = w x team + (1 - w) x its own
    overlap_chunks: int = 1  # a turn's nodes in this many backend calls, scored while the next part generates

    @classmethod
    def of(cls, cfg: Any) -> "TreeSettings":
        """From a TrainConfig's trainer.* and reward.*."""
        trainer = cfg.trainer
        return cls(
            trainer.num_generations,
            trainer.num_turns,
            trainer.joint_mode,
            trainer.early_termination_threshold,
            cfg.reward.on_error,
            trainer.expand,
            trainer.resample_zero_std,
            trainer.cross_credit,
            cfg.reward.team_weight,
            cfg.generation.overlap_chunks,
        )


EXPAND_DRAWS = 0x45585044  # a stream domain of its own for random:M (never a sampling stream's key)
RESAMPLE_DRAWS = 0x52534D50  # the same for the regenerated samples of dynamic sampling


def score_guarded(
    env: Environment, owners: list, texts: list, on_error: str, turn: int
) -> tuple[list[Scored], list[bool]]:
    """env.score over a whole turn; on failure, each joint action alone, to name (raise) or zero the bad ones."""
    try:
        scored = env.score(owners, texts)
        if all(bad_score(s, len(t)) is None for s, t in zip(scored, texts)):
            return scored, [False] * len(scored)
    except Exception:  # noqa: BLE001  (any env error: find the joint action that caused it)
        pass
    out, failed = [], []
    for i, (owner, joint_texts) in enumerate(zip(owners, texts)):
        try:
            (one,) = env.score([owner], [joint_texts])
            error = bad_score(one, len(joint_texts))
        except Exception as e:  # noqa: BLE001
            error = describe(e)
        if error is not None and on_error == "raise":
            problem = problem_name(owner)
            raise RewardError(
                f"env {type(env).__name__} ({qualified_name(type(env))}.score) failed on joint action {i} "
                f"of turn {turn} (problem {problem!r}, "
                f"completions {[t[:40] for t in joint_texts]}): {error}; set reward.on_error=zero to score it 0"
            )
        out.append(one if error is None else Scored(0.0, {"reward": 0.0}))
        failed.append(error is not None)
    return out, failed


def bad_score(scored: Scored, num_agents: int) -> str | None:
    """Why a score cannot be used (a non-finite reward, per-agent rewards that are not one finite
    number per agent), or None."""
    if not np.isfinite(scored.reward):
        return f"non-finite reward {scored.reward}"
    own = scored.agent_rewards
    if own is not None and (len(own) != num_agents or not np.all(np.isfinite(np.asarray(own, dtype=np.float64)))):
        return f"agent_rewards must be {num_agents} finite numbers (one per agent), got {own!r}"
    return None


def problem_name(problem: Mapping[str, Any]) -> str:
    return problem.get("task_id") or str(problem.get("prompt", ""))[:60]


@dataclass
class Rollout:
    problems: Sequence[Mapping[str, Any]]
    nodes: list[Node]
    timings: dict[str, float] = field(default_factory=dict)  # gen_s, reward_s, feedback_s
    terminated_per_turn: list[int] = field(default_factory=list)
    reward_errors: int = 0  # joint actions scored 0 because the env failed on them (reward.on_error=zero)
    resampled_nodes: int = 0  # node regenerations by dynamic sampling (a node regenerated twice counts 2)


def _finished(value: Any) -> Future:
    """A Future already holding `value`: work done in this thread, awaited like the worker's."""
    future: Future = Future()
    future.set_result(value)
    return future


def expand_trees(
    problems: Sequence[Mapping[str, Any]],
    env: Environment,
    backend: GenerationBackend,
    feedback: Callable[[list[Branch]], list[list[str]]],
    tree: TreeSettings,
    sampling: SamplingParams,
    seed: int | None = None,
    tree_offset: int = 0,
) -> Rollout:
    """`feedback(branches) -> next-turn prompts per branch` (a magrpo.feedback.Feedback).

    With a `seed`, every node's samples come from random streams keyed by (seed, tree_offset + tree
    index, path of joint actions from the root, agent, sample): the same tree samples the same
    completions whatever else is in the batch, e.g. when a data-parallel run gives this process the
    trees from `tree_offset` on."""
    n, k = env.num_agents, tree.num_generations
    joint = joint_actions(tree.joint_mode, k, n)
    nodes: list[Node] = []
    level = []
    for b, problem in enumerate(problems):
        prompts = call_env(env, "agent_prompts", problem, where=f"at turn 0 (problem {problem_name(problem)!r})")
        level.append(Node(tree=b, turn=0, parent=None, prompts=prompts,
                          prompt_history=[[p] for p in prompts], response_history=[[] for _ in range(n)],
                          stream=None if seed is None else stream_key(seed, tree_offset + b)))
    rollout = Rollout(problems=problems, nodes=nodes, timings={"gen_s": 0.0, "reward_s": 0.0, "feedback_s": 0.0})

    def generate(at: list[Node], attempt: int) -> None:
        """One backend call for every agent of every node in `at`; attempt > 0: dynamic sampling's
        regenerations, from streams of their own."""
        def key(node: Node, a: int) -> int | None:
            if node.stream is None:
                return None
            return stream_key(node.stream, a) if attempt == 0 else stream_key(node.stream, RESAMPLE_DRAWS, attempt, a)

        samples = backend.generate(
            [GenerationRequest(node.prompts[a], a, k, key(node, a)) for node in at for a in range(n)], sampling
        )
        for i, node in enumerate(at):
            node.completions = samples[i * n : (i + 1) * n]
            node.joint = joint

    def score(at: list[Node], turn: int) -> tuple[list[Scored], np.ndarray, np.ndarray]:
        """One env call for every joint action of the nodes in `at`: scores, (nodes, J) rewards and
        failures. Sets each node's (J, N) per-agent rewards (None when the env gave none; a joint
        action without them gives every agent the team reward)."""
        texts = [[node.completions[a][j[a]].text for a in range(n)] for node in at for j in joint]
        owners = [problems[node.tree] for node in at for _ in joint]
        scored, failed = score_guarded(env, owners, texts, tree.on_reward_error, turn)
        rewards = np.asarray([s.reward for s in scored], dtype=np.float64).reshape(len(at), len(joint))
        per_agent = any(s.agent_rewards is not None for s in scored)
        own = np.asarray([s.agent_rewards if s.agent_rewards is not None else [s.reward] * n for s in scored],
                         dtype=np.float64).reshape(len(at), len(joint), n) if per_agent else None
        for i, node in enumerate(at):
            node.agent_rewards = None if own is None else own[i]
        return scored, rewards, np.asarray(failed, dtype=bool).reshape(len(at), len(joint))

    def expand(at: list[Node], first: int, turn: int, scored: list[Scored], rewards: np.ndarray,
               failed: np.ndarray) -> tuple[int, list[tuple[int, int]], list[Branch], list[list[str]]]:
        """Rewards onto the nodes `at` (level[first:...]); the joint actions that are neither at the
        turn limit nor terminated become branches, sent through one feedback call. Returns
        (terminated joint actions, (level index, joint action) of each branch, branches, child prompts)."""
        branches: list[Branch] = []
        parents: list[tuple[int, int]] = []
        terminated = 0
        for i, node in enumerate(at):
            node.rewards = rewards[i]
            node.outcomes = [s.outcomes for s in scored[i * len(joint) : (i + 1) * len(joint)]]
            stop = failed[i].copy()  # a joint action the env could not score is a leaf
            if tree.early_termination_threshold is not None:
                stop |= rewards[i] >= tree.early_termination_threshold
            node.terminated = stop if turn < tree.num_turns - 1 else np.zeros(len(joint), dtype=bool)
            terminated += int(node.terminated.sum())
            node.children = [None] * len(joint)
            if turn == tree.num_turns - 1:
                continue
            draw = None if node.stream is None else lambda j, s=node.stream: stream_key(s, EXPAND_DRAWS, j)
            grows = expanded(rewards[i], stop, tree.expand, draw)  # the rest are leaves (G = r)
            for j, choice in enumerate(joint):
                if not grows[j]:
                    continue
                chosen = [node.completions[a][choice[a]].text for a in range(n)]
                branches.append(Branch(
                    prompt=problems[node.tree]["prompt"], agent_completions=chosen,
                    prompt_history=[list(h) for h in node.prompt_history],
                    response_history=[node.response_history[a] + [chosen[a]] for a in range(n)],
                    context=scored[i * len(joint) + j].context,
                ))
                parents.append((first + i, j))
        return terminated, parents, branches, (feedback(branches) if branches else [])

    def score_and_expand(at: list[Node], first: int, turn: int, with_feedback: bool) -> dict[str, Any]:
        """The work after a part's generation, timed: score, then (with_feedback) expand."""
        t0 = time.perf_counter()
        scored, rewards, failed = score(at, turn)
        t1 = time.perf_counter()
        part = {"scored": scored, "rewards": rewards, "failed": failed, "reward_s": t1 - t0}
        if with_feedback:
            part["expanded"] = expand(at, first, turn, scored, rewards, failed)
            part["feedback_s"] = time.perf_counter() - t1
        return part

    chunks = max(1, tree.overlap_chunks)
    worker = ThreadPoolExecutor(1, thread_name_prefix="magrpo-score") if chunks > 1 else None
    # Dynamic sampling regenerates after every node is scored: feedback waits for it.
    early_feedback = tree.resample_zero_std == 0
    try:
        for turn in range(tree.num_turns):
            first_id = len(nodes)
            nodes.extend(level)
            gen_s = 0.0

            # 1) generate, 2) score (and expand): one backend call per part, its scoring in the worker
            #    thread while the next part generates (one part, the default: all in this thread)
            size = -(-len(level) // chunks)
            bounds = [(start, level[start : start + size]) for start in range(0, len(level), size)]
            pending: list[Future] = []
            for first, part in bounds:
                t0 = time.perf_counter()
                generate(part, 0)
                gen_s += time.perf_counter() - t0
                if worker is None:  # run now, so an error stops the turn before the next part generates
                    pending.append(_finished(score_and_expand(part, first, turn, early_feedback)))
                else:
                    pending.append(worker.submit(score_and_expand, part, first, turn, early_feedback))
            t_wait = time.perf_counter()
            parts = [p.result() for p in pending]
            wait_s = time.perf_counter() - t_wait
            scored = [s for p in parts for s in p["scored"]]
            rewards = np.concatenate([p["rewards"] for p in parts])
            failed = np.concatenate([p["failed"] for p in parts])
            reward_s = sum(p["reward_s"] for p in parts)
            feedback_s = sum(p.get("feedback_s", 0.0) for p in parts)
            if worker is not None:
                rollout.timings["overlap_wait_s"] = rollout.timings.get("overlap_wait_s", 0.0) + wait_s

            # 2b) dynamic sampling: regenerate the nodes whose every agent group got equal rewards
            for attempt in range(1, tree.resample_zero_std + 1):
                flat = [i for i in range(len(level)) if all_groups_flat(
                    joint, own_values(rewards[i], level[i].agent_rewards, tree.team_weight), k, tree.cross_credit)]
                if not flat:
                    break
                t0 = time.perf_counter()
                generate([level[i] for i in flat], attempt)
                t1 = time.perf_counter()
                again, again_rewards, again_failed = score([level[i] for i in flat], turn)
                for row, i in enumerate(flat):
                    scored[i * len(joint) : (i + 1) * len(joint)] = again[row * len(joint) : (row + 1) * len(joint)]
                    rewards[i], failed[i] = again_rewards[row], again_failed[row]
                rollout.resampled_nodes += len(flat)
                t2 = time.perf_counter()
                gen_s, reward_s = gen_s + t1 - t0, reward_s + t2 - t1
            rollout.reward_errors += int(failed.sum())

            # 3) expand: joint actions that are neither at the turn limit nor terminated get a child;
            #    the feedback layer sees all of this turn's expanding branches at once (per part with
            #    overlap_chunks > 1)
            if early_feedback:
                done = [p["expanded"] for p in parts]
            else:
                t2 = time.perf_counter()
                done = [expand(level, 0, turn, scored, rewards, failed)]
                feedback_s += time.perf_counter() - t2
            next_level: list[Node] = []
            for _, parents, branches, prompts in done:
                for (i, j), branch, child_prompts in zip(parents, branches, prompts):
                    level[i].children[j] = first_id + len(level) + len(next_level)
                    next_level.append(Node(
                        tree=level[i].tree, turn=turn + 1, parent=(first_id + i, j), prompts=child_prompts,
                        prompt_history=[branch.prompt_history[a] + [child_prompts[a]] for a in range(n)],
                        response_history=branch.response_history,
                        stream=None if level[i].stream is None else stream_key(level[i].stream, j),
                    ))
            rollout.terminated_per_turn.append(sum(d[0] for d in done))
            rollout.timings["gen_s"] += gen_s
            rollout.timings["reward_s"] += reward_s
            rollout.timings["feedback_s"] += feedback_s
            level = next_level
            if not level:
                break
    finally:
        if worker is not None:
            worker.shutdown(wait=True, cancel_futures=True)
    return rollout


def portable(rollout: Rollout, tree_offset: int) -> Rollout:
    """A process's rollout as rank 0 needs it for metrics and logs: tree ids made global (shard start
    `tree_offset`), completions as text only, no branch histories (less to send)."""
    nodes = [
        replace(node, tree=node.tree + tree_offset, prompt_history=[], response_history=[],
                completions=[[Completion([], c.text, [], c.finished) for c in agent] for agent in node.completions])
        for node in rollout.nodes
    ]
    return replace(rollout, nodes=nodes)


def merge_rollouts(parts: Sequence[Rollout]) -> Rollout:
    """The rollouts of consecutive tree shards (in shard order) as the one rollout a single process
    would have built: nodes turn by turn in tree order, node ids remapped."""
    if len(parts) == 1:
        return parts[0]
    order = sorted(((node.turn, p, i) for p, part in enumerate(parts) for i, node in enumerate(part.nodes)),
                   key=lambda key: key[:2])  # stable: within a part, the part's own (tree) order
    new_id = {(p, i): gid for gid, (_, p, i) in enumerate(order)}
    nodes = []
    for _, p, i in order:
        node = parts[p].nodes[i]
        nodes.append(replace(
            node, parent=None if node.parent is None else (new_id[(p, node.parent[0])], node.parent[1]),
            children=[None if c is None else new_id[(p, c)] for c in node.children]))
    turns = max(len(part.terminated_per_turn) for part in parts)
    return Rollout(
        problems=[problem for part in parts for problem in part.problems],
        nodes=nodes,
        timings={
            key: max(part.timings.get(key, 0.0) for part in parts) for key in parts[0].timings
        },  # the slowest rank
        terminated_per_turn=[
            sum(part.terminated_per_turn[t] for part in parts if t < len(part.terminated_per_turn))
            for t in range(turns)
        ],
        reward_errors=sum(part.reward_errors for part in parts),
        resampled_nodes=sum(part.resampled_nodes for part in parts),
    )


def assign_advantages(nodes: list[Node], discount: float, cross_credit: str, baseline: str, scale: str,
                      group_by: str = "node", team_weight: float = 1.0) -> np.ndarray:
    """Fill node.returns (team), node.agent_returns (per agent: only with per-agent rewards and
    team_weight < 1), node.advantages and node.zero_std; returns the (nodes, N) zero-variance-group mask."""
    children = [node.children for node in nodes]
    returns = tree_returns([node.rewards for node in nodes], children, discount)
    own = agent_rewards_of(nodes, team_weight)
    per_agent: list[np.ndarray | None] = [None] * len(nodes)
    if own is not None:  # every agent's returns flow up the tree from its own rewards
        columns = [tree_returns([o[:, a] for o in own], children, discount) for a in range(own[0].shape[1])]
        per_agent = [np.stack([column[m] for column in columns], axis=1) for m in range(len(nodes))]
    values = []
    for node, g, mine in zip(nodes, returns, per_agent):
        node.returns, node.agent_returns = g, mine
        values.append(
            agent_credit(node.joint, g if mine is None else mine, len(node.completions[0]), cross_credit)
        )  # (N, K)
    pools: dict = {}
    group_key = GROUP_BY.get(group_by)
    for m, node in enumerate(nodes):
        pools.setdefault(group_key(m, node.tree, node.turn), []).append(m)
    for members in pools.values():
        advantages, zero_std = pooled_advantages([values[m] for m in members], baseline, scale)
        for m, adv, zero in zip(members, advantages, zero_std):
            nodes[m].advantages, nodes[m].zero_std = adv, zero
    return np.array([node.zero_std for node in nodes])


def agent_rewards_of(nodes: list[Node], team_weight: float) -> list[np.ndarray] | None:
    """Each node's (J, N) per-agent rewards mixed with the team reward; None (the team reward alone)
    when no node has per-agent rewards or team_weight is 1."""
    if team_weight == 1 or all(node.agent_rewards is None for node in nodes):
        return None
    return [mix_rewards(node.rewards, node.agent_rewards if node.agent_rewards is not None else
                        np.repeat(node.rewards[:, None], len(node.completions), axis=1), team_weight) for node in nodes]
