"""What feedback functions and envs receive besides the texts (issue 31, points 6 and 8): the problem's
fields (dataset columns) and the env's context reach every feedback function, by a documented
precedence; each completion's info (truncated) reaches feedback and a score() that asks for it; a
problem without a "prompt" is a start-up error naming the env."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest

from magrpo.config import ExternalConfig
from magrpo.env import Environment, Scored
from magrpo.errors import EnvError
from magrpo.feedback import options_of
from magrpo.rollout import expand_trees
from tests.fakes import PROBLEMS, SAMPLING, FakeBackend, FakeEnv, serial, sum_of_indices, tree_settings


class Recorder:
    """A feedback function taking **context; keeps a copy of every call's keyword context."""

    def __init__(self):
        self.contexts: list[dict] = []

    def __call__(self, prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent,
                 **context):
        self.contexts.append(copy.deepcopy(context))
        return [f"again {i}" for i in range(num_agents)]


class ContextEnv(FakeEnv):
    """Scores like FakeEnv, puts `context` in every Scored and records the completion_info it gets."""

    def __init__(self, n: int, context: dict | None = None):
        super().__init__(n)
        self.context = context or {}
        self.infos: list = []

    def score(self, problems, joint_completions, completion_info):
        self.infos.extend(completion_info)
        return [Scored(r, {"reward": r}, dict(self.context))
                for r in map(sum_of_indices, problems, joint_completions)]


def expand(env, fn, problems=PROBLEMS, backend=None):
    return expand_trees(problems, env, backend or FakeBackend(), serial(fn, env),
                        tree_settings(num_generations=2, num_turns=2), SAMPLING)


def test_every_feedback_function_receives_the_problems_fields():
    fn = Recorder()
    expand(FakeEnv(2), fn)
    assert len(fn.contexts) == 4  # B = 2 trees x K = 2 expanding joint actions
    assert sorted(c["offset"] for c in fn.contexts) == [0.0, 0.0, 0.25, 0.25]  # PROBLEMS' own column
    assert all("prompt" not in c for c in fn.contexts)  # it is the `prompt` argument already


def test_a_function_without_kwargs_gets_the_columns_it_names():
    seen = []

    def named(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent,
              offset=None):
        seen.append(offset)
        return ["x"] * num_agents

    expand(FakeEnv(2), named)
    assert sorted(seen) == [0.0, 0.0, 0.25, 0.25]


def test_the_envs_context_wins_over_a_column_and_options_over_a_column():
    problems = [{"prompt": "P", "offset": 0.0, "tests": "column", "options": "column", "num_agents": 9,
                 "response_history_per_agent": "column"}]
    fn = Recorder()
    expand(ContextEnv(2, {"tests": "env"}), fn, problems)
    context = fn.contexts[0]
    assert context["tests"] == "env"
    assert context["options"] == options_of(ExternalConfig())  # the external.* switches, not the column
    # a column named like a call argument is not passed again (no "multiple values" TypeError)
    assert "num_agents" not in context and "response_history_per_agent" not in context


def test_the_envs_own_options_still_win():
    fn = Recorder()
    expand(ContextEnv(2, {"options": "mine"}), fn)
    assert fn.contexts[0]["options"] == "mine"


def test_feedback_sees_per_agent_whether_each_completion_was_truncated():
    fn = Recorder()
    expand(FakeEnv(2), fn, backend=FakeBackend(cut=lambda agent, k: agent == 1 and k == 0))
    # align: expanding joint action j holds completion k = j of every agent
    infos = sorted([i["truncated"] for i in c["completion_info"]] for c in fn.contexts)
    assert infos == [[False, False], [False, False], [False, True], [False, True]]


def test_a_score_that_takes_completion_info_gets_one_per_agent_per_joint_action():
    env = ContextEnv(2)
    expand(env, Recorder(), backend=FakeBackend(cut=lambda agent, k: agent == 0 and k == 1))
    # turn 0: 2 nodes x 2 joint actions; turn 1: 4 nodes x 2
    assert len(env.infos) == 4 + 8
    assert [[i.truncated for i in joint] for joint in env.infos[:2]] == [[False, False], [True, False]]


class NoPromptEnv(Environment):
    @dataclass
    class Config:
        pass

    num_agents = 2

    def problems(self, split):
        return [{"prompt": "fine"}, {"question": "Say 1", "answer": "1"}]

    def agent_prompts(self, problem):
        return [problem["question"]] * 2

    def rewards(self, problems, joint_completions):
        return [0.0] * len(joint_completions)


def test_a_problem_without_prompt_is_a_start_up_error_naming_the_env(make_cfg):
    from magrpo.trainer import prepare

    with pytest.raises(EnvError) as caught:
        prepare(make_cfg("eval.at_end=false"), env=NoPromptEnv(NoPromptEnv.Config()))
    message = str(caught.value)
    assert "NoPromptEnv.problems('train') returned problem 1 without a 'prompt' key (it has: question, answer)" in (
        message)
    assert "\n" not in message


def test_the_documented_column_example_runs(tmp_path, monkeypatch):
    doc = (Path(__file__).parent.parent / "docs" / "feedback.md").read_text()
    code = "# hint_feedback.py" + doc.split("```python\n# hint_feedback.py")[1].split("```")[0]
    (tmp_path / "hint_feedback.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    from hint_feedback import hint

    problems = [{"prompt": "Add 2 and 3.", "hint": "count on from 3", "offset": 0.0}]
    rollout = expand(FakeEnv(2), hint, problems, backend=FakeBackend(cut=lambda agent, k: agent == 1 and k == 0))
    first, second = (rollout.nodes[c] for c in rollout.nodes[0].children)  # joint actions k = 0 and k = 1
    assert first.prompts[0].startswith("Add 2 and 3.::agent0") and "Hint: count on from 3" in first.prompts[0]
    assert "cut off" in first.prompts[1] and "cut off" not in first.prompts[0] + "".join(second.prompts)
