"""Guards: NaN/inf updates are skipped and counted, too many in a row stop the run; an env that
raises or returns NaN is named (reward.on_error=raise) or scored 0 as a leaf (zero)."""
from __future__ import annotations

import json
import math
import os

import pytest

import magrpo.update
from magrpo.config import ExternalConfig
from magrpo.errors import RewardError, TrainingError
from magrpo.feedback import Feedback
from magrpo.rollout import expand_trees
from magrpo.trainer import train
from tests.fakes import PROBLEMS, SAMPLING, TEXT, FakeBackend, FakeEnv, tree_settings


def nan_loss_on(calls_to_poison):
    """policy_loss whose result is NaN on the given (1-based) calls."""
    real, count = magrpo.update.policy_loss, {"n": 0}

    def poisoned(*args, **kwargs):
        count["n"] += 1
        loss, stats = real(*args, **kwargs)
        return (loss * math.nan if count["n"] in calls_to_poison else loss), stats

    return poisoned


def test_nan_update_is_skipped_counted_and_training_goes_on(make_cfg, monkeypatch):
    monkeypatch.setattr(magrpo.update, "policy_loss", nan_loss_on({1}))  # agent 0's first micro-batch
    run = train(make_cfg("trainer.steps=2", "trainer.kl_coef=0.01"))  # KL: every row trains, so the loss is called
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["train/agent_0/skipped_updates"] for m in metrics] == [1.0, 0.0]
    assert [m["train/agent_1/skipped_updates"] for m in metrics] == [0.0, 0.0]


def test_too_many_bad_steps_in_a_row_stop_with_a_clear_error(make_cfg, monkeypatch):
    monkeypatch.setattr(magrpo.update, "policy_loss", nan_loss_on(set(range(1, 1000))))
    cfg = make_cfg("trainer.steps=5", "trainer.kl_coef=0.01", "trainer.max_bad_steps=2", "checkpoint.every=1")
    with pytest.raises(TrainingError, match=r"^3 steps in a row .*\(trainer\.max_bad_steps=2\)"):
        train(cfg)
    import torch

    # the checkpoints before the stop hold the untouched (finite) weights
    state = torch.load(f"{cfg.logging.run_dir}/checkpoints/step_000002/agent_0/train.pt", weights_only=False)
    assert all(torch.isfinite(p).all() for p in state["params"])


def failing_on_k1_of_agent0(problem, texts):
    """Raises for joint actions whose agent-0 completion is sample k=1, NaN for k=2, else index sum."""
    k = int(TEXT.match(texts[0]).group(2))
    if k == 1:
        raise ZeroDivisionError("the grader divided by zero")
    return math.nan if k == 2 else float(k)


def expand(on_error):
    env = FakeEnv(2, failing_on_k1_of_agent0)
    settings = tree_settings(num_generations=3, num_turns=2, joint_mode="align", on_reward_error=on_error)
    return expand_trees(PROBLEMS, env, FakeBackend(), Feedback(ExternalConfig(), env, lambda **kw: ["x", "y"]),
                        settings, SAMPLING)


def test_raising_env_is_named_with_the_joint_action():
    with pytest.raises(RewardError, match=r"env FakeEnv \(tests\.fakes\.FakeEnv\.rewards\) failed on joint action 1 "
                                          r"of turn 0 \(problem 'P0'.*ZeroDivisionError: the grader divided by zero; "
                                          r"set reward.on_error=zero"):
        expand("raise")


def test_nan_reward_is_named_too():
    env = FakeEnv(2, lambda problem, texts: math.nan)
    settings = tree_settings(num_generations=2, num_turns=1, joint_mode="align")
    with pytest.raises(RewardError, match="joint action 0 of turn 0 .*non-finite reward nan"):
        expand_trees(PROBLEMS, env, FakeBackend(), Feedback(ExternalConfig(), env, lambda **kw: ["x", "y"]),
                     settings, SAMPLING)


def test_zero_mode_scores_failures_zero_as_leaves_and_counts_them():
    rollout = expand("zero")
    roots = [n for n in rollout.nodes if n.turn == 0]
    for node in roots:  # align K=3: joint j is sample j of both agents; 1 raises, 2 is NaN
        assert node.rewards.tolist() == [0.0, 0.0, 0.0]
        assert node.terminated.tolist() == [False, True, True]
        assert [c is None for c in node.children] == [False, True, True]
    assert rollout.reward_errors == 2 * 2 + 2 * 2  # per turn: 2 trees x 2 failing joint actions


