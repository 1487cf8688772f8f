"""bench/bench_tools.py keeps working: a short run per mode prints its table, with the forced calls
made (2 per completion) and batched (3 generate calls per step with tools, 1 without). The timings are
the benchmark's business, not a test's. It broke once unnoticed when ToolBackend gained an argument."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_bench_tools_runs_both_modes_with_batched_forced_calls():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_tools.py"), "--steps", "2", "--repeats", "2",
                           "--segment", "8", "--batch-size", "2", "--k", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {m[0]: m[1:] for m in re.findall(r"^\s+(off|on)\s+.*?(\S+)\s+(\S+)\s+(\S+)$", done.stdout, re.M)}
    assert set(rows) == {"off", "on"}, done.stdout
    assert float(rows["off"][1]) == 1.0 and float(rows["on"][1]) == 3.0  # generate calls per step
    assert float(rows["off"][2]) == 0.0 and float(rows["on"][2]) == 2.0  # tool calls per completion
    pairs = re.search(r"run by run: median \S+ \(min \S+, max \S+\): (.*)$", done.stdout, re.M)
    assert pairs and len(pairs[1].split(", ")) == 2, done.stdout  # one ratio per pair of runs
