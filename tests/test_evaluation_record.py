"""Evaluation's numbers are evaluation's own record (issue 45): what the backend and the feedback count
during an evaluation (tool calls, expert requests) is logged with it under eval/ (eval/tools/calls, ...),
never carried into the next training step, and a run resumed after an evaluation logs exactly what
the uninterrupted run logs."""
from __future__ import annotations

import json

import pytest

from magrpo.backends.hf import HFBackend
from magrpo.cli import main
from magrpo.metrics import Counter
from tests.conftest import SMALL


@pytest.fixture
def counting_backend(monkeypatch):
    """The HF backend counting its generated completions as a backend metric reset on read, as the tool
    loop counts its calls (tools/calls): the tiny model never writes a tool call."""
    generate = HFBackend.generate

    def counted(self, requests, params):
        out = generate(self, requests, params)
        self.probe_count = getattr(self, "probe_count", 0) + sum(len(c) for c in out)
        return out

    def metrics(self):
        n, self.probe_count = getattr(self, "probe_count", 0), 0
        return {"probe/completions": Counter(n)}

    monkeypatch.setattr(HFBackend, "generate", counted)
    monkeypatch.setattr(HFBackend, "metrics", metrics)


def metrics(run) -> list[dict]:
    """metrics.jsonl without the wall-clock numbers."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in open(run / "metrics.jsonl")]


def test_evaluation_counts_are_its_own_and_equal_with_and_without_a_resume(tmp_path, capsys, counting_backend):
    """With tools and eval.every=2, a resume after step 2 logged tools/calls 7 at step 3 where the
    uninterrupted run logged 17 (step 2's evaluation's calls came with step 3: the step's backend
    numbers were read before evaluation ran, and what evaluation added was in no checkpoint), and the
    last evaluation's calls were never logged."""
    common = [*SMALL, "eval.every=2", "checkpoint.every=2", "logging.rollouts=false"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main([*common, f"logging.run_dir={whole}", "trainer.steps=4"]) == 0, capsys.readouterr().err
    assert main([*common, f"logging.run_dir={parts}", "trainer.steps=2"]) == 0, capsys.readouterr().err
    assert main([*common, f"logging.run_dir={parts}", "trainer.steps=4", "resume=auto"]) == 0, capsys.readouterr().err
    logged = metrics(whole)
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    assert metrics(parts) == logged
    # B=2 trees, K=2, T=2 align: 4 + 8 completions per agent-pair node set, every step alike
    assert len({m["probe/completions"] for m in logged}) == 1, [m["probe/completions"] for m in logged]
    # eval: 2 problems x (greedy + 2 samples) x 2 turns, 2 agents' completions each
    assert [m.get("eval/probe/completions") for m in logged] == [None, 24, None, 24]
