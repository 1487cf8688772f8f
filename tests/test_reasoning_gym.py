"""env=reasoning_gym (envs/reasoning/): it loads offline, its reward is the task's own `score_answer`,
the train and held-out splits never share a question, its roles and feedback (verdicts, never the
answer), every bad task or task config is one line before any model loads, and a short run trains."""
from __future__ import annotations

import json
import sys

import pytest

from magrpo.config import ExternalConfig
from magrpo.env import CompletionInfo
from magrpo.errors import ConfigError
from magrpo.feedback import Branch, Feedback
from tests.conftest import ROOT

# A task of 81 questions (a + b, one digit each): draws from two seeds share many of them.
SMALL_TASK = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_negation": False,
              "allow_parentheses": False}


@pytest.fixture(scope="module")
def rg():
    return pytest.importorskip("reasoning_gym", reason="the extra reasoning-gym is not installed")


def make_env(rg, **config):
    from magrpo.envs.reasoning.env import ReasoningGymEnv

    return ReasoningGymEnv(ReasoningGymEnv.Config(**{"train_size": 8, "eval_size": 4, **config}))


def test_the_env_loads_offline_with_the_answer_format_and_roles_in_its_prompts(rg):
    env = make_env(rg, num_agents=3)  # conftest.py fails a test that tries the network
    problems = env.problems("train")
    assert len(problems) == 8 and len(env.problems("eval")) == 4
    problem = problems[0]
    assert problem["metadata"]["source_dataset"] == "basic_arithmetic" and problem["answer"]
    solver, _, checker = env.agent_prompts(problem)
    for prompt in (solver, checker):
        assert prompt.startswith(rg.utils.SYSTEM_PROMPTS["default"].strip()) and "<answer>" in prompt
        assert prompt.endswith(f"Question: {problem['prompt']}")
    assert "You are agent 0 of 3, a solver" in solver and "You are agent 2 of 3, the checker" in checker
    assert env.tool_context(problem) == {"id": problem["id"], "prompt": problem["prompt"]}  # no answer


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum", "spell_backward"])
def test_rewards_are_the_librarys_score_answer_on_right_wrong_and_malformed_answers(rg, task):
    env = make_env(rg, task=task, num_agents=1)
    score_answer = rg.get_score_answer_fn(task)  # the library's own verifier, not the env's instance
    for problem in env.problems("train")[:4]:
        answer = problem["answer"]
        texts = {
            "right": f"Let me think.\n<answer>{answer}</answer>",
            "last tag counts": f"<answer>x</answer> no, <answer>{answer}</answer>",
            "wrong": "<answer>definitely not it</answer>",
            "extra text in the tags": f"<answer>{answer} is my answer</answer>",
            "no tags": answer,
            "unclosed tag": f"<answer>{answer}",
            "empty tags": "<answer></answer>",
        }
        rewards = dict(zip(texts, [s.reward for s in env.score([problem] * len(texts), [[t] for t in texts.values()])]))
        entry = {"question": problem["prompt"], "answer": answer, "metadata": problem["metadata"]}
        assert rewards == {k: score_answer(rg.utils.extract_answer(t), entry) for k, t in texts.items()}
        assert rewards["right"] == rewards["last tag counts"] == 1.0
        assert rewards["wrong"] < 1.0  # spell_backward pays part of a point for a near miss
        assert rewards["no tags"] == rewards["unclosed tag"] == rewards["empty tags"] == 0.0


def test_tag_or_last_number_reads_an_untagged_replys_last_number_and_a_tag_first(rg):
    """SmolLM2-135M writes no <answer> tags (docs/results/reasoning_sizing.md): with tags only, every reply
    scores 0; env.answer_reading=tag_or_last_number reads the tag, else the last number."""
    lenient, strict = (make_env(rg, task="chain_sum", num_agents=1, answer_reading=how)
                       for how in ("tag_or_last_number", "tags"))
    problem = lenient.problems("train")[0]
    answer = int(problem["answer"])
    texts = [f"Adding them gives {answer}.", f"{answer} or maybe {answer + 1}",
             f"<answer>{answer}</answer> not {answer + 1}", "no number here"]
    assert [s.reward for s in lenient.score([problem] * 4, [[t] for t in texts])] == [1.0, 0.0, 1.0, 0.0]
    assert [s.reward for s in strict.score([problem] * 4, [[t] for t in texts])] == [0.0, 0.0, 1.0, 0.0]
    assert lenient.score([problem], [["no number here"]])[0].context["answers"] == [None]


