"""Tree expansion: turn by turn, every active node of every tree of the batch is generated in one
backend call, scored in one env call, and expanded through one feedback call.

With `overlap_chunks` > 1 a turn's nodes are generated in that many backend calls, and each part is
scored (and, without dynamic sampling, given its feedback) in a second thread while the next part
generates: slow scoring or feedback (sandbox timeouts, an expert over HTTP) hides behind decoding.
Every sample comes from its own random stream and every score and feedback is per node, so the
rollout is the sequential one (up to a near tie that a smaller decode batch rounds otherwise)."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .advantage import all_groups_flat, own_values
from .backends import GenerationBackend
from .conversation import first_chat
from .env import CompletionInfo, Environment, Scored, call_env
from .errors import RewardError, TimedOut, describe, qualified_name, timed_out, within
from .feedback import Branch, accepted
from .generation import GenerationRequest, SamplingParams, StopStrings
from .sampling import stream_key
from .tree import Node, expanded, joint_actions

if TYPE_CHECKING:  # the rollout stays model-free; a Conversation comes from the trainer
    from .conversation import Conversation


@dataclass(frozen=True)
class TreeSettings:
    """How one step's trees grow (trainer.*, reward.* and generation.overlap_chunks; every default lives
    in magrpo.config)."""

    num_generations: int
    num_turns: int
    joint_mode: str
    early_termination_threshold: float | None
    stop_on_truncation: bool  # a joint action with any chosen completion cut at max_new_tokens gets no child
    on_reward_error: str  # raise | zero (the joint action scores 0 and gets no child)
    expand: str  # all | top:M | random:M: which joint actions of a node get a child (tree.expanded)
    resample_zero_std: int  # regenerate a node whose agent groups all got equal rewards, up to this many times
    cross_credit: str  # how a completion is credited when checking its group for zero variance
    team_weight: float  # with per-agent rewards: each agent's value = w x team + (1 - w) x its own
    overlap_chunks: int  # a turn's nodes in this many backend calls, scored while the next part generates
    stop: StopStrings  # each agent's stop strings (generation.stop, agents[i].stop): its requests carry them
    user_code_timeout_s: float  # seconds one call of user code may take (limits.user_code_timeout_s; 0: no limit)

    @classmethod
    def of(cls, cfg: Any) -> "TreeSettings":
        """From a TrainConfig."""
        trainer = cfg.trainer
        return cls(num_generations=trainer.num_generations, num_turns=trainer.num_turns,
                   joint_mode=trainer.joint_mode, early_termination_threshold=trainer.early_termination_threshold,
                   stop_on_truncation=trainer.stop_on_truncation, on_reward_error=cfg.reward.on_error,
                   expand=trainer.expand,
                   resample_zero_std=trainer.resample_zero_std, cross_credit=trainer.cross_credit,
                   team_weight=cfg.reward.team_weight, overlap_chunks=cfg.generation.overlap_chunks,
                   stop=StopStrings.of(cfg), user_code_timeout_s=cfg.limits.user_code_timeout_s)


EXPAND_DRAWS = 0x45585044  # a stream domain of its own for random:M (never a sampling stream's key)
RESAMPLE_DRAWS = 0x52534D50  # the same for the regenerated samples of dynamic sampling


def score_guarded(
    env: Environment, owners: list, texts: list, infos: list[list[CompletionInfo]], on_error: str, turn: int,
    timeout_s: float = 0,
) -> tuple[list[Scored], list[bool]]:
    """env.score over a whole turn; on failure, each joint action alone, to name (raise) or zero the bad ones.
    `infos` (per joint action, per agent) reach a score() that takes a `completion_info` keyword. A call that
    runs past `timeout_s` (0: no limit) stops the run (TimedOut), whatever reward.on_error says."""
    takes = accepted(env.score)

    def score(*args, **kwargs) -> list[Scored]:
        late = lambda: timed_out(f"env {type(env).__name__} ({scoring_method(env)})", f" scoring turn {turn}",  # noqa: E731
                                 timeout_s)
        return within(timeout_s, late, env.score, *args, **kwargs)

    try:
        scored = score(owners, texts, **takes({"completion_info": infos}))
        if all(bad_score(s, len(t)) is None for s, t in zip(scored, texts)):
            if len(scored) != len(texts):  # the env's bug, not one joint action's: no retry one by one
                raise RewardError(f"env {type(env).__name__} ({scoring_method(env)}) returned {len(scored)} "
                                  f"score(s) for {len(texts)} joint actions of turn {turn}; return one per joint "
                                  f"action, in order")
            return scored, [False] * len(scored)
    except (RewardError, TimedOut):
        raise
    except Exception:  # noqa: BLE001  (any env error: find the joint action that caused it)
        pass
    out, failed = [], []
    for i, (owner, joint_texts) in enumerate(zip(owners, texts)):
        try:
            (one,) = score([owner], [joint_texts], **takes({"completion_info": [infos[i]]}))
            error = bad_score(one, len(joint_texts))
        except TimedOut:
            raise
        except Exception as e:  # noqa: BLE001
            error = describe(e)
        if error is not None and on_error == "raise":
            problem = problem_name(owner)
            raise RewardError(
                f"env {type(env).__name__} ({scoring_method(env)}) failed on joint action {i} "
                f"of turn {turn} (problem {problem!r}, "
                f"completions {[t[:40] for t in joint_texts]}): {error}; set reward.on_error=zero to score it 0"
            )
        out.append(one if error is None else Scored(0.0, {"reward": 0.0}))
        failed.append(error is not None)
    return out, failed


def scoring_method(env: Environment) -> str:
    """The env's own method that scores: score, or the outcomes / rewards the default score calls."""
    own = next((m for m in ("score", "outcomes", "rewards") if getattr(type(env), m) is not getattr(Environment, m)),
               "score")
    return qualified_name(getattr(type(env), own))