def test_update_out_of_memory_halves_the_micro_batch_once(make_cfg, monkeypatch, capsys):
    import magrpo.update as update

    # a packed micro-batch has one row of targets per sample: fail above 4 samples
    real = update.forward_logprobs
    monkeypatch.setattr(update, "forward_logprobs",
                        lambda model, batch, *args, **kwargs: _oom_if(batch.targets.shape[0] > 4)
                        or real(model, batch, *args, **kwargs))
    run = train(make_cfg("trainer.steps=1", "trainer.kl_coef=0.01", "trainer.micro_batch_size=8", "eval.at_end=false"))
    assert "out of memory; retrying with trainer.micro_batch_size=4" in capsys.readouterr().err
    assert (run / "adapters" / "agent_0").is_dir()


def test_update_out_of_memory_twice_names_the_setting(make_cfg, monkeypatch):
    import magrpo.update as update

    monkeypatch.setattr(update, "forward_logprobs", lambda model, batch, *args, **kwargs: _oom_if(True))
    with pytest.raises(TrainingError,
                       match="out of memory again with trainer.micro_batch_size=16; lower trainer.micro_batch_size"):
        train(make_cfg("trainer.steps=1", "trainer.kl_coef=0.01", "eval.at_end=false"))


def test_generation_out_of_memory_halves_the_decode_batch(make_cfg, monkeypatch, capsys):
    from magrpo.backends.hf import HFBackend

    real = HFBackend._generate_rows
    monkeypatch.setattr(HFBackend, "_generate_rows",
                        lambda self, requests, rows, *rest: _oom_if(len(rows) > 4) or real(self, requests, rows, *rest))
    train(make_cfg("trainer.steps=1", "eval.at_end=false"))  # B=2, N=2, K=2: 8 rows at turn 0
    assert "retrying with generation.max_batch_rows=4" in capsys.readouterr().err


def _oom_if(condition):
    import torch

    if condition:
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
    return None


def test_a_signal_finishes_the_step_and_a_later_second_one_stops_at_once(monkeypatch, capfd):
    """Ctrl-C under torchrun reaches a process twice at once (terminal + torchrun's forward): that is
    one request to stop after the step; a second signal seconds later is an impatient user: the
    process ends at once (os._exit: no thread to join), 128 + its number."""
    import signal
    import time

    from magrpo.console import StopSignals

    class Exited(BaseException):
        pass

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", exit_)
    stop = StopSignals()
    try:
        stop.ready()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal is signal.SIGINT
        os.kill(os.getpid(), signal.SIGTERM)  # the forwarded copy: ignored
        assert stop.signal is signal.SIGINT
        stop.since = time.monotonic() - stop.REPEAT_S - 0.1
        with pytest.raises(Exited) as exited:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exited.value.args == (128 + signal.SIGTERM,)
        assert capfd.readouterr().err.splitlines()[-1] == (
            "stopped: SIGTERM again: stopped at once, without a checkpoint; resume=auto continues from the last "
            "complete checkpoint, if any")
    finally:
        stop.restore()


def test_a_signal_during_start_up_stops_at_once():
    """Before the run is ready (models loading) there is no step to finish: the signal stops it now."""
    import signal

    from magrpo.console import Interrupted, StopSignals

    with StopSignals():
        with pytest.raises(Interrupted, match="^SIGTERM during start-up, before the first step$") as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.exit_code == 143


class SignalledWorld:
    """A 2-process world seen from rank 0, where only rank 1 got the signal (SIGINT)."""

    is_main, size = True, 2

    def gather(self, obj):
        return [obj, 2]

    def broadcast(self, obj):
        return obj


@pytest.mark.parametrize("world, got, code", [(None, "SIGTERM", 143), (SignalledWorld(), None, 130)])
def test_a_stop_by_signal_exits_128_plus_its_number_with_one_line(tmp_path, capsys, world, got, code):
    """A SIGTERM used to finish the step, checkpoint and exit 0: a scheduler read the unfinished run as
    done. Every rank now exits with the signal some rank got (as a shell reports it: 128 + n)."""
    import signal
    from types import SimpleNamespace

    from magrpo.cli import guarded
    from magrpo.distributed import World
    from magrpo.trainer import Run

    run = SimpleNamespace(world=world or World(), stop=SimpleNamespace(signal=got and signal.Signals[got]),
                          dir=tmp_path)

    def stop():
        raise Run.stopped(run, 3)

    name = got or "SIGINT"
    assert guarded(stop) == (code, f"stopped: {name} after step 3; checkpoint written, continue with resume=auto "
                                   f"logging.run_dir={tmp_path}")
    assert capsys.readouterr().err.count("\n") == 1
