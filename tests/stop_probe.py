"""User code that hangs, for tests/test_clean_stops.py. It writes `entered` into the folder
$MAGRPO_TEST_GATE when it is there, so the test acts on a run that is certainly inside it."""
from __future__ import annotations

import os
import threading
from pathlib import Path

RELEASE = threading.Event()  # in-process tests set it at teardown: the hung call then returns


def _entered(name: str) -> None:
    gate = os.environ.get("MAGRPO_TEST_GATE")
    if gate:
        (Path(gate) / name).touch()


CALLS = {"n": 0, "hang_after": 0}  # in-process: the calls before it hangs (B=2, K=2 align: 4 per step)
_count = threading.Lock()


def hang(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    """A feedback function that never returns after its first CALLS["hang_after"] calls (until
    RELEASE is set, in-process)."""
    with _count:
        CALLS["n"] += 1
        hangs = CALLS["n"] > CALLS["hang_after"]
    if hangs:
        _entered("entered")
        while not RELEASE.wait(3600):
            pass
    return [f"{prompt} again, agent {i}" for i in range(num_agents)]