def bad_score(scored: Scored, num_agents: int) -> str | None:
    """Why a score cannot be used (a non-finite reward, per-agent rewards that are not one finite
    number per agent, a done that is not a bool or None), or None."""
    if not np.isfinite(scored.reward):
        return f"non-finite reward {scored.reward}"
    if scored.done is not None and not isinstance(scored.done, (bool, np.bool_)):
        return f"done must be True, False or None, got {scored.done!r}"
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


@dataclass
class TurnScores:
    """The scores of a run of one turn's nodes (phase 2): per joint action, node-major."""

    scored: list[Scored]
    rewards: np.ndarray  # (nodes, J)
    failed: np.ndarray  # (nodes, J): the env could not score it (reward.on_error=zero): a leaf

    @staticmethod
    def joined(parts: Sequence["TurnScores"]) -> "TurnScores":
        return TurnScores([s for p in parts for s in p.scored], np.concatenate([p.rewards for p in parts]),
                          np.concatenate([p.failed for p in parts]))

    def with_rows(self, rows: Sequence[int], again: "TurnScores") -> "TurnScores":
        """These scores with the nodes `rows` scored anew (`again`, one row per node of `rows`)."""
        width = self.rewards.shape[1]
        scored, rewards, failed = list(self.scored), self.rewards.copy(), self.failed.copy()
        for row, i in enumerate(rows):
            scored[i * width : (i + 1) * width] = again.scored[row * width : (row + 1) * width]
            rewards[i], failed[i] = again.rewards[row], again.failed[row]
        return TurnScores(scored, rewards, failed)


@dataclass
class Branching:
    """The joint actions of a run of nodes that get a child (phase 4), with the next-turn prompts the
    feedback wrote for them."""

    terminated: int  # joint actions stopped before the turn limit (early termination, done, truncation, failed score)
    parents: list[tuple[int, int]]  # per branch: (index of its node in the turn's level, joint action)
    branches: list[Branch]
    prompts: list[list[str]]  # per branch: one next-turn prompt per agent


