"""Plugins: your own modules, imported before the config is composed, so that what they register
(envs, feedback modes, baselines, credit rules, ...) is selectable by name like a built-in; and
`env.name=package.module:Class`, an env class used without registering it.

    python train.py plugins=[my_pkg.envs,my_feedback] env=my_env external.mode=my_mode
    MAGRPO_PLUGINS=my_pkg.envs,my_feedback python train.py env=my_env
    python train.py env.name=my_pkg.envs:MyEnv env.n=16

Modules are imported from the current directory or anywhere on the Python path.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

from .errors import ConfigError, describe

PLUGINS_VAR = "MAGRPO_PLUGINS"  # comma-separated modules, imported before those of `plugins=`


def import_module(key: str, name: str) -> ModuleType:
    """Import a user's module by dotted name; one that cannot be found, or raises while it is imported
    (a SyntaxError included), is a ConfigError on `key` (`plugins`, `external.mode`, ...).
    The current directory comes first on the path: `python train.py` puts only train.py's own
    folder there, yet a user's package usually sits where they run it."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(key, f"cannot import module {name!r} ({e})") from None
    except ConfigError:  # the module's own one-line error
        raise
    except Exception as e:
        raise ConfigError(key, f"importing module {name!r} raised {describe(e)}") from e


def requested(overrides: Sequence[str], environ: Mapping[str, str], config_file: Path | None = None) -> list[str]:
    """Plugin modules named by $MAGRPO_PLUGINS, the `plugins` key of a user's config file and the
    `plugins=` overrides, in that order, each once."""
    names = [n for n in environ.get(PLUGINS_VAR, "").replace(" ", ",").split(",") if n]
    if config_file is not None and config_file.is_file():
        import yaml

        loaded = yaml.safe_load(config_file.read_text())
        names += _as_list(loaded.get("plugins") if isinstance(loaded, dict) else None)
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "plugins":
            names += _as_list(parse_value(override) if value else None)
    return list(dict.fromkeys(names))


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def parse_value(override: str) -> Any:
    """The value of one override as Hydra reads it (`[a,b]` a list; `a,b` a sweep: every module of it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    try:
        parsed = OverridesParser.create().parse_overrides([override])[0]
    except Exception:  # noqa: BLE001  (bad syntax: composing reports it, as one line)
        return None
    value = parsed.value()
    if isinstance(value, ChoiceSweep):
        return [v for item in value.list for v in _as_list(item)]
    return value


def load(names: Sequence[str]) -> None:
    for name in names:
        import_module("plugins", name)


def env_class(path: str) -> str:
    """`package.module:Class` -> the class, registered in ENVS under that very string (so config.json
    names it and a resume finds it); returns the name."""
    from .env import ENVS, Environment

    module_name, _, attr = path.partition(":")
    cls = getattr(import_module("env.name", module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError("env.name", f"{path!r}: {module_name} has no Environment subclass named {attr!r}")
    if not hasattr(cls, "Config"):
        raise ConfigError("env.name", f"{path!r} has no nested dataclass Config (its env.* keys)")
    ENVS.register(path)(cls)
    return path
