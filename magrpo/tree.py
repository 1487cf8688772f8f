"""Rollout-tree data and joint-action formation: plain data, no model.

A tree has one root node per problem. At a node every agent has K completions; joint actions
combine one completion per agent (align: the k-th of each, K of them; cross: the Cartesian
product, K^N). Each joint action that is not a leaf owns one child node at the next turn.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import BEFORE_RUN, RESUMABLE
from .registry import Registry

JOINT_MODES: Registry = Registry("joint mode")


@JOINT_MODES.register("align")
def align_joint_actions(k: int, n: int) -> np.ndarray:
    """(K, N): joint action j takes completion j of every agent."""
    return np.repeat(np.arange(k)[:, None], n, axis=1)


@JOINT_MODES.register("cross")
def cross_joint_actions(k: int, n: int) -> np.ndarray:
    """(K^N, N): every tuple of one completion per agent, in lexicographic order."""
    return np.array(list(itertools.product(range(k), repeat=n)), dtype=np.int64).reshape(-1, n)


def joint_actions(mode: str, k: int, n: int, timeout_s: float = 0, tail: str = RESUMABLE) -> np.ndarray:
    """The (J, N) joint actions of `mode`; a plugin's mode runs under limits.user_code_timeout_s (`timeout_s`)."""
    return JOINT_MODES.hook(mode, timeout_s, tail)(k, n)


def tree_size(mode: str, k: int, n: int, num_turns: int, expand: str = "all",
              timeout_s: float = 0) -> tuple[int, int]:
    """(nodes, completions) of one tree when no branch stops early: J joint actions per node
    (align K, cross K^N), of which C = J (expand all) or min(J, M) (top:M, random:M) get a child,
    make C^t nodes at turn t, and every node samples K completions per agent."""
    rule, m = parse_expand(expand)
    per_node = len(joint_actions(mode, k, n, timeout_s, BEFORE_RUN))  # sizes are checked at start-up
    children = per_node if rule == "all" else min(per_node, m)
    nodes = sum(children ** t for t in range(num_turns))
    return nodes, nodes * n * k


EXPAND_RULES = ("all", "top:M", "random:M")


def parse_expand(rule: str) -> tuple[str, int]:
    """"all" -> ("all", 0); "top:M" / "random:M" -> (name, M) with M >= 1; else ValueError."""
    if rule == "all":
        return "all", 0
    name, _, count = str(rule).partition(":")
    if name in ("top", "random") and count.isdigit() and int(count) >= 1:
        return name, int(count)
    raise ValueError(f"{rule!r} is not an expansion rule; choose one of: {', '.join(EXPAND_RULES)} (M >= 1)")


def expanded(rewards: np.ndarray, stopped: np.ndarray, rule: str,
             draw_key: Callable[[int], int] | None = None) -> np.ndarray:
    """(J,) bool: the joint actions of a node that get a child. Stopped ones (turn limit, early
    termination, the env's done, truncation, a failed score) never do; of the rest, all, the M
    with the highest reward (ties: the lower index), or M at random: those with the smallest
    `draw_key(j)` (a hash per joint action, so the choice does not depend on the rest of the batch;
    called for random:M only)."""
    name, m = parse_expand(rule)
    candidates = [j for j in range(len(rewards)) if not stopped[j]]
    if name == "top":
        candidates = sorted(candidates, key=lambda j: (-rewards[j], j))[:m]
    elif name == "random":
        key = draw_key or np.random.permutation(len(rewards)).__getitem__  # unseeded: the global RNG
        candidates = sorted(candidates, key=key)[:m]
    out = np.zeros(len(rewards), dtype=bool)
    out[candidates] = True
    return out


