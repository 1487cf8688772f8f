"""The code env end to end: shipped HumanEval, prompts, sandboxed scoring, a training run."""
from __future__ import annotations

import json

import pytest

from magrpo.envs.code.env import CodeEnv
from magrpo.trainer import train

AUX = '''```python
def aux(a, b):
    """Distance between two numbers."""
    return abs(a - b)
```'''

MAIN = '''```python
def has_close_elements(numbers, threshold):
    for i, x in enumerate(numbers):
        for j, y in enumerate(numbers):
            if i != j:
                distance = aux(x, y)
                if distance < threshold:
                    return True
    return False
```'''

WRONG_MAIN = '''def has_close_elements(numbers, threshold):
    distance = aux(numbers[0], numbers[-1])
    return distance < threshold
'''


@pytest.fixture(scope="module")
def env(monkeypatch_module):
    return CodeEnv(CodeEnv.Config(train_split="test[:3]", eval_split="test[3:5]"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")  # the shipped copy, never the hub
    yield mp
    mp.undo()


def test_prompts_name_the_functions_from_the_signature(env):
    problem = env.problems("train")[0]
    assert problem["task_id"] == "HumanEval/0"
    aux_prompt, main_prompt = env.agent_prompts(problem)
    assert "`aux`" in aux_prompt and "has_close_elements(numbers, threshold)" in aux_prompt
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in main_prompt


def test_a_right_answer_too_deep_for_ast_unparse_scores_full_reward(env):
    """330 chained operators are legal Python, but ast.unparse recursed past Python's limit: the
    RecursionError stopped training (reward.on_error=raise) or scored the right answer 0 (zero).
    Its own lines now go into the program."""
    problem = env.problems("train")[0]
    deep = MAIN.replace("    return False", "    return " + " + ".join(["0"] * 330) + " == 1")
    assert env.rewards([problem], [[AUX, deep]])[0] == pytest.approx(4.0)


def test_canonical_solution_split_into_aux_and_main_scores_full_reward(env):
    problem = env.problems("train")[0]
    runs = env.sandbox_runs  # the env is shared by the module's tests
    rewards = env.rewards([problem, problem], [[AUX, MAIN], [AUX, WRONG_MAIN]])
    assert rewards[0] == pytest.approx(4.0)
    assert rewards[1] < 4.0
    assert env.sandbox_runs - runs == 2


@pytest.mark.slow
def test_code_env_trains_two_steps_on_the_tiny_model(make_cfg, capsys):
    """Also the unsafe sandbox's warning: in the console, config.json and every step's metrics (the
    default bwrap mode trains in test_data_parallel.py and test_overlap.py)."""
    run = train(make_cfg("env=code", "env.train_split='test[:4]'", "env.eval_split='test[4:6]'", "env.sandbox=unsafe",
                         "external=plain", "generation.max_new_tokens=24", "eval.at_start=true"))
    assert "WARNING: env.sandbox=unsafe: model-written programs run" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["warnings"][0].startswith("env.sandbox=unsafe")
    before, *metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert before["step"] == 0 and "eval/turn_1/pass@1_greedy" in before  # the untrained agents
    assert len(metrics) == 2
    # random tiny model: its text is not code, so rewards sit at the bottom level but are real numbers
    assert all(m["train/reward_mean"] >= 0 for m in metrics)
    last = metrics[-1]  # evaluation ran after the last step, through both turns
    for key in ["eval/turn_0/pass@1_greedy", "eval/turn_1/pass@1", "eval/turn_1/pass@2", "eval/turn_1/syntax_ok_mean",
                "eval/turn_1/timeout_mean", "eval/improvement/pass@1", "perf/eval_s"]:
        assert key in last, key
    assert "eval/turn_0/pass@1" not in metrics[0]
    for key in ["env/sandbox_runs", "env/sandbox_timeouts", "env/skipped_problems", "perf/sandbox_runs_per_s"]:
        assert key in last, key
    assert last["env/skipped_problems"] == 0  # HumanEval 0-5 all parse
    assert all(m["env/sandbox_unsafe"] == 1.0 for m in metrics)


def test_without_bubblewrap_the_code_env_stops_at_start_up_with_one_line(tmp_path):
    """No bwrap on PATH: one line naming env.sandbox, what to install and the opt-in; exit 2, no model."""
    from tests.test_cli_errors import train_py

    code, lines = train_py("env=code", PATH=str(tmp_path), MAGRPO_CACHE=str(tmp_path / "cache"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("config error: env.sandbox: bubblewrap (bwrap) is not installed"), lines
    for words in ("apt-get install bubblewrap", "env.sandbox=unsafe"):
        assert words in lines[0]
    assert not (tmp_path / "cache").exists()  # the tiny model was not built


def test_a_sandbox_mode_that_does_not_exist_is_one_line(run_cli):
    code, lines = run_cli("env=code", "env.sandbox=docker")
    assert code == 2 and lines == ["config error: env.sandbox: 'docker' is not allowed; choose one of: bwrap, unsafe"]


def test_reward_weights_come_from_config(make_cfg):
    from magrpo.env import make_env

    cfg = make_cfg("env=code", "env.reward.shift=-2.0", "env.reward.scale=0.5", "env.reward.non_wrapper=2")
    env = make_env(cfg.env)
    problem = env.problems("train")[0]
    # (0.4 + 0.6 + 0.5 + 1.0 + 0.5 + 2.0 - 2.0) * 0.5
    assert env.rewards([problem], [[AUX, MAIN]]) == [pytest.approx(1.5)]


def test_unknown_reward_key_is_a_config_error(make_cfg):
    from magrpo.config import ConfigError
    from magrpo.env import make_env

    cfg = make_cfg("env=code", "+env.reward.bonus=1")
    with pytest.raises(ConfigError, match=r"env\.reward\.bonus: unknown key .* allowed: aux_defined"):
        make_env(cfg.env)


@pytest.mark.slow
def test_all_164_canonical_solutions_pass_through_the_sandbox_and_the_judge():
    """Case semantics kept end to end (candidate process + judge process + plain data): every shipped
    canonical solution passes all its cases, a stub passes none, and no case is unsupported."""
    env = CodeEnv(CodeEnv.Config(num_agents=1, train_split="test", eval_split="test[:1]"))
    problems = env.problems("train")
    assert len(problems) == 164 and env.unsupported == 0
    canonical = [[p["prompt"] + p["canonical_solution"]] for p in problems]
    stubs = [[f"def {p['entry_point']}(*args, **kwargs):\n    return None\n"] for p in problems]
    scored = env.score(problems + problems, canonical + stubs)
    failing = [(p["task_id"], s.context["first_failure"]) for p, s in zip(problems, scored[:164])
               if s.outcomes["passed"] != 1.0]
    assert failing == []
    assert all(s.outcomes["passed"] == 0.0 for s in scored[164:])  # (some cases expect None)
    assert env.metrics()["env/unsupported_cases"] == 0


# The env keeps only the functions of a completion (and the prompt's imports): attacks live inside them.
HOSTILE_MAINS = {
    "always_equal": "def truncate_number(number):\n    class Yes:\n        __eq__ = lambda self, other: True\n"
                    "        __sub__ = lambda self, other: self\n        __abs__ = lambda self: 0.0\n"
                    "    return Yes()\n",
    "bytecode_peek": "def truncate_number(number):\n    import sys\n"
                     "    consts = list(sys._getframe(1).f_code.co_consts)\n"
                     "    return consts[consts.index(number) + 1]\n",
    "mutate_cases": "def truncate_number(number, _=__import__('sys')._getframe(1).f_locals['cases'].__setitem__(\n"
                    "        slice(None), ['pass'] * 3)):\n    return 0.0\n",
    "forge_via_frames": "def truncate_number(number):\n    import os, sys\n    frame = sys._getframe()\n"
                        "    while frame is not None:\n        loc = frame.f_locals\n"
                        "        if 'token' in loc and 'fd' in loc:\n            for i in range(len(loc['cases'])):\n"
                        "                os.write(loc['fd'], loc['token'] + b' case %d 1 \\n' % i)\n"
                        "        frame = frame.f_back\n    return None\n",
}


def test_hostile_programs_score_at_the_no_test_passed_level_through_the_env(truncate_env):
    """HumanEval/2 (truncate_number): aux defined, main defined, parses, and no test passes:
    0.4 + 0.6 + 0.5 = 1.5 and no aux bonus; pass@1 is 0."""
    from magrpo.evaluation import pass_at_k

    aux = "def aux(x):\n    return x\n"
    problem = truncate_env.problems("train")[0]
    scored = truncate_env.score([problem] * len(HOSTILE_MAINS), [[aux, main] for main in HOSTILE_MAINS.values()])
    for name, s in zip(HOSTILE_MAINS, scored):
        assert s.context["passed"] == 0 and s.reward == pytest.approx(1.5), (name, s.context["first_failure"])
    assert pass_at_k(len(scored), int(sum(s.outcomes["passed"] for s in scored)), 1) == 0.0


SEMANTICS = [  # (name, prompt, test, correct solution, wrong solution)
    ("mbpp_style_module_asserts", "def pairs(xs):\n    \"\"\"Adjacent pairs as tuples.\"\"\"\n",
     "assert pairs([1, 2, 3]) == [(1, 2), (2, 3)]\nassert pairs([]) == []\n",
     "def pairs(xs):\n    return list(zip(xs, xs[1:]))\n", "def pairs(xs):\n    return [[1, 2], [2, 3]]\n"),
    ("isclose_and_abs_eps", "import math\ndef root(x):\n    \"\"\"Square root.\"\"\"\n",
     "import math\ndef check(candidate):\n    assert math.isclose(candidate(2.0), 1.41421356, rel_tol=1e-6)\n"
     "    assert abs(candidate(9.0) - 3) < 1e-9\n",
     "def root(x):\n    return math.sqrt(x)\n", "def root(x):\n    return x / 2\n"),
    ("is_true_and_sets", "def flags(x):\n    \"\"\"(is even, digits).\"\"\"\n",
     "def check(candidate):\n    assert candidate(4)[0] is True\n    assert candidate(3)[0] is False\n"
     "    assert candidate(121)[1] == {1, 2}\n    assert candidate(7) == (False, frozenset({7}))\n",
     "def flags(x):\n    return (x % 2 == 0, frozenset(int(d) for d in str(x)))\n",
     "def flags(x):\n    return (1 if x % 2 == 0 else 0, frozenset(int(d) for d in str(x)))\n"),
    ("loops_helpers_and_dicts", "def count(s):\n    \"\"\"Letter counts.\"\"\"\n",
     "import random\nrandom.seed(1)\ndef reference(s):\n    out = {}\n    for c in s:\n"
     "        out[c] = out.get(c, 0) + 1\n"
     "    return out\n\ndef check(candidate):\n    for _ in range(20):\n"
     "        s = ''.join(random.choice('abc') for _ in range(random.randint(0, 8)))\n"
     "        assert candidate(s) == reference(s), s\n    assert candidate('') == {}\n",
     "def count(s):\n    from collections import Counter\n    return Counter(s)\n",
     "def count(s):\n    return {c: 1 for c in s}\n"),
    ("expected_exception", "def parse(s):\n    \"\"\"int(s); ValueError on bad input.\"\"\"\n",
     "def check(candidate):\n    assert candidate('12') == 12\n    try:\n        candidate('x')\n"
     "        assert False, 'no error'\n    except ValueError:\n        pass\n",
     "def parse(s):\n    return int(s)\n", "def parse(s):\n    return int(s) if s.isdigit() else None\n"),
]


def test_case_semantics_survive_the_judge(tmp_path, monkeypatch):
    """MBPP-style module asserts, math.isclose, abs(..) < eps, `is True`, sets and frozensets, loops
    over random inputs with helpers from the test, Counter answers, tests that expect an exception:
    the correct solution passes every case, a wrong one does not."""
    path = tmp_path / "semantics.jsonl"
    path.write_text("".join(json.dumps({"task_id": name, "prompt": prompt, "test": test,
                                        "entry_point": prompt.split("def ", 1)[1].split("(", 1)[0]}) + "\n"
                            for name, prompt, test, _, _ in SEMANTICS))
    env = CodeEnv(CodeEnv.Config(dataset=str(path), num_agents=1, train_split="test", eval_split="test[:1]"))
    problems = env.problems("train")
    assert [p["task_id"] for p in problems] == [name for name, *_ in SEMANTICS] and env.unsupported == 0
    scored = env.score(problems * 2, [[right] for *_, right, _ in SEMANTICS] + [[wrong] for *_, wrong in SEMANTICS])
    for (name, *_), right, wrong in zip(SEMANTICS, scored[:len(SEMANTICS)], scored[len(SEMANTICS):]):
        assert right.outcomes["passed"] == 1.0, (name, right.context["first_failure"])
        assert wrong.outcomes["passed"] == 0.0 and wrong.context["passed"] < wrong.context["total"], name
