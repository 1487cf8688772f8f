"""One metrics stream, several sinks: every metric name documented in docs/outputs.md (metrics table) is
written to metrics.jsonl and to the wandb offline run's history; samples reach wandb too."""
from __future__ import annotations

import json
import re

import pytest

from magrpo.trainer import train
from tests.conftest import ROOT
from tests.wandb_reader import history, records

NUM_TURNS, NUM_AGENTS, NUM_SAMPLES = 2, 2, 2


def documented_metrics() -> list[str]:
    """Metric names of the metrics table in docs/outputs.md, with {t}, {a} and {k} expanded. Rows logged only
    with backend=vllm are left to tests/test_vllm_train.py (the vllm venv), those of tools and inserted tokens
    to tests/test_tools.py and tests/test_loss_mask.py (this run has neither), the reasoning_gym env's to
    tests/test_reasoning_gym.py (this run is the code env's)."""
    readme = (ROOT / "docs" / "outputs.md").read_text()
    table = readme.split("| metric | meaning | logged |")[1].split("\n\n")[0]
    elsewhere = ("| `backend=vllm` |", "| `tools=[...]` |", "| steps where a completion carries a `model_mask` |",
                 "reasoning_gym env |")
    names = []
    for row in table.strip().splitlines()[1:]:
        if row.rstrip().endswith(elsewhere):
            continue
        cell = row.split("|")[1]
        first, *more = re.findall(r"`([^`]+)`", cell)
        prefix = first.rsplit("/", 1)[0]
        for name in [first] + [f"{prefix}/{m}" for m in more]:
            names += [name.format(t=t, a=a, k=NUM_SAMPLES) for t in range(NUM_TURNS) for a in range(NUM_AGENTS)]
    return sorted(set(names))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 steps on the code env (tiny model) with the expert and eval on: every documented condition holds."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("WANDB_SILENT", "true")
    from magrpo.cli import compose
    from tests.conftest import SMALL

    cfg = compose([*SMALL, f"logging.run_dir={tmp_path_factory.mktemp('metrics') / 'run'}", "env=code",
                   "env.train_split='test[:4]'", "env.eval_split='test[4:6]'", "external=expert_edits",
                   "generation.max_new_tokens=12", "trainer.steps=3", "trainer.kl_coef=0.01",
                   "trainer.tis_cap=2.0",
                   f"trainer.num_turns={NUM_TURNS}", f"eval.num_samples={NUM_SAMPLES}", "eval.every=3",
                   "logging.wandb.mode=offline", "logging.samples_every=2", "logging.wandb.tags=[ci,tiny]",
                   "logging.wandb.log_adapters=true"])
    path = train(cfg)
    mp.undo()
    return path


def test_metrics_table_lists_the_issue_families():
    names = documented_metrics()
    for expected in ["train/turn_1/reward_max", "train/agent_1/entropy", "tree/leaves", "perf/peak_mem_gb",
                     "eval/turn_1/pass@2", "eval/turn_0/greedy_syntax_ok_mean", "expert/latency_s", "env_step"]:
        assert expected in names, expected


def test_every_documented_metric_is_in_metrics_jsonl(run):
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    logged = set().union(*rows)
    missing = [name for name in documented_metrics() if name not in logged]
    assert not missing, f"documented but never logged: {missing}"


def test_wandb_offline_history_has_the_same_keys_and_samples(run):
    (offline,) = (run / "wandb").glob("offline-run-*")
    (datastore,) = offline.glob("*.wandb")
    rows = history(datastore)
    logged = set().union(*rows)
    missing = [name for name in documented_metrics() if name not in logged]
    assert not missing, f"not in the wandb history: {missing}"
    assert sorted({r["step"] for r in rows if "step" in r}) == [1, 2, 3]
    # samples every 2 steps and at the last step: a Table and the tree page, at steps 2 and 3
    tables = [r["_step"] for r in rows if "samples/rollouts" in r]
    pages = [r["_step"] for r in rows if "samples/tree" in r]
    assert tables == [2, 3] and pages == [2, 3]
    table = next(r["samples/rollouts"] for r in rows if "samples/rollouts" in r)
    assert table["_type"] == "table-file" and table["ncols"] == 6 + 3 * NUM_AGENTS + 3
    run_record = next(r.run for r in records(datastore) if r.HasField("run"))
    assert list(run_record.tags) == ["ci", "tiny"]
    (artifact,) = [r.artifact for r in records(datastore) if r.HasField("artifact") and r.artifact.type == "model"]
    assert artifact.name.endswith("-adapters")
    assert {e.path for e in artifact.manifest.contents} >= {"agent_0/adapter_model.safetensors",
                                                           "agent_1/adapter_model.safetensors"}
