"""A feedback function that holds its run at its first call until the test opens a gate, so a test
can act while a run is certainly live (a run on a fast machine can otherwise finish before a second
process has even imported torch). The gate is a folder named by MAGRPO_TEST_GATE: the run writes
`entered` there and waits for `open`."""
from __future__ import annotations

import os
import time
from pathlib import Path

from magrpo.envs.length_ratio import length_ratio_feedback

_held = False


def gated(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    global _held
    if not _held:
        _held = True
        gate = Path(os.environ["MAGRPO_TEST_GATE"])
        (gate / "entered").touch()
        deadline = time.monotonic() + 300  # the test fails on its own asserts if it never opens
        while not (gate / "open").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return length_ratio_feedback(prompt, agent_completions, num_agents, prompt_history_per_agent,
                                 response_history_per_agent)