class TreeExpander:
    """Builds one step's trees, turn by turn. Each turn runs five phases over every active node:
    1. generate: one backend call for every agent of every node (K samples each);
    2. score: one env call for every joint action;
    3. resample (trainer.resample_zero_std): regenerate nodes whose every agent group scored flat;
    4. branch: rewards onto the nodes; joint actions neither at the turn limit nor stopped become
       branches, and one feedback call writes their next-turn prompts;
    5. grow: one child node per branch: the next turn's level.
    With overlap_chunks > 1, phases 1-2 (and 4, unless resampling must see the whole turn first) run
    part by part, each part scored in a worker thread while the next part generates."""

    def __init__(self, problems: Sequence[Mapping[str, Any]], env: Environment, backend: GenerationBackend,
                 feedback: Callable[[list[Branch]], list[list[str]]], tree: TreeSettings, sampling: SamplingParams,
                 seed: int | None = None, tree_offset: int = 0, conversation: Conversation | None = None,
                 on_turn: Callable[[int], None] | None = None):
        self.problems, self.env, self.backend, self.feedback = problems, env, backend, feedback
        self.conversation, self.on_turn = conversation, on_turn
        self.tree, self.sampling, self.seed, self.tree_offset = tree, sampling, seed, tree_offset
        self.n, self.k = env.num_agents, tree.num_generations
        self.joint = joint_actions(tree.joint_mode, self.k, self.n, tree.user_code_timeout_s)
        self.early_feedback = tree.resample_zero_std == 0  # dynamic sampling rescores before anything branches
        self.rollout = Rollout(problems=problems, nodes=[], timings={"gen_s": 0.0, "reward_s": 0.0, "feedback_s": 0.0})

    def run(self) -> Rollout:
        level = self.roots()
        with self.worker() as worker:
            for turn in range(self.tree.num_turns):
                first_id = len(self.rollout.nodes)
                self.rollout.nodes.extend(level)
                scores, branchings = self.generate_and_score(level, turn, worker)    # phases 1-2 (and 4)
                scores = self.resample(level, turn, scores)                          # phase 3
                self.rollout.reward_errors += int(scores.failed.sum())
                if branchings is None:
                    branchings = [self.branch(level, 0, turn, scores)]               # phase 4
                self.rollout.terminated_per_turn.append(sum(b.terminated for b in branchings))
                level = self.grow(level, first_id, turn, branchings)                 # phase 5
                if self.on_turn is not None:  # progress: a step or an evaluation can take minutes
                    self.on_turn(turn)
                if not level:
                    break
        return self.rollout

    def roots(self) -> list[Node]:
        """Turn 0: one node per problem, with the env's prompt for each agent."""
        nodes = []
        for b, problem in enumerate(self.problems):
            where = f"at turn 0 (problem {problem_name(problem)!r})"
            prompts = call_env(self.env, "agent_prompts", problem, where=where, timeout_s=self.tree.user_code_timeout_s)
            nodes.append(Node(tree=b, turn=0, parent=None, prompts=prompts, prompt_history=[[p] for p in prompts],
                              response_history=[[] for _ in range(self.n)],
                              stream=None if self.seed is None else stream_key(self.seed, self.tree_offset + b)))
        return nodes

    @contextmanager
    def worker(self) -> Iterator[ThreadPoolExecutor | None]:
        """The thread that scores a part while the next one generates (overlap_chunks > 1), else None."""
        if self.tree.overlap_chunks <= 1:
            yield None
            return
        worker = ThreadPoolExecutor(1, thread_name_prefix="magrpo-score")
        self.rollout.timings["overlap_wait_s"] = 0.0
        try:
            yield worker
        finally:
            worker.shutdown(wait=True, cancel_futures=True)

    def generate_and_score(self, level: list[Node], turn: int, worker: ThreadPoolExecutor | None
                           ) -> tuple[TurnScores, list[Branching] | None]:
        """Phases 1-2 part by part (one part unless overlap_chunks > 1), and phase 4 with them when
        feedback need not wait for resampling (else None)."""
        size = -(-len(level) // max(1, self.tree.overlap_chunks))
        pending: list[Future] = []
        for first in range(0, len(level), size):
            part = level[first : first + size]
            self.generate(part)
            job = partial(self.score_and_branch, part, first, turn)
            # in this thread, run now: an error stops the turn before the next part generates
            pending.append(_finished(job()) if worker is None else worker.submit(job))
        t0 = time.perf_counter()
        done = [future.result() for future in pending]
        if worker is not None:
            self.rollout.timings["overlap_wait_s"] += time.perf_counter() - t0
        branchings = [b for _, b in done] if self.early_feedback else None
        return TurnScores.joined([s for s, _ in done]), branchings

    def score_and_branch(self, part: list[Node], first: int, turn: int) -> tuple[TurnScores, Branching | None]:
        scores = self.score(part, turn)
        return scores, (self.branch(part, first, turn, scores) if self.early_feedback else None)

    def generate(self, nodes: list[Node], attempt: int = 0) -> None:
        """Phase 1: K samples for every agent of every node, in one backend call. Sample k of agent a
        draws from stream (node, a, k); attempt > 0 (resampling) from streams of its own."""
        t0 = time.perf_counter()
        contexts = [call_env(self.env, "tool_context", self.problems[node.tree], where=f"at turn {node.turn}",
                             timeout_s=self.tree.user_code_timeout_s)
                    for node in nodes]  # the problem as the turn's tools see it (magrpo.tools.ToolContext)
        requests = [self.request(node, a, attempt, context) for node, context in zip(nodes, contexts)
                    for a in range(self.n)]
        samples = self.backend.generate(requests, self.sampling)
        for i, node in enumerate(nodes):
            node.completions, node.joint = samples[i * self.n : (i + 1) * self.n], self.joint
        self.rollout.timings["gen_s"] += time.perf_counter() - t0

    def scored_texts(self, node: Node) -> list[list[str]]:
        """[agent][k]: what the env scores of each completion: the completion, or with
        external.history=continuation the whole reply it continues (its earlier fragments and the feedback
        inserted between them, as the model read them): the reply is the agent's answer, and a fragment
        alone ("the code above is right") may hold none of it."""
        whole = self.conversation is not None and self.conversation.mode == "continuation"
        out = []
        for agent, samples in enumerate(node.completions):
            replies, prompts = node.response_history[agent], node.prompt_history[agent]
            before = "".join(f"{reply}\n\n{feedback}\n\n" for reply, feedback in zip(replies, prompts[1:])) \
                if whole else ""
            out.append([before + c.text for c in samples])
        return out

    def request(self, node: Node, agent: int, attempt: int, context: Any = None) -> GenerationRequest:
        """In a conversation the prompt is the first one, and the chat so far its continuation."""
        stream, stop = self.stream(node, agent, attempt), self.tree.stop.of_agent(agent)
        if node.continuation:
            return GenerationRequest(node.prompt_history[agent][0], agent, self.k, stream,
                                     continuation=node.continuation[agent], stop=stop, context=context)
        return GenerationRequest(node.prompts[agent], agent, self.k, stream, stop=stop, context=context)

    @staticmethod
    def stream(node: Node, agent: int, attempt: int) -> int | None:
        if node.stream is None:
            return None
        if attempt == 0:
            return stream_key(node.stream, agent)
        return stream_key(node.stream, RESAMPLE_DRAWS, attempt, agent)

    def score(self, nodes: list[Node], turn: int) -> TurnScores:
        """Phase 2: one env call for every joint action of `nodes`. Sets each node's (J, N) per-agent
        rewards (None when the env gave none; a joint action without them gives every agent the team's)."""
        t0 = time.perf_counter()
        n, joint = self.n, self.joint
        texts = [[scored[a][j[a]] for a in range(n)] for scored in map(self.scored_texts, nodes) for j in joint]
        infos = [self.completion_info(node, j) for node in nodes for j in range(len(joint))]
        owners = [self.problems[node.tree] for node in nodes for _ in joint]
        scored, failed = score_guarded(self.env, owners, texts, infos, self.tree.on_reward_error, turn,
                                       self.tree.user_code_timeout_s)
        shape = (len(nodes), len(joint))
        rewards = np.asarray([s.reward for s in scored], dtype=np.float64).reshape(shape)
        own = None
        if any(s.agent_rewards is not None for s in scored):
            own = np.asarray([s.agent_rewards if s.agent_rewards is not None else [s.reward] * n for s in scored],
                             dtype=np.float64).reshape(*shape, n)
        for i, node in enumerate(nodes):
            node.agent_rewards = None if own is None else own[i]
        self.rollout.timings["reward_s"] += time.perf_counter() - t0
        return TurnScores(scored, rewards, np.asarray(failed, dtype=bool).reshape(shape))

    def completion_info(self, node: Node, j: int) -> list[CompletionInfo]:
        """What the env and feedback see of joint action j's completions besides their texts, per agent."""
        chosen = [node.completions[a][self.joint[j][a]] for a in range(self.n)]
        return [CompletionInfo(truncated=not c.finished, tool_calls=list(c.tool_calls)) for c in chosen]

    def resample(self, level: list[Node], turn: int, scores: TurnScores) -> TurnScores:
        """Phase 3 (dynamic sampling): regenerate and rescore the nodes whose every agent group got equal
        rewards, up to trainer.resample_zero_std times; returns the turn's scores with theirs replaced."""
        tree = self.tree
        for attempt in range(1, tree.resample_zero_std + 1):
            flat = [i for i, node in enumerate(level) if all_groups_flat(
                self.joint, own_values(scores.rewards[i], node.agent_rewards, tree.team_weight), self.k,
                tree.cross_credit, tree.user_code_timeout_s)]
            if not flat:
                break
            again = [level[i] for i in flat]
            self.generate(again, attempt)
            scores = scores.with_rows(flat, self.score(again, turn))
            self.rollout.resampled_nodes += len(flat)
        return scores

    def branch(self, nodes: list[Node], first: int, turn: int, scores: TurnScores) -> Branching:
        """Phase 4 for `nodes` (level[first:...]): rewards and stops onto the nodes; the joint actions
        that neither reached the turn limit nor stopped, and that trainer.expand keeps, become branches,
        sent through one feedback call."""
        t0 = time.perf_counter()
        tree, width, last = self.tree, len(self.joint), turn == self.tree.num_turns - 1
        out = Branching(0, [], [], [])
        for i, node in enumerate(nodes):
            node.rewards = scores.rewards[i]
            node.outcomes = [s.outcomes for s in scores.scored[i * width : (i + 1) * width]]
            done = np.array([bool(s.done) for s in scores.scored[i * width : (i + 1) * width]])
            truncated = np.array([tree.stop_on_truncation and any(c.truncated for c in self.completion_info(node, j))
                                  for j in range(width)])
            stop = scores.failed[i] | done | truncated
            early = np.zeros(width, dtype=bool)
            if tree.early_termination_threshold is not None:
                early = (node.rewards >= tree.early_termination_threshold) & ~stop
                stop = stop | early
            # at the turn limit every joint action is a leaf anyway: nothing stopped it early
            if last:
                stop, done, truncated, early = (np.zeros(width, dtype=bool) for _ in range(4))
            node.terminated, node.done, node.truncated, node.early = stop, done, truncated, early
            out.terminated += int(node.terminated.sum())
            node.children = [None] * width
            if last:
                continue
            draw = None if node.stream is None else partial(stream_key, node.stream, EXPAND_DRAWS)
            grows = expanded(node.rewards, stop, tree.expand, draw)  # the rest are leaves (G = r)
            for j in np.flatnonzero(grows).tolist():
                out.branches.append(self.branch_of(node, j, scores.scored[i * width + j].context))
                out.parents.append((first + i, j))
        if out.branches:
            out.prompts = self.feedback(out.branches)
        self.rollout.timings["feedback_s"] += time.perf_counter() - t0
        return out

    def branch_of(self, node: Node, j: int, context: Mapping[str, Any]) -> Branch:
        """What the feedback sees of joint action j of `node`: its texts, both histories, the env's context,
        the problem's fields and each completion's info."""
        chosen = [node.completions[a][self.joint[j][a]].text for a in range(self.n)]
        problem = self.problems[node.tree]
        return Branch(prompt=problem["prompt"], agent_completions=chosen,
                      prompt_history=[list(h) for h in node.prompt_history],
                      response_history=[node.response_history[a] + [chosen[a]] for a in range(self.n)],
                      context=context, problem=problem, completion_info=self.completion_info(node, j))

    def grow(self, level: list[Node], first_id: int, turn: int, branchings: list[Branching]) -> list[Node]:
        """Phase 5: one child per branch, with the feedback's prompts; returns the next turn's level."""
        children: list[Node] = []
        for branching in branchings:
            for (i, j), branch, prompts in zip(branching.parents, branching.branches, branching.prompts):
                parent = level[i]
                parent.children[j] = first_id + len(level) + len(children)
                history = [branch.prompt_history[a] + [prompts[a]] for a in range(self.n)]
                children.append(Node(
                    tree=parent.tree, turn=turn + 1, parent=(first_id + i, j), prompts=prompts,
                    prompt_history=history, response_history=branch.response_history,
                    stream=None if parent.stream is None else stream_key(parent.stream, j),
                    **self.continued(parent, j, history),
                ))
        return children

    def continued(self, parent: Node, j: int, history: list[list[str]]) -> dict:
        """The child's `continuation` and `chat` per agent (a conversation), else nothing: its prompts say it all."""
        if self.conversation is None:
            return {}
        conversation = self.conversation
        chats = parent.chat or [first_chat(conversation.agents[a], history[a][0]) if conversation.mode == "messages"
                                else [] for a in range(self.n)]
        grown = [conversation.extend(a, parent.continuation[a] if parent.continuation else (),
                                     parent.completions[a][self.joint[j][a]], history[a][-1], chats[a])
                 for a in range(self.n)]
        return {"continuation": [ids for ids, _ in grown], "chat": [chat for _, chat in grown]}


def expand_trees(
    problems: Sequence[Mapping[str, Any]],
    env: Environment,
    backend: GenerationBackend,
    feedback: Callable[[list[Branch]], list[list[str]]],
    tree: TreeSettings,
    sampling: SamplingParams,
    seed: int | None = None,
    tree_offset: int = 0,
    conversation: Conversation | None = None,
    on_turn: Callable[[int], None] | None = None,
) -> Rollout:
    """One step's trees for `problems` (TreeExpander). `feedback(branches) -> next-turn prompts per
    branch` (a magrpo.feedback.Feedback); `on_turn(turn)` after each turn (progress).

    With a `seed`, every node's samples come from random streams keyed by (seed, tree_offset + tree
    index, path of joint actions from the root, agent, sample): a tree draws the same random numbers
    whatever else is in the batch, e.g. when a data-parallel run gives this process the trees from
    `tree_offset` on (its tokens can still differ at a near tie where the batch rounds its logits
    otherwise: docs/long-runs.md, Reproducibility)."""
    return TreeExpander(problems, env, backend, feedback, tree, sampling, seed, tree_offset, conversation,
                        on_turn).run()


def portable(rollout: Rollout, tree_offset: int) -> Rollout:
    """A process's rollout as rank 0 needs it for metrics and logs: tree ids made global (shard start
    `tree_offset`), completions without their log-probs, no branch histories or chats (less to send).
    Their ids, loss masks and tool calls stay: rollouts.jsonl records them and the tool metrics count them."""
    nodes = [
        replace(node, tree=node.tree + tree_offset, prompt_history=[], response_history=[], continuation=[], chat=[],
                completions=[[replace(c, logprobs=None) for c in agent] for agent in node.completions])
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
