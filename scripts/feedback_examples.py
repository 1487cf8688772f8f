"""Print the example prompt of every built-in code-env feedback mode, built by the modes
themselves (tests/test_docs.py checks docs/feedback.md still shows exactly these).

    python scripts/feedback_examples.py
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import magrpo.external  # noqa: F401  (registers the modes)
from magrpo.config import ExternalConfig
from magrpo.envs.code.env import CodeEnv
from magrpo.feedback import Branch, Feedback

MODES = ["plain", "level_feedback", "level_passed", "passed", "expert_edits"]
AUX = "def aux(x):\n    return x - int(x)\n"
MAIN = "def truncate_number(number: float) -> float:\n    aux(number)\n    return number + 1\n"


def examples() -> dict[str, str]:
    """Agent 1's next-turn prompt per mode, for HumanEval/2 with an aux that is right and a main that
    ignores it (0/3 tests pass), with external.original_prompt=false to keep them short."""
    env = CodeEnv(CodeEnv.Config(train_split="test[2:3]", eval_split="test[3:4]"))
    problem = env.problems("train")[0]
    first = env.agent_prompts(problem)
    context = env.score([problem], [[AUX, MAIN]])[0].context
    out = {}
    for mode in MODES:
        branch = Branch(problem["prompt"], [AUX, MAIN], [[p] for p in first], [[AUX], [MAIN]], dict(context))
        (prompts,) = Feedback(ExternalConfig(mode=mode, original_prompt=False), env)([branch])
        out[mode] = prompts[1]
    return out


if __name__ == "__main__":
    for mode, prompt in examples().items():
        print(f"`{mode}`:\n\n~~~text\n{prompt}\n~~~\n")
