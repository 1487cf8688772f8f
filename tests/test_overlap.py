"""generation.overlap_chunks: a turn's parts are scored (and given feedback) in a second thread while
the next part generates, and the rollout is the one the sequential schedule builds."""
from __future__ import annotations

import threading

import pytest
import torch

from magrpo.backends.hf import HFBackend
from magrpo.config import ExternalConfig
from magrpo.envs.length_ratio import LengthRatioEnv
from magrpo.errors import RewardError
from magrpo.external.plain import plain
from magrpo.feedback import Feedback
from magrpo.generation import SamplingParams
from magrpo.models import load_agents
from magrpo.rollout import expand_trees
from tests.fakes import (
    PROBLEMS,
    SAMPLING,
    FakeBackend,
    FakeEnv,
    RecordingFeedback,
    serial,
    sum_of_indices,
    tree_settings,
)
from tests.near_ties import compare_rollouts


def snapshot(rollout) -> list:
    """Everything a rollout holds that training or the logs read."""
    return [(n.tree, n.turn, n.parent, n.prompts, n.children, n.rewards.tolist(), n.terminated.tolist(),
             [[(c.text, c.token_ids) for c in agent] for agent in n.completions]) for n in rollout.nodes]


@pytest.fixture(scope="module")
def agents():
    from tests.conftest import SMALL, compose

    torch.manual_seed(0)  # peft draws the adapters' A at load: the same agents in every process
    return load_agents(compose([*SMALL, "lora.r=4"]), 2)


@pytest.mark.parametrize("settings", [
    dict(joint_mode="align", num_turns=3),
    dict(joint_mode="cross", num_turns=2, early_termination_threshold=0.6),
    dict(joint_mode="align", num_turns=2, resample_zero_std=2),  # feedback waits for dynamic sampling
])
def test_overlapped_rollout_equals_the_sequential_one(agents, settings):
    """Parts decode in smaller batches, which can change the logits' last bits and, where a uniform falls
    on a CDF boundary, a token (tests/near_ties.py): every branch is the sequential one up to such near
    ties, which stay rare. Bit for bit with a backend whose rows do not depend on each other (below)."""
    env = LengthRatioEnv(LengthRatioEnv.Config(num_agents=2))
    problems = env.problems("train")[:5]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)

    def rollout(chunks):
        torch.manual_seed(0)
        return expand_trees(problems, env, HFBackend(agents), Feedback(ExternalConfig(), env, plain),
                            tree_settings(num_generations=2, overlap_chunks=chunks, **settings), params, seed=11)

    sequential = rollout(1)
    for chunks in (2, 3, 8):  # 8 > nodes of turn 0: parts of one node
        overlapped = rollout(chunks)
        equal, compared = compare_rollouts(overlapped, sequential)
        assert equal >= 0.9 * len(sequential.nodes) and compared >= equal
        if equal == len(sequential.nodes):  # no near tie (the usual case): the whole rollout, bit for bit
            assert snapshot(overlapped) == snapshot(sequential)
            assert overlapped.terminated_per_turn == sequential.terminated_per_turn
            assert overlapped.resampled_nodes == sequential.resampled_nodes
        assert "overlap_wait_s" in overlapped.timings


def meet(arrived: threading.Event, other: threading.Event) -> bool:
    """Say this side has arrived, then wait for the other: True only if both were running at once."""
    arrived.set()
    return other.wait(timeout=10)


class MeetingBackend(FakeBackend):
    """The second generate call of a turn waits until the first part's scoring has started."""

    def __init__(self, scoring_started: threading.Event, second_part_started: threading.Event):
        super().__init__()
        self.scoring_started, self.second_part_started = scoring_started, second_part_started
        self.met = []

    def generate(self, requests, params):
        if self.generate_calls == 1:  # the second part of turn 0
            self.met.append(meet(self.second_part_started, self.scoring_started))
        return super().generate(requests, params)


class MeetingEnv(FakeEnv):
    def __init__(self, n, scoring_started, second_part_started):
        super().__init__(n, sum_of_indices)
        self.scoring_started, self.second_part_started = scoring_started, second_part_started
        self.met = []

    def rewards(self, problems, joint_completions):
        if self.reward_calls == 0:  # the first part of turn 0
            self.met.append(meet(self.scoring_started, self.second_part_started))
        return super().rewards(problems, joint_completions)


def test_a_part_is_scored_while_the_next_part_generates():
    """Each side waits for the other: only a concurrent schedule lets both see the other start (a
    sequential one times out after 10 s and records False)."""
    scoring, second = threading.Event(), threading.Event()
    env, backend = MeetingEnv(2, scoring, second), MeetingBackend(scoring, second)
    expand_trees(PROBLEMS, env, backend, serial(RecordingFeedback(), env),
                 tree_settings(num_generations=2, num_turns=2, joint_mode="align", overlap_chunks=2), SAMPLING)
    assert backend.met == [True] and env.met == [True]
    assert backend.generate_calls == 4  # 2 parts x 2 turns


def test_an_error_while_scoring_in_the_worker_thread_reaches_the_caller():
    def reward(problem, texts):
        if problem["prompt"] == "P1":
            raise ValueError("bad problem")
        return 1.0

    env = FakeEnv(2, reward)
    with pytest.raises(RewardError, match="bad problem"):
        expand_trees(PROBLEMS, env, FakeBackend(), serial(RecordingFeedback(), env),
                     tree_settings(num_generations=2, num_turns=2, joint_mode="align", overlap_chunks=2), SAMPLING)


def test_overlap_chunks_below_one_is_a_config_error(make_cfg):
    from magrpo.errors import ConfigError
    from magrpo.validation import validate

    with pytest.raises(ConfigError, match="generation.overlap_chunks"):
        validate(make_cfg("generation.overlap_chunks=0"))


class ProgramBackend(FakeBackend):
    """Real programs for HumanEval/0: sample k of the entry point is right for even k, wrong for odd k,
    so the sandbox runs them from the worker thread and the rewards differ."""

    def generate(self, requests, params):
        from tests.test_code_env import AUX, MAIN, WRONG_MAIN

        out = super().generate(requests, params)
        for request, completions in zip(requests, out):
            for k, c in enumerate(completions):
                c.text = AUX if request.agent == 0 else (MAIN if k % 2 == 0 else WRONG_MAIN)
        return out


def test_code_env_sandbox_and_level_feedback_give_the_same_rollout_from_the_worker_thread(monkeypatch):
    from magrpo.envs.code.env import CodeEnv
    from magrpo.external.levels import level_feedback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = CodeEnv(CodeEnv.Config(train_split="test[:1]", eval_split="test[1:2]"))
    problems = env.problems("train") * 3

    def rollout(chunks):
        return expand_trees(problems, env, ProgramBackend(), Feedback(ExternalConfig(), env, level_feedback),
                            tree_settings(num_generations=2, num_turns=2, joint_mode="cross", overlap_chunks=chunks),
                            SAMPLING)

    sequential, overlapped = rollout(1), rollout(3)
    assert snapshot(overlapped) == snapshot(sequential)
    assert [n.prompts for n in overlapped.nodes] == [n.prompts for n in sequential.nodes]
    assert {r for n in sequential.nodes for r in n.rewards.tolist()} >= {4.0}  # the right program passed
    assert len({r for n in sequential.nodes for r in n.rewards.tolist()}) > 1
