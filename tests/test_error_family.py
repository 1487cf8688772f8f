"""One error family: every error magrpo raises on purpose is a MagrpoError, and the CLI turns any of
them into one line with exit code 2 (bad input) or 1 (training could not go on)."""
from __future__ import annotations

import inspect

import pytest

import magrpo.errors as errors
from magrpo import cli


def test_every_error_class_is_a_magrpo_error():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, BaseException)]
    assert {c.__name__ for c in classes} >= {"ConfigError", "TrainingError", "EnvError", "RewardError",
                                               "FeedbackError", "SyncError", "FetchError"}
    assert all(issubclass(c, errors.MagrpoError) for c in classes)


def test_the_envs_and_experts_errors_join_the_family():
    from magrpo.envs.code.problems import DatasetUnavailable
    from magrpo.external.expert.errors import ExpertError
    from magrpo.report import ReportError

    assert issubclass(DatasetUnavailable, errors.MagrpoError)
    assert issubclass(ExpertError, errors.ConfigError)
    assert ReportError.exit_code == 2


@pytest.mark.parametrize("error, code, prefix", [
    (errors.TrainingError("3 steps in a row had a NaN loss\nsecond line"), 1, "error: 3 steps in a row had a NaN loss"),
    (errors.SyncError("engine adapters are stale"), 1, "error: engine adapters are stale"),
    (errors.FetchError("no network"), 1, "error: no network"),
    (errors.ConfigError("trainer.lr", "must be > 0, got 0"), 2, "config error: trainer.lr: must be > 0, got 0"),
    (ValueError("boom"), 1, "error: unexpected ValueError: boom"),
])
def test_the_cli_reports_any_error_as_one_line_with_its_exit_code(monkeypatch, capsys, error, code, prefix):
    import magrpo.trainer as trainer

    def fail(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(trainer, "prepare", lambda cfg: None)
    monkeypatch.setattr(trainer, "train", fail)
    assert cli.main(["env=length_ratio", "model=tiny"]) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith(prefix) and "\n" not in err, err
