"""Command line: compose `configs/` with Hydra overrides, turn every bad input into one line.

We use Hydra's compose API rather than `@hydra.main` so that a wrong key, type or group option is
reported as a single `config error: ...` line (exit 2) instead of Hydra's multi-line report, and so
runs keep their own run directory layout.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import warnings
from pathlib import Path
from typing import Sequence

from .config import TrainConfig
from .errors import ConfigError, MagrpoError

# Installed, the YAML files ship inside the package (pyproject.toml); in a checkout they sit at its top.
_HERE = Path(__file__).resolve().parent
CONFIG_DIR = _HERE / "configs" if (_HERE / "configs").is_dir() else _HERE.parent / "configs"
USAGE = """usage: python train.py [key=value ...] [group=option ...] [--cfg] [--help]

  key=value      override any config key, e.g. trainer.num_turns=3 trainer.joint_mode=cross
  group=option   pick a config file from configs/<group>/, e.g. external=plain model=hf
  --cfg          print the composed config and exit
Groups: {groups}
All keys and their meaning: docs/configuration.md and magrpo/config.py."""


def register_schema() -> None:
    """TrainConfig as the schema, and one `env=NAME` option per registered env holding its Config's
    defaults (the env's defaults live once, in its Config; `env=other` replaces the whole node)."""
    from hydra.core.config_store import ConfigStore

    from . import envs  # noqa: F401  (the built-in envs: their options exist whoever composes)
    from .env import ENVS

    store = ConfigStore.instance()
    store.store(name="base_train", node=TrainConfig)
    for name in ENVS.names():
        store.store(group="env", name=name, node={"name": name, **dataclasses.asdict(ENVS.get(name).Config())})


def group_options(group: str, config_dir: Path = CONFIG_DIR) -> list[str]:
    """The options of a config group: its YAML files (and, for env, every registered env)."""
    from .env import ENVS

    files = {p.stem for p in (config_dir / group).glob("*.yaml")}
    return sorted(files | set(ENVS.names()) if group == "env" else files)


def compose(overrides: Sequence[str], config_dir: Path = CONFIG_DIR) -> TrainConfig:
    """Composed, type-checked config as a TrainConfig instance; raises ConfigError on bad input."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            cfg = hydra_compose(config_name="train", overrides=list(overrides))
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _from_omegaconf(e) from None
    except Exception as e:  # hydra's own errors: composition, override syntax, missing group option
        cause = e.__cause__ or e.__context__
        if isinstance(cause, OmegaConfBaseException):
            raise _from_omegaconf(cause) from None
        raise _from_hydra(e, config_dir) from None


def _from_omegaconf(e) -> ConfigError:
    key = getattr(e, "full_key", None) or "config"
    msg = str(getattr(e, "msg", e)).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        parent, _, leaf = key.rpartition(".")
        return ConfigError(key, f"unknown key; allowed under {parent or 'the top level'}: {', '.join(_fields_at(parent))}")
    return ConfigError(key, msg)


def _from_hydra(e: Exception, config_dir: Path) -> ConfigError:
    text = " ".join(str(e).split())
    missing = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = group_options(group, config_dir)
        return ConfigError(group, f"no option {option!r}; choose one of: {', '.join(options)}")
    bad_key = re.search(r"Could not override '([^']+)'", text) or re.search(r"Key '([^']+)'", text)
    if bad_key:
        key = bad_key.group(1)
        parent = key.rpartition(".")[0]
        return ConfigError(key, f"unknown key; allowed under {parent or 'the top level'}: {', '.join(_fields_at(parent))}")
    return ConfigError("overrides", text)


def _fields_at(path: str) -> list[str]:
    if path == "env" or path.startswith("env."):  # env keys are the registered envs' own Config fields
        return _env_fields(path.split(".")[1:])
    node: type = TrainConfig
    for part in [p for p in path.split(".") if p]:
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return []
        default = fields[part].default_factory() if fields[part].default_factory is not dataclasses.MISSING else None
        if not dataclasses.is_dataclass(default):
            return []
        node = type(default)
    return [f.name for f in dataclasses.fields(node)]


def _env_fields(parts: list[str]) -> list[str]:
    import typing

    from .env import ENVS

    names: set[str] = set()
    for env in ENVS.names():
        node: object = ENVS.get(env).Config
        for part in parts:
            node = typing.get_type_hints(node).get(part) if dataclasses.is_dataclass(node) else None
        if dataclasses.is_dataclass(node):
            names.update(f.name for f in dataclasses.fields(node))
    return (["name"] if not parts else []) + sorted(names)


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if any(a in ("-h", "--help") for a in args):
        groups = ", ".join(sorted({p.name for p in CONFIG_DIR.iterdir() if p.is_dir()} | {"env"}))
        print(USAGE.format(groups=groups))
        return 0
    show = "--cfg" in args
    overrides = [a for a in args if a != "--cfg"]
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        print(f"config error: {bad[0]}: unknown flag; use key=value overrides (see --help)", file=sys.stderr)
        return 2
    # peft calls a deprecated transformers property on every model load: noise for our users.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # Registries are filled by importing the built-in envs and feedback modes.
    from . import envs, external  # noqa: F401
    from .trainer import prepare, train

    try:
        cfg = compose(overrides)
        prepared = prepare(cfg)
        if show:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            return 0
        train(cfg, prepared)
    except MagrpoError as e:  # ours: bad input (exit 2; a hub id that cannot be fetched is found only while loading) or a stop (1)
        return report("config error" if isinstance(e, ConfigError) else "error", e, e.exit_code)
    except KeyboardInterrupt as e:  # a second signal (or Ctrl-C during start-up)
        return report("stopped", e, 130, "interrupted; resume=auto continues from the last complete checkpoint, if any")
    except Exception as e:  # noqa: BLE001  (user code and everything else: one line, traceback kept)
        return report("error", e, 1)
    return 0


DEBUG_VAR = "MAGRPO_DEBUG"  # =1: print the full traceback above the one-line error


def report(kind: str, error: BaseException, code: int, text: str | None = None) -> int:
    """One line on stderr: `kind: message` plus where the traceback is; returns the exit code."""
    import os
    import traceback

    from .errors import describe

    if os.environ.get(DEBUG_VAR, "") not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
    # Our own errors (every MagrpoError, and the built-in envs' and feedback modes' own) are written as
    # one line for the user; anything else is unexpected and says its type.
    ours = isinstance(error, MagrpoError) or type(error).__module__.startswith(("magrpo.envs.", "magrpo.external."))
    line = text or (" ".join(str(error).split()) if ours else f"unexpected {describe(error)}")
    where = [n for n in getattr(error, "__notes__", []) if n.startswith("traceback in ")]
    hint = f" ({where[0]}; {DEBUG_VAR}=1 prints it)" if where else (f" ({DEBUG_VAR}=1 prints the traceback)" if code == 1 else "")
    print(f"{kind}: {line}{hint}", file=sys.stderr)
    return code
