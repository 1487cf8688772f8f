"""Command line: compose `configs/` with Hydra overrides, turn every bad input into one line.

We use Hydra's compose API rather than `@hydra.main` so that a wrong key, type or group option is
reported as a single `config error: ...` line (exit 2) instead of Hydra's multi-line report, and so
runs keep their own run directory layout.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import plugins
from .config import TrainConfig
from .console import Interrupted
from .errors import ConfigError, MagrpoError, Stopped
from .registry import ENV_HINT, FEEDBACK_HINT

# Installed, the YAML files ship inside the package (pyproject.toml); in a checkout they sit at its top.
_HERE = Path(__file__).resolve().parent
CONFIG_DIR = _HERE / "configs" if (_HERE / "configs").is_dir() else _HERE.parent / "configs"
USAGE = """usage: python train.py [key=value ...] [group=option ...] [flags]

  key=value            override any config key, e.g. trainer.num_turns=3 trainer.joint_mode=cross
  group=option         pick a config file from configs/<group>/, e.g. external=plain model=hf
  +experiment=NAME     apply a preset from configs/experiment/ (run sizes, or a whole setup)
  plugins=[mod,...]    import your modules first (also $MAGRPO_PLUGINS): what they register is selectable
  env.name=pkg.mod:Cls an env class of yours, its Config's defaults as the env node
  --cfg job|hydra|all  print the composed config (job), the chosen options (hydra) or both, and exit
  --config-dir DIR     also look for configs in DIR (-cd); your YAML's defaults: may pick built-in groups
  --config-name NAME   the config to start from instead of train (-cn), e.g. a DIR/NAME.yaml of yours
  -m, --multirun       a run per combination of comma lists (trainer.lr=1e-3,1e-2 trainer.seed=0,1),
                       one after another, each in its own folder under runs/sweep-<time>, then a summary
