"""`magrpo.train(config, env=..., feedback=...)`: a run from Python, checked exactly like
`python train.py` (the same composition of configs/, the same one-line ConfigErrors) before any
model loads. docs/python-api.md shows it in use."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from .config import TrainConfig
from .env import ENVS, Environment
from .errors import ConfigError
from .feedback import FeedbackMode, FeedbackTarget

ConfigLike = Union[TrainConfig, Mapping[str, Any], Sequence[str], None]
EnvLike = Union[Environment, type, str, None]
FeedbackLike = Union[FeedbackTarget, str, None]
# Sections that a string value picks as a config group option, as `model=tiny` does on the command line.
GROUP_SECTIONS = ("model", "external", "experiment")


def train(config: ConfigLike = None, *, env: EnvLike = None, feedback: FeedbackLike = None) -> Path:
    """Train and return the run dir.

    config: a TrainConfig, a mapping of keys (`{"trainer": {"steps": 2}, "model": "tiny"}`; a string
    under model/external/experiment picks that group option) or a list of `key=value` overrides as
    on the command line; None: `python train.py`'s defaults. A mapping or TrainConfig is applied on
    top of those defaults. env: an Environment instance (used as built), an Environment subclass, or
    a registered name / `package.module:Class`; it replaces the config's env. feedback: a per-branch
    function (docs/feedback.md), a FeedbackMode subclass, or a mode name / `package.module:function`.
    Every bad value raises the ConfigError the command line would print.
    """
    from .trainer import train as run_training

    cfg, instance, target = configure(config, env=env, feedback=feedback)
    return run_training(cfg, instance, target)


def configure(
    config: ConfigLike = None, *, env: EnvLike = None, feedback: FeedbackLike = None
) -> tuple[TrainConfig, Environment | None, FeedbackTarget | None]:
    """The composed, type-checked config; the env instance to use (or None: made from cfg.env); the
    feedback function or mode class to use (or None: cfg.external.mode)."""
    from .cli import compose_run

    overrides, values = _split(config)
    overrides += _group_choices(values)
    instance = env if isinstance(env, Environment) else None
    if env is not None:
        overrides.append(f"env.name={_select_env(env, values)}")
    target = None
    if feedback is not None:
        target = _select_feedback(feedback, values, overrides)
    cfg = compose_run(overrides, values=values)[0]
    if target is not None:  # recorded in config.json: which function ran
        cfg.external.mode = _label(target)
    return cfg, instance, target


def _label(target: Any) -> str:
    """`module:name` of a function or class (what external.mode=module:name would name)."""
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}:{getattr(target, '__qualname__', type(target).__qualname__)}"


def _split(config: ConfigLike) -> tuple[list[str], dict[str, Any]]:
    """(overrides, nested values) of what the user passed as config."""
    if config is None:
        return [], {}
    if isinstance(config, TrainConfig):
        return [], dataclasses.asdict(config)
    if isinstance(config, Mapping):
        from omegaconf import DictConfig, OmegaConf

        plain = OmegaConf.to_container(config) if isinstance(config, DictConfig) else config
        return [], copy.deepcopy(dict(plain))
    if isinstance(config, Sequence) and not isinstance(config, str) and all(isinstance(o, str) for o in config):
        return list(config), {}
    raise ConfigError(
        "config", f"expected a TrainConfig, a mapping of keys or a list of key=value overrides, got {config!r}"
    )


def _group_choices(values: dict[str, Any]) -> list[str]:
    """Overrides for what the values pick rather than set: group options, the env, plugins (imported
    before composing, so what they register can be named)."""
    out = [f"{'+' if section == 'experiment' else ''}{section}={values.pop(section)}"
           for section in GROUP_SECTIONS if isinstance(values.get(section), str)]
    env = values.get("env")
    if isinstance(env, str):
        out.append(f"env.name={values.pop('env')}")
    elif isinstance(env, Mapping) and "name" in env:
        out.append(f"env.name={env['name']}")  # the whole node of that env, then these keys
        values["env"] = {k: v for k, v in env.items() if k != "name"}
    plugins = values.pop("plugins", None) or []
    if plugins:
        out.append(f"plugins=[{','.join(plugins)}]")
    return out


def _select_env(env: EnvLike, values: dict[str, Any]) -> str:
    """The env's name for `env.name=`; the config's env keys are kept only when they name no other env."""
    if isinstance(env, str):
        name = env
    else:
        cls = type(env) if isinstance(env, Environment) else env
        name = _registered_env(cls)
    given = values.get("env")
    if isinstance(given, Mapping) and given.get("name", name) != name:
        values.pop("env")  # keys of the config's own env, replaced as `env=X` replaces the whole node
    if isinstance(env, Environment):
        values["env"] = {**values.get("env", {}), **_env_keys(env)}
    return name


def _registered_env(cls: Any) -> str:
    """The name an Environment subclass is registered under; an unregistered one is registered as
    `module:Class`, the name `env.name=module:Class` gives it (a class defined anew, as in a notebook
    cell run again, takes the name over)."""
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError("env", f"expected an Environment instance or subclass or an env name, got {cls!r}")
    if not hasattr(cls, "Config"):
        raise ConfigError("env", f"{cls.__qualname__} has no nested dataclass Config (its env.* keys)")
    for name in ENVS.names():
        if ENVS.get(name) is cls:
            return name
    name = f"{cls.__module__}:{cls.__qualname__.replace('<locals>.', '')}"
    ENVS.replace(name, cls)
    return name


def _env_keys(env: Environment) -> dict[str, Any]:
    """An env instance's settings, so that config.json and the checks see what it runs with."""
    if not (dataclasses.is_dataclass(env.cfg) and isinstance(env.cfg, type(env).Config)):
        raise ConfigError("env", f"{type(env).__qualname__}.cfg must be an instance of its Config dataclass")
    return dataclasses.asdict(env.cfg)


def _select_feedback(feedback: FeedbackLike, values: dict[str, Any], overrides: list[str]) -> FeedbackTarget | None:
    """A mode name sets external.mode (a name with its own configs/external file picks that option,
    as `external=NAME` would); a function or FeedbackMode subclass is returned to be used as is."""
    from .cli import group_options

    if isinstance(feedback, str):
        if feedback in group_options("external"):
            overrides.append(f"external={feedback}")
        values.setdefault("external", {})["mode"] = feedback
        return None
    if isinstance(feedback, type) and issubclass(feedback, FeedbackMode) or (
        callable(feedback) and not isinstance(feedback, type)
    ):
        return feedback
    raise ConfigError(
        "feedback", f"expected a feedback function, a FeedbackMode subclass or a mode name, got {feedback!r}"
    )
