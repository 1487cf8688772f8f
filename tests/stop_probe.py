"""User code that hangs, and a start-up that a test can catch in the act, for tests/test_clean_stops.py.
Each writes `entered` (or the stage's name) into the folder $MAGRPO_TEST_GATE when it is there, so
the test signals a run that is certainly inside it."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

RELEASE = threading.Event()  # in-process tests set it at teardown: the hung call then returns


def _entered(name: str) -> None:
    gate = os.environ.get("MAGRPO_TEST_GATE")
    if gate:
        (Path(gate) / name).touch()


CALLS = {"n": 0, "hang_after": 0,  # in-process: the calls before it hangs (B=2, K=2 align: 4 per step)
         "hang_s": 3600}  # how long `stuck` hangs
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


def stuck(*args, **kwargs):
    """A plugin's hook (or an env method) that hangs, until RELEASE is set or CALLS["hang_s"] pass: a test
    whose time limit does not hold fails by that then, rather than hanging forever."""
    _entered("entered")
    if not RELEASE.wait(CALLS["hang_s"]):
        raise AssertionError(f"hung {CALLS['hang_s']} s: no time limit stopped it")


def fails(*args, **kwargs):
    """A plugin's hook that raises."""
    raise ValueError("probe failure\nwith a second line")


def signals(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    """A feedback function that sends its own process SIGTERM at its first call (in-process tests)."""
    with _count:
        CALLS["n"] += 1
        first = CALLS["n"] == 1
    if first:
        os.kill(os.getpid(), signal.SIGTERM)
    return [f"{prompt} again, agent {i}" for i in range(num_agents)]


def _stalled(stage: str, real):
    def stall(*args, **kwargs):
        _entered(stage)
        time.sleep(600)  # a model load or build that takes minutes: the test's signal ends it
        return real(*args, **kwargs)

    return stall


# A plugin (plugins=[tests.stop_probe]) with MAGRPO_TEST_STALL=STAGE: the run stalls at that stage of start-up.
STAGE = os.environ.get("MAGRPO_TEST_STALL")
if STAGE == "load_agents":  # while the weights load (before the run dir holds anything)
    import magrpo.models

    magrpo.models.load_agents = _stalled(STAGE, magrpo.models.load_agents)
elif STAGE == "startup_line":  # after config.json and the logs were created, before the first step
    import magrpo.trainer

    magrpo.trainer.startup_line = _stalled(STAGE, magrpo.trainer.startup_line)
elif STAGE == "build":  # while the tiny model builds in its temp folder in $MAGRPO_CACHE
    import magrpo.tiny

    magrpo.tiny._build = _stalled(STAGE, magrpo.tiny._build)

# A plugin (plugins=[tests.stop_probe]) with MAGRPO_TEST_HOOK=baseline: a baseline `stuck` that hangs.
if os.environ.get("MAGRPO_TEST_HOOK") == "baseline":
    from magrpo.advantage import BASELINES

    BASELINES.register("stuck")(stuck)