Groups: {groups}
All keys and their meaning: docs/configuration.md and magrpo/config.py."""
CFG_PARTS = ("job", "hydra", "all")


@dataclasses.dataclass
class Args:
    overrides: list[str]
    show: str | None = None  # --cfg: job | hydra | all
    config_dir: Path | None = None  # --config-dir: searched before the built-in configs
    config_name: str = "train"
    multirun: bool = False
    help: bool = False


def parse_args(argv: Sequence[str]) -> Args:
    """Hydra's command-line flags, each accepted as `--flag value` or `--flag=value`; anything else
    starting with `-` is a ConfigError naming it."""
    args, rest = Args([]), list(argv)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("-"):
            args.overrides.append(arg)
            continue
        flag, eq, value = arg.partition("=")
        if flag in ("-h", "--help"):
            args.help = True
        elif flag in ("-m", "--multirun"):
            args.multirun = True
        elif flag in ("-c", "--cfg"):  # a bare --cfg (the next argument an override, or none) is --cfg job
            if not eq:
                value = rest.pop(0) if rest and "=" not in rest[0] and not rest[0].startswith("-") else "job"
            if value not in CFG_PARTS:
                raise ConfigError(flag, f"{value!r} is not allowed; choose one of: {', '.join(CFG_PARTS)}")
            args.show = value
        elif flag in ("-cd", "--config-dir", "-cn", "--config-name"):
            if not eq:
                if not rest or rest[0].startswith("-"):
                    raise ConfigError(flag, "needs a value (see --help)")
                value = rest.pop(0)
            if flag in ("-cd", "--config-dir"):
                if not Path(value).is_dir():
                    raise ConfigError(flag, f"{value!r} is not a folder")
                args.config_dir = Path(value).resolve()
            else:
                args.config_name = value.removesuffix(".yaml")
        else:
            raise ConfigError(
                arg,
                "unknown flag; use key=value overrides or one of: --cfg, --config-dir, --config-name, -m (see --help)",
            )
    return args


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


def group_options(group: str, config_dir: Path | None = None) -> list[str]:
    """The options of a config group: its YAML files (built-in and in config_dir) and, for env,
    every registered env."""
    from .env import ENVS

    files = {p.stem for d in (CONFIG_DIR, config_dir) if d is not None for p in (d / group).glob("*.yaml")}
    return sorted(files | set(ENVS.names()) if group == "env" else files)


def compose(overrides: Sequence[str], config_dir: Path | None = None, config_name: str = "train") -> TrainConfig:
    """Composed, type-checked config as a TrainConfig instance; raises ConfigError on bad input."""
    return compose_run(overrides, config_dir, config_name)[0]


def compose_run(
    overrides: Sequence[str], config_dir: Path | None = None, config_name: str = "train",
    values: Mapping[str, Any] | None = None,
) -> tuple[TrainConfig, dict]:
    """The config, and what composed it (config source, group choices, overrides, plugins) for --cfg hydra.
    Plugins are imported first so their envs are `env=` options and their registry names valid.
    `values`: nested keys set after the overrides (the Python API's config), checked like them."""
    import os

    from . import envs, external  # noqa: F401  (the built-ins register before any plugin)

    modules = plugins.requested(overrides, os.environ, primary(config_dir, config_name))
    plugins.load(modules)
    overrides = tools_shorthand(select_env(overrides))
    try:
        cfg, choices = _compose(overrides, config_dir, config_name, values)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (hydra's and omegaconf's errors: one line naming the key)
        raise _one_line(e, lambda: _selected_env(overrides, config_dir, config_name), config_dir, config_name) from None
    cfg.plugins = modules  # config.json records $MAGRPO_PLUGINS' modules too
    hydra = {"config_name": config_name, "config_dir": [str(d) for d in (config_dir, CONFIG_DIR) if d is not None],
             "choices": choices, "overrides": list(overrides), "plugins": modules}
    return cfg, hydra


def _compose(
    overrides: Sequence[str], config_dir: Path | None, config_name: str, values: Mapping[str, Any] | None = None
) -> tuple[TrainConfig, dict]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    register_schema()
    GlobalHydra.instance().clear()
    # A user's folder comes first (its files win), the built-in configs stay on the search path.
    extra = [f"hydra.searchpath=[file://{CONFIG_DIR}]"] if config_dir is not None else []
    overrides = _group_overrides(overrides, config_dir, config_name)
    with initialize_config_dir(config_dir=str(config_dir or CONFIG_DIR), version_base=None):
        cfg = hydra_compose(config_name=config_name, overrides=[*overrides, *extra], return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items()  # an optional option that is absent is no choice
               if not k.startswith("hydra/") and (v is None or v in group_options(k, config_dir))}
    with open_dict(cfg):
        del cfg["hydra"]
    if values:  # merged in struct mode: an unknown key or a wrong type fails as an override would
        cfg = OmegaConf.merge(cfg, values)
    if OmegaConf.get_type(cfg) is not TrainConfig:  # a user's YAML without base_train: check it all the same
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
    return OmegaConf.to_object(cfg), choices


def _group_overrides(overrides: Sequence[str], config_dir: Path | None, config_name: str) -> list[str]:
    """Group options checked; `+group=option` for a group the defaults list already has (train.yaml
    picks an experiment) means `group=option`: users need not know which groups a config picks."""
    from omegaconf import OmegaConf

    path, picked = primary(config_dir, config_name), set()
    if path.is_file():
        for entry in OmegaConf.to_container(OmegaConf.load(path)).get("defaults", []) or []:
            if isinstance(entry, dict):
                picked.update(k.removeprefix("optional ").removeprefix("override ").strip() for k in entry)
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        group = key.lstrip("+")
        # checked here: an `optional` group (experiment) would silently skip a misspelt option
        if group in groups(config_dir) and value != "null" and value not in group_options(group, config_dir):
            raise no_option(group, value, config_dir)
        out.append(o[1:] if key.startswith("+") and not key.startswith("++") and group in picked else o)
    return out


def no_option(group: str, value: str, config_dir: Path | None) -> ConfigError:
    """`group=value` names no option: the options, and for env and external how to add one's own."""
    hint = {"env": ENV_HINT, "external": FEEDBACK_HINT}.get(group)
    return ConfigError(group, f"no option {value!r}; choose one of: {', '.join(group_options(group, config_dir))}"
                       + (f"; {hint}" if hint else ""))


def primary(config_dir: Path | None, config_name: str) -> Path:
    """The file --config-name names: in the user's folder when it is there, else a built-in one."""
    mine = config_dir / f"{config_name}.yaml" if config_dir is not None else None
    return mine if mine is not None and mine.is_file() else CONFIG_DIR / f"{config_name}.yaml"


def groups(config_dir: Path | None = None) -> set[str]:
    """Config groups: the folders of configs/ (and of the user's folder), and env (from the registry)."""
    folders = {p.name for d in (CONFIG_DIR, config_dir) if d is not None for p in d.iterdir() if p.is_dir()}
    return {name for name in folders if not name.startswith(("_", "."))} | {"env"}


def tools_shorthand(overrides: Sequence[str]) -> list[str]:
    """`tools=[a,b]` (the issue's spelling) sets `tools.names`; the other `tools.*` keys stay as they are."""
    return [f"tools.names={o.partition('=')[2]}" if o.partition("=")[0].lstrip("+") == "tools" else o
            for o in overrides]


def select_env(overrides: Sequence[str]) -> list[str]:
    """`env.name=X` selects env X's whole node like `env=X` (its own Config's defaults, none of the
    default env's keys); X, and an `env=` option, may be `package.module:Class`."""
    from .env import ENVS

    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") in ("env", "env.name") and ":" in value and value not in ENVS:
            value = plugins.env_class(value)
        if key.lstrip("+") != "env.name":
            out.append(f"{key}={value}" if key == "env" else o)
            continue
        if value not in ENVS:
            raise ConfigError(
                "env.name",
                f"{value!r} is not allowed; choose one of: {', '.join(ENVS.names())}; {ENV_HINT}",
            )
        out.append(f"env={value}")  # like every group override: the last one given wins
    return out


def _selected_env(overrides: Sequence[str], config_dir: Path | None, config_name: str) -> str | None:
    """The env an erroneous command selects: composed again without its env.* keys."""
    try:
        kept = [o for o in overrides if not o.lstrip("+~").startswith("env.")]
        return _compose(kept, config_dir, config_name)[0].env.get("name")
    except Exception:  # noqa: BLE001
        return None


def _one_line(e: Exception, env_name, config_dir: Path | None, config_name: str) -> ConfigError:
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, OmegaConfBaseException):
        return _from_omegaconf(e, env_name)
    cause = e.__cause__ or e.__context__
    if isinstance(cause, OmegaConfBaseException):
        # An unknown key inside an entry of a list of dataclasses (agents, tools.mcp): omegaconf names only the
        # entry's key (`cmd`), hydra the list (`tools.mcp`).
        listed = re.search(r"Could not override '([^']+)'", str(e))
        element, inner = getattr(cause, "object_type", None), str(getattr(cause, "full_key", "") or "")
        if listed and dataclasses.is_dataclass(element) and "not in" in str(cause) and inner \
                and not (inner == listed.group(1) or inner.startswith(listed.group(1) + ".")):
            names = ", ".join(f.name for f in dataclasses.fields(element))
            return ConfigError(f"{listed.group(1)}[i].{inner}", f"unknown key; allowed: {names}")
        merging = re.search(r"Error merging override (([^=]+)=.*)", str(e), re.S)
        if merging and dataclasses.is_dataclass(element):
            # a mapping where a list belongs in an entry of a list of dataclasses, or the reverse:
            # omegaconf names no key (`tools.mcp=[{env: [A=1]}]`)
            wrong = _wrong_kind(merging.group(2).lstrip("+"), plugins.parse_value(merging.group(1)), element)
            if wrong:
                return wrong
        return _from_omegaconf(cause, env_name)
    return _from_hydra(e, env_name, config_dir, config_name)


