"""The code env with N >= 3 agents (issue 16): N-1 helper writers (`aux`, `aux2`, ...) plus the
entry-point writer. Reward levels generalised per helper (N=2 pinned to the original numbers),
prompts per agent, every feedback mode addressing every agent, and a 3-agent training run."""
from __future__ import annotations

import json

import pytest

from magrpo.config import ConfigError, ExternalConfig
from magrpo.envs.code.env import CodeEnv
from magrpo.envs.code.reward import analyze, helper_names, score
from magrpo.external.expert_edits import ExpertEdits, LLMExpert
from magrpo.feedback import Branch, Feedback

# --- reward levels, static (no sandbox): `passed`/`total` come in as numbers -----------------------

AUX = "def aux(xs):\n    return sum(x * x for x in xs)\n"
AUX2 = "```python\ndef aux2(xs):\n    return len(xs)\n```"
USES_BOTH = "def solve(xs):\n    squares = aux(xs)\n    return squares + aux2(xs)\n"
USES_AUX_ONLY = "def solve(xs):\n    squares = aux(xs)\n    return squares + len(xs)\n"
IGNORES_AUX2 = "def solve(xs):\n    aux2(xs)\n    return aux(xs) + len(xs)\n"
WRAPS_AUX2 = "def solve(xs):\n    return aux2(aux(xs))\n"


def parts(helpers, main, passed=4, total=4):
    return score(analyze(helpers, main, "solve"), passed, total)


@pytest.mark.parametrize("aux,main,passed,expected", [
    (AUX, "def solve(xs):\n    total = aux(xs)\n    return total + len(xs)\n", 4, 4.0),
    (AUX, "def solve(xs):\n    total = aux(xs)\n    return total + len(xs)\n", 1, 3.25),
    (AUX, "def solve(xs):\n    total = aux(xs)\n    return total + len(xs)\n", 0, 1.5),
    (AUX, "def solve(xs):\n    return aux(xs)\n", 4, 3.0),
    (AUX, "def solve(xs):\n    aux(xs)\n    return aux(xs)\n", 4, 3.5),
    (AUX, "def solve(xs):\n    return len(xs)\n", 4, 2.5),
    ("no code", "def solve(xs):\n    return len(xs)\n", 2, 1.6),
    (AUX, "def other(xs):\n    return 1\n", 4, 0.4),
])
def test_two_agent_rewards_are_pinned(aux, main, passed, expected):
    """N=2 through the N-agent call form (a list of helper completions, as the env passes them)."""
    reward, _ = parts([aux], main, passed)
    assert reward == pytest.approx(expected)
    assert reward == parts(aux, main, passed)[0]  # and the two-agent string form agrees


def test_helper_names():
    assert helper_names(0) == [] and helper_names(1) == ["aux"] and helper_names(3) == ["aux", "aux2", "aux3"]


def test_three_agents_full_collaboration_is_the_same_maximum():
    reward, p = parts([AUX, AUX2], USES_BOTH)
    assert p == {"aux_defined": 0.4, "main_defined": 0.6, "syntax": 0.5, "tests": 1.0,
                 "aux_used": 0.5, "non_wrapper": 1.0, "ignored_aux": 0.0}
    assert reward == pytest.approx(4.0)


def test_per_helper_levels_pay_their_share():
    # aux2 missing: half the definition level; main uses the one helper there is: half the usage bonus
    reward, p = parts([AUX, "I could not write it."], USES_AUX_ONLY)
    assert p["aux_defined"] == pytest.approx(0.2) and p["aux_used"] == pytest.approx(0.25)
    assert reward == pytest.approx(0.2 + 0.6 + 0.5 + 1.0 + 0.25 + 1.0)
    # both defined, main calls only aux
    _, p = parts([AUX, AUX2], USES_AUX_ONLY)
    assert p["aux_defined"] == pytest.approx(0.4) and p["aux_used"] == pytest.approx(0.25)
    # aux2 called as a bare statement: used, and half the ignored-result penalty
    reward, p = parts([AUX, AUX2], IGNORES_AUX2)
    assert p["aux_used"] == pytest.approx(0.5) and p["ignored_aux"] == pytest.approx(-0.25)
    assert reward == pytest.approx(4.0 - 0.25)
    # four agents, three helpers, one of them called
    _, p = parts([AUX, AUX2, "def aux3(xs):\n    return 0\n"], USES_AUX_ONLY)
    assert p["aux_used"] == pytest.approx(0.5 / 3)


