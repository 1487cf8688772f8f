"""The warm starts' one SFT helper (magrpo/sft.py) and the pinned child it builds in (magrpo/pinned.py):
the batched loss with its shared-prefix cache equals the loss computed row by row; a child really runs
the portable kernels; a warm start that cannot converge stops with one line that says what to do, in
the library and on the command line, and leaves no folder behind."""
from __future__ import annotations

import dataclasses
import random
import sys

import pytest
import torch
import torch.nn.functional as F

from magrpo import pinned, sft
from magrpo.envs import tool_arith_warm as warm
from magrpo.tiny import tiny_model_path
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_path(warm.WarmSpec().base)
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def row_by_row(model, batch, choices, target):
    """The loss of sft.loss written out plainly: one full forward per row, no cache, no padding."""
    tokens, total, decisions = 0.0, 0, []
    for e in batch:
        logits = model(input_ids=torch.tensor([e.ids])).logits[0]
        at = [t for t in range(1, len(e.ids)) if e.learn[t] and t != e.decide]
        tokens = tokens + F.cross_entropy(logits[[t - 1 for t in at]], torch.tensor([e.ids[t] for t in at]),
                                          reduction="sum")
        total += len(at)
        decisions.append((F.log_softmax(logits[e.decide - 1], -1)[choices] * target).sum())
    return tokens / total - torch.stack(decisions).mean()


def test_the_batched_cached_loss_equals_the_loss_row_by_row(tiny):
    tok, model = tiny
    rng = random.Random(0)
    batch = [warm.example(tok, *warm.transcript(rng, 0.5, 2)) for _ in range(6)]
    assert len({len(e.ids) for e in batch}) > 1  # calls and guesses: padding is exercised
    choices, target = torch.tensor(warm._choices(tok)), torch.tensor([0.2, 0.8])
    got = sft.loss(model, batch, choices, target, tok.pad_token_id)
    want = row_by_row(model, batch, choices, target)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    # The decision token is taught only by the decision loss, whatever the caller's mask says
    marked = [dataclasses.replace(e, learn=[*e.learn[:e.decide], True, *e.learn[e.decide + 1:]]) for e in batch]
    assert sft.loss(model, marked, choices, target, tok.pad_token_id).item() == pytest.approx(got.item(), rel=1e-6)


def test_a_pinned_child_runs_the_portable_kernels(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch, os\nprint(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), "
                     "os.environ['MKL_CBWR'])\n")
    proc = pinned.run(["--call", "runpy:run_path", f'{{"path_name": "{probe}"}}'], capture_output=True,
                      text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["AVX2", "1", "COMPATIBLE,STRICT"]
    with pytest.raises(RuntimeError, match="pinned kernels: not set"):  # this process is not pinned
        pinned.check()


BROKEN = warm.WarmSpec(steps=1, max_steps=1, checks=2)  # far too few steps to copy anything


def test_a_warm_start_that_does_not_converge_is_one_line_and_leaves_no_folder(tmp_path, capfd):
    # The base model from the shared cache (linked), the failed build's cache on its own
    base = tiny_model_path(BROKEN.base)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / base.name).symlink_to(base)
    with pytest.raises(sft.WarmStartError) as raised:
        warm.warm_model_path(BROKEN, cache_dir=tmp_path)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("tool_arith warm start: after 1 step greedy calls copy")
    assert "try another seed" in message
    assert not any((tmp_path / "tool_arith_warm").iterdir())  # no half-built folder in the cache
    err = capfd.readouterr().err
    assert "step 1" in err and "Traceback" not in err and "error:" not in err  # progress passed on, the error not


def test_a_warm_start_records_its_weights_hash_after_the_trace_steps(tmp_path):
    """warm_start.json holds the weights' sha256 after steps 1, 2, 5, ... (sft.TRACE_STEPS): two machines whose
    builds part (the pins are not bit-exact across CPU vendors) can find the first step where they do."""
    import json

    spec = warm.WarmSpec(steps=2, check_every=1, copy_share=0.0, checks=2)  # stops after step 2
    base = tiny_model_path(spec.base)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / base.name).symlink_to(base)
    record = json.loads((warm.warm_model_path(spec, cache_dir=tmp_path) / "warm_start.json").read_text())
    trace = record["trace_sha256"]
    assert record["steps"] == 2 and sorted(trace) == ["1", "2"]
    assert trace["1"] != trace["2"] and all(len(value) == 64 for value in trace.values())


def test_the_warm_start_command_prints_one_line_and_exits_1(capsys):
    def build():
        raise sft.WarmStartError("tool_arith warm start: after 2 steps ...; try another seed")

    assert sft.main_printing(build) == 1
    assert capsys.readouterr().err.splitlines() == ["error: tool_arith warm start: after 2 steps ...; try another seed"]


def test_the_command_line_takes_a_seed():
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "magrpo.envs.tool_arith_warm", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "--seed" in proc.stdout


def test_progress_says_the_step_the_most_steps_and_how_long_the_rest_takes(tiny, capsys):
    """A warm start that runs for many minutes said only its step and loss: no way to know how long."""
    tok, model = tiny
    rng = random.Random(0)
    batches = ([warm.example(tok, *warm.transcript(rng, 0.5, 2))] for _ in range(4))
    steps = sft.fit(model, batches, choices=warm._choices(tok), target=[0.5, 0.5], pad_id=tok.pad_token_id,
                    lr=0.0, label="probe", log_every=2, total=10)
    lines = capsys.readouterr().err.splitlines()
    assert steps == 4 and len(lines) == 2
    assert lines[0].startswith("probe: step 2 of at most 10 loss ") and " s more)" in lines[0]