def _wrong_kind(key: str, value: Any, element: type) -> ConfigError | None:
    """The first field of an entry of list `key` (entries of dataclass `element`) given a list or a
    mapping where its type takes none, or a single value where it takes only a list or a mapping."""
    import types
    import typing

    hints = typing.get_type_hints(element)
    shapes = {dict: "a mapping, e.g. {NAME: VALUE}", list: "a list, e.g. [a, b]"}
    for i, entry in enumerate(value if isinstance(value, list) else []):
        for name, given in (entry.items() if isinstance(entry, dict) else []):
            hint = hints.get(name)
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            kinds = {typing.get_origin(a) or a for a in (typing.get_args(hint) if union else (hint,))} - {type(None)}
            shape = dict if isinstance(given, dict) else list if isinstance(given, list) else None
            if not kinds or (shape in kinds if shape else not kinds <= set(shapes)):
                continue
            want = " or ".join(shapes.get(k, getattr(k, "__name__", str(k))) for k in kinds)
            return ConfigError(f"{key}[{i}].{name}", f"must be {want}; got {type(given).__name__} {given!r}")
    return None


# Config keys whose value is a free-form mapping: a new entry is added the Hydra way, with a leading +.
# An env's own are the fields of its Config typed `dict` (env=reasoning_gym's env.task_config).
FREE_MAPPINGS = ("model.chat_template_kwargs",)


def _unknown(key: str, env_name) -> ConfigError:
    parent = key.rpartition(".")[0]
    env_name = functools.cache(env_name)  # it composes the config again: once
    if parent in FREE_MAPPINGS or parent.startswith("env.") and _env_field_type(env_name(), parent) is dict:
        return ConfigError(key, f"to add an entry to {parent}, write +{key}=VALUE (Hydra's + adds a key)")
    return ConfigError(
        key, f"unknown key; allowed under {parent or 'the top level'}: {', '.join(_fields_at(parent, env_name))}"
    )


def _from_omegaconf(e, env_name) -> ConfigError:
    key = getattr(e, "full_key", None) or "config"
    msg = str(getattr(e, "msg", e)).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        return _unknown(key, env_name)
    return ConfigError(key, msg)


