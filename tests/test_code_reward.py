"""Reward levels of the aux + main code collaboration, on hand-written completion pairs."""
from __future__ import annotations

import pytest

from magrpo.envs.code.reward import RewardWeights, analyze, score

AUX_OK = '''Here is my helper:
```python
def aux(xs):
    """Sum of squares."""
    return sum(x * x for x in xs)
```'''

MAIN_USES_AUX = '''```python
def solve(xs):
    total = aux(xs)
    return total + len(xs)
```'''

MAIN_WRAPPER = '''def solve(xs):
    """Just delegates."""
    return aux(xs)
'''

MAIN_IGNORES_AUX = '''def solve(xs):
    aux(xs)
    result = aux(xs)
    return result
'''

MAIN_ALONE = '''def solve(xs):
    return sum(x * x for x in xs) + len(xs)
'''


def reward(aux, main, passed=3, total=4, **weights):
    return score(analyze(aux, main, "solve"), passed, total, RewardWeights(**weights))


def test_full_collaboration_scores_every_level():
    r, parts = reward(AUX_OK, MAIN_USES_AUX, passed=4, total=4)
    # 0.4 aux + 0.6 main + 0.5 syntax + 1.0 tests + 0.5 aux used + 1.0 not a wrapper = 4.0
    assert parts == {"aux_defined": 0.4, "main_defined": 0.6, "syntax": 0.5, "tests": 1.0,
                     "aux_used": 0.5, "non_wrapper": 1.0, "ignored_aux": 0.0}
    assert r == pytest.approx(4.0)


def test_partial_tests_scale_linearly():
    r, parts = reward(AUX_OK, MAIN_USES_AUX, passed=1, total=4)
    assert parts["tests"] == pytest.approx(0.25) and r == pytest.approx(3.25)


def test_no_test_passing_means_no_collaboration_bonus():
    r, parts = reward(AUX_OK, MAIN_USES_AUX, passed=0, total=4)
    assert "aux_used" not in parts and r == pytest.approx(0.4 + 0.6 + 0.5)


def test_wrapper_gets_no_non_wrapper_bonus():
    r, parts = reward(AUX_OK, MAIN_WRAPPER, passed=4, total=4)
    assert parts["aux_used"] == 0.5 and parts["non_wrapper"] == 0.0 and r == pytest.approx(3.0)


def test_ignored_aux_result_is_penalised():
    r, parts = reward(AUX_OK, MAIN_IGNORES_AUX, passed=4, total=4)
    assert parts["ignored_aux"] == -0.5 and r == pytest.approx(4.0 - 0.5)


def test_main_without_aux_call_gets_tests_but_no_bonus():
    r, parts = reward(AUX_OK, MAIN_ALONE, passed=4, total=4)
    assert "aux_used" not in parts and r == pytest.approx(0.4 + 0.6 + 0.5 + 1.0)


def test_missing_aux_still_scores_main_levels():
    r, parts = reward("I could not write it.", MAIN_ALONE, passed=2, total=4)
    assert parts["aux_defined"] == 0.0 and r == pytest.approx(0.6 + 0.5 + 0.5)


def test_aux_without_return_is_not_defined():
    a = analyze("def aux(xs):\n    print(xs)\n", MAIN_USES_AUX, "solve")
    assert a.aux_source is not None and not a.aux_defined


def test_missing_main_stops_after_level_one():
    r, parts = reward(AUX_OK, "def other(xs):\n    return 1\n", passed=4, total=4)
    assert parts == {"aux_defined": 0.4} and r == pytest.approx(0.4)


def test_main_without_return_stops():
    r, parts = reward(AUX_OK, "def solve(xs):\n    xs.sort()\n", passed=4, total=4)
    assert parts == {"aux_defined": 0.4}


def test_unparseable_combination_stops_at_level_two():
    # main parses alone; the prompt's imports do not
    a = analyze(AUX_OK, MAIN_USES_AUX, "solve", imports="from typing import (List")
    r, parts = score(a, 4, 4)
    assert not a.parses and parts == {"aux_defined": 0.4, "main_defined": 0.6} and r == pytest.approx(1.0)


def test_function_is_recovered_from_a_broken_completion():
    # the text around the function does not parse, the function itself does
    main = "Sure! Here's the code:\ndef solve(xs):\n    return aux(xs) + 1\nHope it helps :)"
    a = analyze(AUX_OK, main, "solve")
    assert a.main_defined and a.main_calls_aux and not a.is_wrapper


def test_return_in_nested_function_does_not_count():
    main = "def solve(xs):\n    def inner():\n        return 1\n    inner()\n"
    assert not analyze(AUX_OK, main, "solve").main_defined


def test_shift_and_scale():
    r, _ = reward(AUX_OK, MAIN_USES_AUX, passed=4, total=4, shift=-2.0, scale=0.5)
    assert r == pytest.approx((4.0 - 2.0) * 0.5)


def test_single_agent_has_no_aux_levels():
    r, parts = score(analyze(None, MAIN_ALONE, "solve"), 4, 4)
    assert parts["aux_defined"] == 0.0 and "aux_used" not in parts and r == pytest.approx(2.1)


@pytest.mark.parametrize("cut", ["\n\ndef", "\n\ndef aux2(xs", "\n\nasync def later("])
def test_a_reply_cut_where_a_second_function_begins_parses_without_its_unfinished_def_line(cut):
    """What a stop string such as "\\n\\ndef" keeps at the end of a reply is dropped: the reply is
    the complete code before it, with no syntax error."""
    from magrpo.envs.code.reward import syntax_error

    for fenced in (False, True):
        main = ("```python\n" if fenced else "") + MAIN_USES_AUX.strip("`\npython") + cut
        assert syntax_error(main) is None
        _, parts = reward(AUX_OK, main, passed=4, total=4)
        assert parts["syntax"] == 0.5 and parts["aux_used"] == 0.5
    assert syntax_error(MAIN_ALONE + "\ndefault = 1") is None  # a name that begins with "def" is code
    assert syntax_error("def solve(xs") is not None  # a reply cut in its only def line stays broken


def test_the_models_invalid_escapes_neither_warn_nor_change_the_reward():
    """SmolLM2 writes strings such as "\\ " (an invalid escape): the parser warned once per completion
    (shown by default from Python 3.12 on), and under `-W error` the completion scored as a syntax error."""
    import warnings

    from magrpo.envs.code.reward import syntax_error

    main = 'def f(x):\n    return x + "\\ "\n'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert syntax_error(main) is None
        analysis = analyze(None, main, "f")
    assert analysis.parses and analysis.main_defined
