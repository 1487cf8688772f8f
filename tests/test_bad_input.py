"""Bad input found at start-up (issue 13, point 4): data, devices, paths and numeric ranges are
checked before any model loads. Each case is one line naming the key, exit code 2, no run dir."""
from __future__ import annotations

import json
import time

import pytest
import torch

from tests.conftest import SMALL

CODE = ["env=code", "model=tiny", "external=plain", "env.train_split='test[:2]'", "env.eval_split='test[2:3]'"]


@pytest.fixture
def run_main(run_cli):
    """main(SMALL + overrides): (exit code, stderr lines); see run_cli in conftest.py."""
    return lambda *overrides: run_cli(*SMALL, *overrides)


def jsonl(path, *lines: str) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = json.dumps({"task_id": "t/0", "prompt": "def f(x):\n",
                   "test": "def check(candidate):\n    assert candidate(1)\n", "entry_point": "f"})

# (overrides, key named by the line, words the line must contain); {tmp} is the test's folder
CASES = [
    (["env.train_size=0"], "env.train_size", [">= 1"]),
    (["trainer.early_termination_return=twice"], "trainer.early_termination_return",
     ["'twice' is not allowed", "reward, repeat"]),
    (["env.eval_size=0"], "env.eval_size", ["0 selects no eval problems", "eval.at_end=false"]),
    ([*CODE, "env.train_split='test[500:]'"], "env.train_split", ["'test[500:]' selects no train problems"]),
    ([*CODE, "env.eval_split='test[200:]'"], "env.eval_split", ["'test[200:]' selects no eval problems"]),
    ([*CODE, "env.train_split='train[:2]'"], "env.train_split", ["unknown split 'train'"]),
    ([*CODE, "env.dataset={tmp}/missing.jsonl"], "env.dataset", ["missing.jsonl: no such file"]),
    ([*CODE, "env.dataset={tmp}/bad.jsonl"], "env.dataset", ["bad.jsonl line 3: not valid JSON"]),
    ([*CODE, "env.dataset={tmp}/fields.jsonl"], "env.dataset",
     ["fields.jsonl line 2: record lacks string field(s) test, entry_point"]),
    ([*CODE, "env.dataset={tmp}/list.jsonl"], "env.dataset", ["list.jsonl line 1: expected a JSON object"]),
    ([*CODE, "env.dataset={tmp}/empty.jsonl"], "env.dataset", ["empty.jsonl: no records (the file is empty)"]),
    ([*CODE, "env.dataset={tmp}/folder.jsonl"], "env.dataset", ["folder.jsonl: a folder, not a file"]),
    ([*CODE, "env.dataset={tmp}/broken.jsonl.gz"], "env.dataset", ["broken.jsonl.gz: cannot read it (BadGzipFile"]),
    ([*CODE, "env.dataset=mbpp"], "env.dataset", ["OpenMLRL/MBPP is unavailable", "env.dataset=path/to/mbpp.jsonl"]),
    ([*CODE, "env.dataset=apps"], "env.dataset", ["'apps' is not allowed", "humaneval, coophumaneval, mbpp"]),
    ([*CODE, "env.timeout_s=-1"], "env.timeout_s", ["> 0"]),
    ([*CODE, "env.timeout_s=0"], "env.timeout_s", ["> 0"]),
    ([*CODE, "env.workers=-1"], "env.workers", [">= 0"]),
    ([*CODE, "env.num_agents=0"], "env.num_agents", [">= 1", "N-1 helper writers + the entry point"]),
    ([*CODE, "env.reward.scale=nan"], "env.reward.scale", ["finite"]),
    (["model.device=cuda"], "model.device", ["no CUDA device", "auto or cpu"]),
    (["model.device=gpu"], "model.device", ["auto, cpu, cuda, cuda:N"]),
    (["logging.run_dir={tmp}/file"], "logging.run_dir", ["is a file, not a folder"]),
    (["logging.run_dir={tmp}/file/run"], "logging.run_dir", ["file' is a file, not a folder"]),
    (["logging.run_dir=/proc/magrpo-run"], "logging.run_dir", ["cannot write in '/proc'"]),
    (["logging.wandb.mode=online"], "logging.wandb.mode", ["WANDB_API_KEY", "wandb login"]),
    (["trainer.lr=nan"], "trainer.lr", ["finite"]),
    (["trainer.kl_coef=inf"], "trainer.kl_coef", ["finite"]),
    (["generation.temperature=nan"], "generation.temperature", ["finite"]),
    (["trainer.early_termination_threshold=nan"], "trainer.early_termination_threshold", ["finite"]),
    (["trainer.weight_decay=-0.1"], "trainer.weight_decay", [">= 0"]),
    (["trainer.clip_eps=0"], "trainer.clip_eps", ["> 0"]),
    (["trainer.seed=-1"], "trainer.seed", ["[0, 2**32)"]),
    (["lora.alpha=0"], "lora.alpha", ["> 0"]),
    (["lora.target_modules=[]"], "lora.target_modules", ["at least one"]),
    (["model.tiny_hidden_size=12"], "model.tiny_hidden_size", ["multiple of 8"]),
    (["model.tiny_layers=0"], "model.tiny_layers", [">= 1"]),
    (["model.name=''"], "model.name", ["is empty"]),
    (["env.ratio=0"], "env.ratio", ["> 0"]),
    (["env.target_chars=0"], "env.target_chars", [">= 1"]),
    (["env.num_agents=0"], "env.num_agents", [">= 1"]),
    (["agents=[{model:null},{model:null},{model:null}]"], "agents", ["3 entries for 2 agent(s)"]),
]


@pytest.mark.parametrize("overrides,key,words", CASES, ids=[" ".join(c[0][-1:]) for c in CASES])
def test_bad_input_is_one_line_exit_2_and_no_run_dir(run_main, tmp_path, overrides, key, words):
    jsonl(tmp_path / "bad.jsonl", GOOD, "", "{not json")
    jsonl(tmp_path / "fields.jsonl", GOOD, json.dumps({"task_id": "t/1", "prompt": "def g():\n"}))
    jsonl(tmp_path / "list.jsonl", "[1, 2]")
    jsonl(tmp_path / "empty.jsonl", "", "  ")
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    (tmp_path / "file").write_text("not a folder")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, lines = run_main(*[o.replace("{tmp}", str(tmp_path)) for o in overrides])
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"config error: {key}: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run dir, default or given


def test_empty_train_split_is_one_line_in_seconds(run_main):
    """It used to hang at 100% CPU in ProblemSampler.next (ignoring the first SIGTERM)."""
    start = time.monotonic()
    code, lines = run_main(*CODE, "env.train_split='test[164:]'")
    assert time.monotonic() - start < 10
    assert code == 2 and lines == ["config error: env.train_split: 'test[164:]' selects no train problems; "
                                   "give a split with at least one"]


def test_cuda_index_beyond_the_devices_is_one_line(run_main, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, lines = run_main("model.device=cuda:2")
    assert code == 2 and lines == ["config error: model.device: 'cuda:2' but this machine has 2 CUDA device(s): "
                                   "cuda:0 to cuda:1"]


def test_empty_eval_split_is_fine_when_evaluation_is_off(make_cfg):
    from magrpo.trainer import prepare

    env, _ = prepare(make_cfg("env.eval_size=0", "eval.at_end=false"))
    assert env.problems("train")


def test_problem_sampler_never_loops_on_no_problems():
    from magrpo.errors import TrainingError
    from magrpo.trainer import ProblemSampler

    with pytest.raises(TrainingError, match="no problems"):
        ProblemSampler([], seed=0).next(2)