def _from_hydra(e: Exception, env_name, config_dir: Path | None, config_name: str) -> ConfigError:
    text = " ".join(str(e).split())
    missing = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if missing:
        return no_option(*missing.groups(), config_dir)
    if re.search(r"Cannot find primary config '([^']+)'", text):
        where = " or ".join(str(d) for d in (config_dir, CONFIG_DIR) if d is not None)
        return ConfigError("--config-name", f"no {config_name}.yaml in {where}")
    bad_key = re.search(r"Could not override '([^']+)'", text) or re.search(r"Key '([^']+)'", text)
    if bad_key:
        return _unknown(bad_key.group(1), env_name)
    return ConfigError("overrides", text)


def _fields_at(path: str, env_name) -> list[str]:
    if path == "env" or path.startswith("env."):  # env keys are the selected env's own Config fields
        return _env_fields(env_name(), path.split(".")[1:])
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


def _env_fields(env_name: str | None, parts: list[str]) -> list[str]:
    from .env import ENVS

    if env_name not in ENVS:
        return ["name"]
    node = _env_field_type(env_name, ".".join(["env", *parts]))
    names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
    return (["name"] if not parts else []) + sorted(names)


def _env_field_type(env_name: str | None, path: str) -> object:
    """The type of env key `path` ("env.reward.tests") in env `env_name`'s Config (None: no such key)."""
    import typing

    from .env import ENVS

    node: object = ENVS.get(env_name).Config if env_name in ENVS else None
    for part in path.split(".")[1:]:
        node = typing.get_type_hints(node).get(part) if dataclasses.is_dataclass(node) else None
    return node


def show(cfg: TrainConfig, hydra: dict, part: str) -> str:
    """What --cfg prints: the job's config, what composed it (`hydra:`), or both."""
    from omegaconf import OmegaConf

    job = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    meta = OmegaConf.to_yaml({"hydra": hydra})
    return {"job": job, "hydra": meta, "all": meta + job}[part]


def main(argv: Sequence[str]) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as e:
        return report("config error", e, 2)[0]
    if args.help:
        print(USAGE.format(groups=", ".join(sorted(groups(args.config_dir)))))
        return 0
    if args.multirun:
        from .sweep import sweep

        return sweep(args, run, guarded)
    return guarded(lambda: run(args))[0]


def run(args: Args, overrides: Sequence[str] | None = None, run_dir: Path | None = None, dry: bool = False) -> None:
    """Compose, check, then print (--cfg) or train (dry: check only). run_dir: a sweep's run folder."""
    from .trainer import prepare, train

    cfg, hydra = compose_run(args.overrides if overrides is None else overrides, args.config_dir, args.config_name)
    if run_dir is not None:  # set here, not as an override: a folder name may hold `=` and `,`
        cfg.logging.run_dir = str(run_dir)
    if dry or args.show:  # train() checks the config itself (prepare) before loading anything
        prepare(cfg)
        if args.show:
            print(show(cfg, hydra, args.show))
        return
    train(cfg)


def guarded(fn) -> tuple[int, str]:
    """fn() with every failure reported as one line: (exit code, that line; "" when fn returned)."""
    try:
        fn()
    except Stopped as e:  # by a signal, after a checkpoint: 128 + its number, as a shell would say
        return report("stopped", e, e.exit_code)
    except (
        MagrpoError
    ) as e:  # ours: bad input (exit 2; a hub id that cannot be fetched is found only while loading) or a stop (1)
        return report("config error" if isinstance(e, ConfigError) else "error", e, e.exit_code)
    except Interrupted as e:  # a signal while the run started: it stopped at once, its debris removed
        return report("stopped", e, e.exit_code, str(e))
    except KeyboardInterrupt as e:  # Ctrl-C before the run's handlers are installed (composing the config)
        return report("stopped", e, 130, "interrupted; resume=auto continues from the last complete checkpoint, if any")
    except Exception as e:  # noqa: BLE001  (user code and everything else: one line, traceback kept)
        return report("error", e, 1)
    return 0, ""


DEBUG_VAR = "MAGRPO_DEBUG"  # =1: print the full traceback above the one-line error


def report(kind: str, error: BaseException, code: int, text: str | None = None) -> tuple[int, str]:
    """One line on stderr: `kind: message` plus where the traceback is; returns the exit code and the line."""
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
    hint = (
        f" ({where[0]}; {DEBUG_VAR}=1 prints it)"
        if where
        else (f" ({DEBUG_VAR}=1 prints the traceback)" if code == 1 else "")
    )
    print(f"{kind}: {line}{hint}", file=sys.stderr)
    return code, f"{kind}: {line}"
