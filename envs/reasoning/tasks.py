"""The reasoning-gym library as the env sees it: imported on use (a one-line ConfigError naming the
extra when it is missing), a task's dataset built from env.task and env.task_config with every
complaint of the library as one line naming the key, and a split's problems drawn from it.
Nothing here loads a model, so every bad task or config stops the run before one loads."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from typing import Any, Callable, Mapping

from magrpo.errors import ConfigError, describe

EXTRA = "pip install 'magrpo[reasoning-gym]' (in a checkout: pip install -e '.[reasoning-gym]')"
# Keys the env sets per split: a task_config that fixed the seed would give both splits one seed.
OWN_KEYS = {"seed": "env.train_seed and env.eval_seed", "size": "env.train_size and env.eval_size"}
SPEC_KEYS = ("name", "weight", "config")  # one entry of a composite's `datasets`


ANSWER_READINGS = ("tags", "tag_or_last_number")  # env.answer_reading
LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def tag_or_last_number(text: str, extract: Callable[[str], str | None]) -> str | None:
    """The answer `extract` finds in the reply (its tag), else the reply's last number; None: neither."""
    tagged = extract(text)
    if tagged is not None:
        return tagged
    numbers = LAST_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reader(rg: Any, how: str) -> Callable[[str], str | None]:
    """How an answer is read from a reply: `tags`, the library's extract_answer (the last
    <answer>...</answer>; None without one); `tag_or_last_number`, the tag, else the reply's last number."""
    extract = rg.utils.extract_answer
    return extract if how == "tags" else functools.partial(tag_or_last_number, extract=extract)


def library() -> Any:
    """The reasoning_gym module; a ConfigError naming the extra when it cannot be imported."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError("env", f"env=reasoning_gym needs the optional package reasoning-gym ({describe(e)}); "
                                 f"install it with {EXTRA}") from None
    return reasoning_gym


def task_kwargs(rg: Any, task: str, config: Mapping[str, Any], task_key: str = "env.task",
                config_key: str = "env.task_config") -> dict[str, Any]:
    """`config` as the keyword arguments of the task's config dataclass: the task exists, every key is
    one of its config's and none is one the env sets; a composite's `datasets` become DatasetSpecs."""
    names = sorted(rg.factory.DATASETS)
    if task not in names:
        close = difflib.get_close_matches(str(task), names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(task_key, f"{task!r} is not a reasoning-gym task{hint}; choose one of: {', '.join(names)}")
    allowed = [f.name for f in dataclasses.fields(rg.factory.DATASETS[task][1]) if f.name not in OWN_KEYS]
    for key in config:
        if key in OWN_KEYS:
            raise ConfigError(f"{config_key}.{key}", f"the env sets it for each split: use {OWN_KEYS[key]}")
        if key not in allowed:
            raise ConfigError(f"{config_key}.{key}", f"not a key of task {task!r}; allowed: {', '.join(allowed)}")
    kwargs = dict(config)
    if task == "composite":
        kwargs["datasets"] = composite_specs(rg, kwargs.get("datasets"), f"{config_key}.datasets")
    return kwargs


def composite_specs(rg: Any, datasets: Any, key: str) -> list[Any]:
    """A composite's datasets, each {name, weight (default 1), config (default {})}, as the library's
    DatasetSpecs, each checked like a task of its own."""
    if not isinstance(datasets, list) or not datasets:
        raise ConfigError(key, "a composite needs a list of tasks, e.g. "
                               "'+env.task_config.datasets=[{name: basic_arithmetic}, {name: chain_sum, weight: 2}]'")
    from reasoning_gym.composite import DatasetSpec

    specs = []
    for i, spec in enumerate(datasets):
        where = f"{key}[{i}]"
        if not isinstance(spec, Mapping) or "name" not in spec or set(spec) - set(SPEC_KEYS):
            raise ConfigError(where, "expected a mapping with keys name, weight (default 1), config (default {})")
        if spec["name"] == "composite":
            raise ConfigError(f"{where}.name", "a composite cannot hold another composite")
        config = spec.get("config") or {}
        if not isinstance(config, Mapping):
            raise ConfigError(f"{where}.config", f"expected a mapping of task {spec['name']!r}'s keys, got {config!r}")
        kwargs = task_kwargs(rg, spec["name"], config, f"{where}.name", f"{where}.config")
        specs.append(DatasetSpec(name=spec["name"], weight=spec.get("weight", 1.0), config=kwargs))
    return specs


def make_dataset(rg: Any, task: str, kwargs: Mapping[str, Any], seed: int, size: int) -> Any:
    """The task's dataset; whatever the library finds wrong with the config is one line."""
    try:
        return rg.create_dataset(task, seed=seed, size=size, **kwargs)
    except Exception as e:  # noqa: BLE001  (the library's own checks: asserts, ValueError, a TypeError on a bad value)
        raise ConfigError("env.task_config", f"task {task!r} rejects it: {describe(e)}") from None


def draw(dataset: Any, task: str, count: int, skip: set[str], distinct: bool = False) -> list[dict[str, Any]]:
    """Up to `count` entries of `dataset` in index order whose question is not in `skip` (distinct: nor
    an earlier entry's)."""
    skip = set(skip)
    out: list[dict[str, Any]] = []
    for i in range(len(dataset)):
        if len(out) == count:
            break
        try:
            entry = dataset[i]
        except Exception as e:  # noqa: BLE001  (generation fails on a config the library's checks let through)
            raise ConfigError("env.task_config",
                              f"task {task!r} failed to generate problem {i}: {describe(e)}") from None
        if entry["question"] not in skip:
            out.append(entry)
            if distinct:
                skip.add(entry["question"])
    return out