@dataclass
class Completion:
    """One sampled completion: the generated token ids are the source of truth for the loss.

    A turn with tools (issue 31) interleaves model segments with inserted ones (a tool's output):
    `model_mask` marks the tokens the model sampled; inserted tokens stay in the sequence (later
    tokens attend to them) but never enter the loss, KL, entropy or importance weights. `logprobs`
    holds one sampling log-prob per *model* token, in order: inserted tokens were never sampled.
    """

    token_ids: list[int]
    text: str
    prompt_ids: list[int]  # the prompt as the model saw it (shared by the K samples of a request)
    finished: bool  # ended with EOS (False: cut at max_new_tokens)
    logprobs: list[float] | None = None  # sampling log-probs of the model tokens, when the backend returns them
    model_mask: list[bool] | None = None  # per token: sampled by the model (None: every token)
    tool_calls: list[dict] = field(default_factory=list)  # per call made in the turn: name, arguments, output,
    # error (an ERROR_KINDS entry or None), seconds and inserted (its result spliced in; magrpo.tool_loop)

    def __post_init__(self) -> None:
        check_model_mask(self.token_ids, self.model_mask, self.logprobs)

    @classmethod
    def from_segments(cls, segments: list[tuple[list[int], bool]], text: str, prompt_ids: list[int], finished: bool,
                      logprobs: list[float] | None = None, tool_calls: list[dict] | None = None) -> "Completion":
        """A turn built from (token ids, sampled by the model) segments in order, e.g. model text, a
        tool's output, model text again; `logprobs` covers the model segments only."""
        token_ids = [t for ids, _ in segments for t in ids]
        mask = [model for ids, model in segments for _ in ids]
        return cls(token_ids, text, prompt_ids, finished, logprobs, None if all(mask) else mask, tool_calls or [])


def check_model_mask(token_ids: list[int], model_mask: list[bool] | None, logprobs: list[float] | None) -> None:
    """ValueError unless the mask has one entry per token and the log-probs one per model token: a
    misaligned mask would silently train on a tool's output."""
    if model_mask is not None and len(model_mask) != len(token_ids):
        raise ValueError(f"model_mask has {len(model_mask)} entries for {len(token_ids)} tokens")
    if model_mask is not None and logprobs is not None and len(logprobs) != sum(model_mask):
        raise ValueError(f"{len(logprobs)} sampling log-probs for {sum(model_mask)} model tokens")


@dataclass
class Node:
    tree: int  # index of the problem in the step's batch
    turn: int
    parent: tuple[int, int] | None  # (parent node id, joint action index) or None at the root
    prompts: list[str]  # one per agent
    prompt_history: list[list[str]]  # per agent, this branch's prompts up to and including this turn
    response_history: list[list[str]]  # per agent, this branch's chosen completions before this turn
    completions: list[list[Completion]] = field(default_factory=list)  # [agent][k]
    joint: np.ndarray | None = None  # (J, N) completion index per agent
    rewards: np.ndarray | None = None  # (J,) the team reward
    agent_rewards: np.ndarray | None = None  # (J, N) each agent's own reward, when the env gives them
    outcomes: list[dict[str, float]] = field(default_factory=list)  # (J,) the env's named numbers
    terminated: np.ndarray | None = None  # (J,) bool: stopped before the turn limit (any reason below, a failed score)
    done: np.ndarray | None = None  # (J,) bool: of those, the env ended the episode (Scored.done)
    truncated: np.ndarray | None = None  # (J,) bool: of those, trainer.stop_on_truncation (a chosen completion was cut)
    early: np.ndarray | None = None  # (J,) bool: of those, stopped by early termination alone (the threshold)
    children: list[int | None] = field(default_factory=list)  # (J,) child node id or None (leaf)
    returns: np.ndarray | None = None  # (J,) from the team rewards
    agent_returns: np.ndarray | None = None  # (J, N) from each agent's mixed rewards (reward.team_weight < 1)
    advantages: np.ndarray | None = None  # (N, K)
    zero_std: np.ndarray | None = None  # (N,) bool: the agent's group at this node had no reward variance
    stream: int | None = None  # random-stream key of this node (from the run seed, step, tree and path)
    continuation: list[tuple[int, ...]] = field(default_factory=list)  # per agent, in a conversation
    # (external.history=messages | continuation): prompt ids after the encoded first prompt; empty otherwise
    chat: list[list[dict]] = field(default_factory=list)  # per agent, with history=messages: the chat through
    # this node's prompt, as messages (the full-render check renders it); empty otherwise


def count_leaves(nodes: list[Node]) -> int:
    """Joint actions with no child: finished by the turn limit, early termination, the env's done,
    truncation (trainer.stop_on_truncation), a failed score or trainer.expand."""
    return sum(sum(c is None for c in node.children) for node in nodes)