def test_the_team_reward_is_the_checkers_and_each_agent_has_its_own(rg):
    env = make_env(rg, num_agents=3)
    problem = env.problems("train")[0]
    right, wrong = f"<answer>{problem['answer']}</answer>", "<answer>nope</answer>"
    scored = env.score([problem] * 2, [[right, wrong, wrong], [wrong, wrong, right]])
    assert [s.reward for s in scored] == [0.0, 1.0]
    assert [s.agent_rewards for s in scored] == [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    assert scored[1].outcomes == {"reward": 1.0, "passed": 1.0, "solver_score": 0.0}
    assert scored[0].context == {"answers": [problem["answer"], "nope", "nope"], "scores": [1.0, 0.0, 0.0],
                                 "roles": ["solver", "solver", "checker"]}


def test_one_agent_is_plain_grpo_on_the_task(rg):
    env = make_env(rg, num_agents=1)
    problem = env.problems("train")[0]
    (prompt,) = env.agent_prompts(problem)
    assert "agent" not in prompt
    (scored,) = env.score([problem], [[f"<answer>{problem['answer']}</answer>"]])
    assert (scored.reward, scored.agent_rewards, scored.outcomes) == (1.0, None, {"reward": 1.0, "passed": 1.0})


def test_train_and_heldout_never_share_a_question(rg):
    env = make_env(rg, task_config=SMALL_TASK, train_size=40, eval_size=10)
    train = {p["prompt"] for p in env.problems("train")}
    heldout = [p["prompt"] for p in env.problems("eval")]
    assert len(heldout) == 10 and not train & set(heldout)
    raw = rg.create_dataset("basic_arithmetic", seed=env.cfg.eval_seed, size=40, **SMALL_TASK)
    assert train & {e["question"] for e in raw}  # the held-out seed alone would have repeated train questions
    assert env.problems("eval") == make_env(rg, task_config=SMALL_TASK, train_size=40, eval_size=10).problems("eval")


def test_heldout_problems_are_distinct_questions(rg):
    """A held-out question drawn twice would count twice in an accuracy whose error assumes n problems
    (docs/results/reasoning_sizing.md); of 81 questions, 30 held-out draws repeated 4 of them."""
    env = make_env(rg, task_config=SMALL_TASK, train_size=40, eval_size=30)
    heldout = [p["prompt"] for p in env.problems("eval")]
    assert len(heldout) == len(set(heldout)) == 30


def test_a_task_too_small_for_both_splits_is_a_config_error(rg):
    env = make_env(rg, task_config=SMALL_TASK, train_size=400, eval_size=10)  # nearly every question is a train one
    with pytest.raises(ConfigError, match=r"^env.eval_size: task 'basic_arithmetic' gave \d held-out problems"):
        env.problems("eval")


def test_a_composite_mixes_tasks_and_scores_each_with_its_own_verifier(rg):
    env = make_env(rg, task="composite", train_size=16, task_config={"datasets": [
        {"name": "chain_sum"}, {"name": "basic_arithmetic", "weight": 2, "config": {"max_terms": 3}}]})
    problems = env.problems("train")
    assert {p["metadata"]["source_dataset"] for p in problems} == {"chain_sum", "basic_arithmetic"}
    scored = env.score(problems, [[f"<answer>{p['answer']}</answer>"] * 2 for p in problems])
    assert {s.reward for s in scored} == {1.0}


def branch_prompts(env, problem, completions, truncated=None, **options):
    """Every agent's next-turn prompt for one branch, through the feedback machinery as the trainer calls it."""
    scored = env.score([problem], [completions])[0]
    feedback = Feedback(ExternalConfig(**options), env)
    feedback.check()
    infos = [CompletionInfo(truncated=t) for t in truncated or [False] * len(completions)]
    first = env.agent_prompts(problem)
    branch = Branch(problem["prompt"], completions, [[p] for p in first], [[c] for c in completions],
                    dict(scored.context), problem, infos)
    (prompts,) = feedback([branch])
    return feedback.name, prompts


FEEDBACK_EXAMPLE = """\
You are agent 1 of 2, the checker.
Question: {question}

Your previous reply:
{checker}

Verifier: your answer is wrong.

Agent 0's previous reply (solver):
{solver}

Check the solvers' work step by step, correct any mistake, and give the team's final answer between <answer> and \
</answer>."""


def test_feedback_tells_each_agent_its_verdict_and_never_the_answer(rg):
    env = make_env(rg, task_config={"max_terms": 2, "allow_parentheses": False, "operators": ["+", "-"]})
    problem = next(p for p in env.problems("train") if len(p["answer"]) >= 3)  # digits no other text holds
    solver, checker = f"It is\n<answer>{problem['answer']}</answer>", "<answer>12345678</answer>"
    mode, (to_solver, to_checker) = branch_prompts(env, problem, [solver, checker], original_prompt=False)
    assert mode == "reasoning_gym"  # the env's default_feedback
    assert to_checker == FEEDBACK_EXAMPLE.format(question=problem["prompt"], checker=checker, solver=solver)
    assert f"~~~text\n{to_checker}\n~~~" in (ROOT / "docs" / "environments.md").read_text()  # the docs' example
    assert "Verifier: your answer is correct." in to_solver and checker not in to_solver  # no show_partner
    # Verdicts on replies without a right answer: the answer appears in no prompt.
    cut, empty = "Let me add the numbers one by one and", "<answer> </answer>"
    _, prompts = branch_prompts(env, problem, [cut, empty], truncated=[True, False])
    assert "Verifier: no answer: your reply was cut off before it gave one." in prompts[0]
    assert "Verifier: your answer tags are empty." in prompts[1]
    assert not any(problem["answer"] in p.replace(problem["prompt"], "") for p in prompts)


def test_feedback_in_a_conversation_is_the_verdict_and_the_instruction(rg):
    env = make_env(rg, num_agents=1)
    problem = env.problems("train")[0]
    _, (prompt,) = branch_prompts(env, problem, ["no tags"], history="messages")
    assert prompt == ("Verifier: no answer found: give your final answer between <answer> and </answer>.\n\n"
                      "Revise your work and give your final answer between <answer> and </answer>.")


TASK_ERRORS = {
    "env.task=basic_arithmetc": ("env.task", ["'basic_arithmetc' is not a reasoning-gym task",
                                              "did you mean 'basic_arithmetic'?", "chain_sum, "]),
    "+env.task_config.max_value=3": ("env.task_config.max_value", ["not a key of task 'basic_arithmetic'",
                                                                   "allowed: min_terms, max_terms"]),
    "+env.task_config.min_terms=5 +env.task_config.max_terms=2": (
        "env.task_config", ["task 'basic_arithmetic' rejects it: AssertionError: max_terms must be >= min_terms"]),
    "env.task_config.max_terms=3": ("env.task_config.max_terms", ["+env.task_config.max_terms=VALUE"]),
    "+env.task_config.seed=1": ("env.task_config.seed", ["env.train_seed and env.eval_seed"]),
    "env.task=composite": ("env.task_config.datasets", ["a composite needs a list of tasks"]),
    "env.task=composite +env.task_config.datasets=[{name:chain_sum},{name:nope}]": (
        "env.task_config.datasets[1].name", ["'nope' is not a reasoning-gym task"]),
    "env.eval_seed=0": ("env.eval_seed", ["must differ from env.train_seed (0)"]),
    "env.prompt_style=chatty": ("env.prompt_style", ["'chatty'", "default, direct"]),
    "env.answer_reading=guess": ("env.answer_reading", ["'guess'", "tags, tag_or_last_number"]),
}


@pytest.mark.parametrize("case", list(TASK_ERRORS))
def test_a_bad_task_or_task_config_is_one_line_before_any_model_loads(rg, run_cli, case):
    key, words = TASK_ERRORS[case]
    code, lines = run_cli("env=reasoning_gym", "model=tiny", *case.split())
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"config error: {key}:"), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_without_the_library_it_is_one_line_naming_the_extra(run_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails as when not installed
    code, lines = run_cli("env=reasoning_gym", "model=tiny")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("config error: env: env=reasoning_gym needs the optional package reasoning-gym")
    assert "pip install 'magrpo[reasoning-gym]'" in lines[0]


@pytest.mark.slow
def test_two_agents_train_two_steps_of_two_turns_on_a_task(rg, make_cfg):
    from magrpo.trainer import train

    run = train(make_cfg("env=reasoning_gym", "env.task=basic_arithmetic", "external.mode=auto", "env.num_agents=2",
                         "trainer.num_turns=2", "env.train_size=4", "env.eval_size=2"))
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and "env/verifier_errors" in metrics[-1]
    for key in ("train/agent_1/grad_norm", "eval/turn_1/pass@1_greedy", "eval/turn_1/solver_score_mean",
                "eval/turn_1/greedy_solver_score_mean", "eval/turn_1/greedy_passed_mean"):
        assert key in metrics[-1], key
    tree = json.loads(open(run / "rollouts.jsonl").readline())
    checker = tree["nodes"][1]["prompts"][1]  # turn 1: the checker sees the solver's reply and its own verdict
    assert tree["nodes"][1]["turn"] == 1 and "\n\nVerifier: " in checker
    assert "Agent 0's previous reply (solver):" in checker and checker.endswith("between <answer> and </answer>.")
    assert json.loads((run / "config.json").read_text())["external"]["mode"] == "reasoning_gym"