def test_wrapper_of_any_helper_and_no_helper_called():
    reward, p = parts([AUX, AUX2], WRAPS_AUX2)
    assert p["non_wrapper"] == 0.0 and reward == pytest.approx(3.0)
    reward, p = parts([AUX, AUX2], "def solve(xs):\n    return len(xs)\n")
    assert "aux_used" not in p and reward == pytest.approx(2.5)


def test_each_helper_is_found_only_under_its_own_name():
    a = analyze([AUX2, AUX], USES_BOTH, "solve")  # swapped: agent 0 wrote aux2, agent 1 wrote aux
    assert [h.source for h in a.helpers] == [None, None] and not a.aux_defined


# --- the env with three agents on HumanEval/2 (truncate_number, 3 cases) --------------------------

T_AUX = "def aux(x):\n    return int(x)\n"
T_AUX2 = "def aux2(x, whole):\n    return x - whole\n"
T_USES = "def truncate_number(number: float) -> float:\n    whole = aux(number)\n    return aux2(number, whole)\n"
T_IGNORES = "def truncate_number(number: float) -> float:\n    aux2(number, 0)\n    return number + 1\n"


@pytest.fixture(scope="module")
def env3():
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")  # the shipped copy, never the hub
    yield CodeEnv(CodeEnv.Config(num_agents=3, train_split="test[2:3]", eval_split="test[3:4]"))
    mp.undo()


@pytest.mark.parametrize("n", [0, -1])
def test_num_agents_below_one_is_a_config_error(n):
    with pytest.raises(ConfigError, match=r"^env\.num_agents: must be >= 1, got .*N-1 helper writers"):
        CodeEnv(CodeEnv.Config(num_agents=n))


def test_each_agent_is_told_its_own_function(env3):
    prompts = env3.agent_prompts(env3.problems("train")[0])
    assert len(prompts) == 3
    assert prompts[0].startswith("You are agent 0 of 3") and "named `aux` " in prompts[0]
    assert "Other agents write `aux2` and `truncate_number`; `truncate_number` will call your `aux`." in prompts[0]
    assert prompts[1].startswith("You are agent 1 of 3") and "Output only the code of `def aux2(...)`" in prompts[1]
    assert "Other agents write `aux` and `truncate_number`; `truncate_number` will call your `aux2`." in prompts[1]
    assert prompts[2].startswith("You are agent 2 of 3")
    assert "Other agents write the helper functions `aux` and `aux2`, which you may call." in prompts[2]
    assert "def truncate_number(number: float) -> float:" in prompts[2]


def test_three_agent_program_runs_and_scores_per_helper(env3):
    problem = env3.problems("train")[0]
    full, ignored = env3.score([problem, problem], [[T_AUX, T_AUX2, T_USES], [T_AUX, T_AUX2, T_IGNORES]])
    assert full.reward == pytest.approx(4.0) and full.outcomes["passed"] == 1.0 and full.outcomes["aux_used"] == 1.0
    c = ignored.context
    assert c["roles"] == ["aux", "aux2", "main"] and c["functions"] == ["aux", "aux2", "truncate_number"]
    assert c["helper_usage"] == ["not_called", "ignored"] and c["aux_usage"] == "not_called"
    assert c["helper_defined"] == [True, True] and c["aux_defined"] and c["passed"] == 0
    assert ignored.outcomes["aux_used"] == 0.5  # no test passes, but the rate counts calls: aux2 is called
    assert ignored.reward == pytest.approx(0.4 + 0.6 + 0.5)
    assert set(c) == CodeEnv.context_keys



def test_eval_outcomes_carry_the_definition_levels(env3):
    """aux_defined and main_defined are eval outcomes (rates of the first two reward levels)."""
    problem = env3.problems("train")[0]
    full, missing = env3.outcomes([problem, problem], [[T_AUX, T_AUX2, T_USES], [T_AUX, "x = 1\n", "pass\n"]])
    assert full["aux_defined"] == 1.0 and full["main_defined"] == 1.0
    assert missing["aux_defined"] == 0.0 and missing["main_defined"] == 0.0

# --- every feedback mode addresses every agent ------------------------------------------------------

def next_prompts(env, mode, texts, **options):
    problem = env.problems("train")[0]
    first = env.agent_prompts(problem)
    context = env.score([problem], [texts])[0].context
    feedback = Feedback(ExternalConfig(mode=mode, **options), env)
    feedback.check()
    (out,) = feedback(
        [Branch(problem["prompt"], list(texts), [[p] for p in first], [[t] for t in texts], dict(context))]
    )
    return first, out, context


def addresses_every_agent(first, out, context):
    """Each agent gets its own first prompt, its own previous code and a request for its own function."""
    assert len(out) == len(first) == 3
    for a, prompt in enumerate(out):
        assert prompt.startswith(first[a] + "\n\n")
        assert f"Your previous code:\n```python\n{context['code'][a]}\n```" in prompt
        assert prompt.endswith(
            f"Output only the code of `def {context['functions'][a]}(...)`, with a return statement."
        )


@pytest.mark.parametrize("mode", ["plain", "level_feedback", "level_passed", "passed", "expert_edits"])
def test_every_mode_addresses_all_three_agents(env3, mode):
    first, out, context = next_prompts(env3, mode, [T_AUX, T_AUX2, T_IGNORES])
    addresses_every_agent(first, out, context)


def test_level_feedback_reports_each_helper(env3):
    _, out, _ = next_prompts(env3, "level_feedback", [T_AUX, T_AUX2, T_IGNORES])
    for prompt in out:
        assert (
            "- `aux`: defined with a return.\n- `aux2`: defined with a return.\n- `truncate_number`: defined" in prompt
        )
        assert ("- aux usage: `truncate_number` does not call `aux`.\n"
                "- aux2 usage: `truncate_number` calls `aux2` but ignores its result.") in prompt
    _, out, _ = next_prompts(
        env3, "level_feedback", [T_AUX, T_AUX2, "def truncate_number(x):\n    return aux2(x, 0)\n"]
    )
    assert "- warning: `truncate_number` only returns `aux(...)` or `aux2(...)`; do part" in out[2]


def test_level_passed_and_passed_list_each_helper(env3):
    _, out, _ = next_prompts(env3, "level_passed", [T_AUX, T_AUX2, T_USES])
    checks = ["aux defined", "aux2 defined", "truncate_number defined", "syntax", "tests", "aux used", "aux2 used",
              "truncate_number does more than return aux(...) or aux2(...)"]
    assert all(("Checks:\n" + "\n".join(f"- {c}: passed" for c in checks)) in p for p in out)
    _, out, _ = next_prompts(env3, "level_passed", [T_AUX, T_AUX2, T_IGNORES])
    assert "- aux used: failed\n- aux2 used: failed" in out[1]
    _, out, _ = next_prompts(env3, "passed", [T_AUX, T_AUX2, T_USES])
    assert all("\n\nResult: all checks passed.\n\n" in p for p in out)


def test_plain_shows_every_partner(env3):
    _, out, _ = next_prompts(env3, "plain", [T_AUX, T_AUX2, T_USES], show_partner=True)
    assert "Agent 1's previous code (`aux2`):" in out[0] and "Agent 2's previous code (`truncate_number`):" in out[0]
    assert "Agent 0's previous code (`aux`):" in out[2] and "Agent 1's previous code (`aux2`):" in out[2]
    assert "Agent 1's" not in out[1]


def test_reference_expert_proposes_each_agent_its_own_function(env3):
    _, out, _ = next_prompts(env3, "expert_edits", [T_AUX, T_AUX2, T_IGNORES])
    for a, name in enumerate(["aux", "aux2", "truncate_number"]):
        assert (
            f"proposes this `{name}`:\n```python\ndef {name}(number: float) -> float:\n    return number % 1.0\n```"
            in out[a]
        )


class ScriptedClient:
    """An expert endpoint stand-in: records prompts, answers one JSON object with every agent's key."""
    name, model = "scripted", "scripted-model"

    def __init__(self):
        self.prompts = []

    def complete(self, prompts):
        self.prompts += prompts
        return ['{"aux": "def aux(x):\\n    return int(x)", "aux2": "", "main": "def truncate_number(number):\\n'
                '    return aux2(number, aux(number))"}' for _ in prompts]


def test_llm_expert_asks_for_every_agent_and_each_gets_its_edit(env3):
    problem = env3.problems("train")[0]
    texts = [T_AUX, T_AUX2, T_IGNORES]
    first = env3.agent_prompts(problem)
    mode = ExpertEdits(ExternalConfig(mode="expert_edits"), env3)
    client = ScriptedClient()
    mode.expert = LLMExpert(client)
    context = env3.score([problem], [texts])[0].context
    (out,) = mode.batch([Branch(problem["prompt"], texts, [[p] for p in first], [[t] for t in texts], dict(context))])
    (request,) = client.prompts
    assert request.startswith(
        "You review Python code that 3 agents wrote together for one problem. Agent 0 writes "
        "a helper `aux`, agent 1 a helper `aux2`; agent 2 writes `truncate_number`, which may call them."
    )
    assert 'keys "aux", "aux2", "main"' in request and "Agent 1 wrote `aux2` (key \"aux2\")" in request
    assert "proposes this `aux`:\n```python\ndef aux(x):\n    return int(x)\n```" in out[0]
    assert "proposes no changes to your `aux2`." in out[1]
    assert "proposes this `truncate_number`:\n```python\ndef truncate_number(number):\n" in out[2]


# --- end to end -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_three_agent_code_run_of_two_steps_on_the_tiny_model(make_cfg, monkeypatch):
    """The tree, advantages, updates and logging for three agents through the real code env."""
    from magrpo.trainer import train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = train(make_cfg("env=code", "env.num_agents=3", "env.train_split='test[:2]'", "env.eval_split='test[2:3]'",
                         "external=level_feedback", "generation.max_new_tokens=16", "eval.num_samples=1"))
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert len(metrics) == 2
    for m in metrics:
        for a in range(3):
            assert f"train/agent_{a}/loss" in m, a
        assert "train/agent_3/loss" not in m and m["train/reward_mean"] >= 0
    assert "eval/turn_1/aux_used_mean" in metrics[-1]
    nodes = [node for line in open(run / "rollouts.jsonl") for node in json.loads(line)["nodes"]]
    assert sum(node["turn"] == 1 for node in nodes) == 2 * 2 * 2  # steps x trees x K children (align, T=2)
    for node in nodes:
        assert len(node["prompts"]) == len(node["completions"]) == len(node["advantages"]) == 3
        if node["turn"] == 1:  # level_feedback's prompt, one per agent, each asking for its own function
            for a, name in enumerate(["aux", "aux2"]):
                assert f"Revise your code. Output only the code of `def {name}(...)`" in node["prompts"][a]
            assert all("Feedback on the combined program:" in p for p in node["prompts"])
    assert json.load(open(run / "config.json"))["env"]["num_agents"] == 3
