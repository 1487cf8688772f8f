"""Checkpoints that resume exactly: written atomically, verified, found again by `resume=auto`.

A checkpoint is RUN_DIR/checkpoints/step_NNNNNN/ with
    agent_{i}/            the adapter in peft format, or a full agent's model and tokenizer (usable on
                          their own)
    agent_{i}/train.pt    the exact trainable tensors (a full agent's are its model's safetensors,
                          by name, when they hold them all), optimizer and scheduler state
    trainer.pt            step counters, data order, and per process: RNG states and env counters
    config.json           the run's resolved config
    COMPLETE              written last: the step and a sha256 of every other file
It is built in a temporary folder and renamed into place, so a crash mid-write leaves no folder
that `resume=auto` would pick (start-up removes such temp folders). A checkpoint whose files do not
match their checksums is unreadable: `resume=auto` falls back to the one before, saying why.

A resume never destroys: the checkpoint is chosen, verified and its config compared before any
model loads, and nothing in the run dir changes until one that matches the run has loaded; every
refusal is one ConfigError line. With data parallelism only rank 0 reads and writes checkpoints;
the others get their part (or rank 0's error) from it.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .config import TrainConfig, flatten, under
from .errors import ConfigError, TrainingError, describe
from .paths import checksums, sha256_of
from .run_io import LOGS, RESUME_HINT, aside_path, repair_log, set_aside_logs, step_ranges, writing

PREFIX = "step_"
TMP_PREFIX = ".tmp-"

# Keys that may differ between a checkpoint's config and the resuming run's: they change how long the
# run goes, what it logs or evaluates, and how fast it runs, never what it trains. A key matches when
# it is one of these or lies under one (`logging` covers `logging.run_dir`).
SAFE_TO_CHANGE = (
    "trainer.steps", "trainer.micro_batch_size", "trainer.max_bad_steps", "trainer.dist_timeout_min",
    "generation.max_batch_rows", "generation.prefix_reuse", "model.device", "model.cpu_memory", "model.cpu_weights",
    "model.cuda_graphs", "vllm.gpu_memory_utilization", "vllm.enforce_eager",
    "vllm.sleep_mode", "vllm.kv_cache_gb", "external.max_concurrency", "tools.max_concurrency",
    "external.expert.timeout_s", "external.expert.max_retries", "external.expert.backoff_s", "external.expert.cache",
    "external.expert.api_key_env", "eval", "logging", "checkpoint", "limits", "resume", "resume_force",
    "plugins",  # code to import: what it registers shows in the keys that select it (env.name, ...)
)


class Unreadable(Exception):
    """A checkpoint that cannot be trusted (missing or changed file, torn write): try an older one."""


def folder_of(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{PREFIX}{step:06d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, step: int, agents: Sequence[Any], updaters: Sequence[Any], trainer_state: dict[str, Any],
         config: dict[str, Any], keep: int, progress: Callable[[str], None] = lambda done: None) -> Path:
    """Write checkpoint `step` atomically, then prune to `keep`. A failed write (a full disk) is one
    TrainingError line; its temp folder is removed and the previous checkpoint stays as it was.
    `progress(done)` after each part (an agent's adapter and optimizer, the checksums, the whole)."""
    final = folder_of(run_dir, step)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    previous = candidates(run_dir)
    after = (f"the checkpoint of step {_step_of(previous[0])} is intact: " if previous else "") + RESUME_HINT
    make_room(previous, step, keep, run_dir, after)
    with writing(final, after, partial=tmp):
        tmp.mkdir(parents=True)
        _write(tmp, step, agents, updaters, trainer_state, config, progress)
    shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from an earlier attempt
    os.replace(tmp, final)
    _prune(final.parent, keep)
    progress(f"done, {final}")
    return final


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def make_room(previous: list[Path], step: int, keep: int, folder: Path, after: str) -> None:
    """Before writing: the newest checkpoint's size against the free space. When short, remove first
    the checkpoints this save would prune anyway, never the newest (a failed write leaves it to
    resume from); still short, stop before writing anything."""
    if not previous:
        return
    need, free = _size(previous[0]), shutil.disk_usage(folder).free
    prunable = previous[max(keep - 1, 1):]  # newest first: what is beyond the keep - 1 kept besides the new one
    while free < need and prunable:
        old = prunable.pop()
        free += _size(old)
        shutil.rmtree(old, ignore_errors=True)
        print(f"magrpo: removed {old} before writing step {step}'s checkpoint to make room (checkpoint.keep={keep})",
              file=sys.stderr)
    if free < need:
        raise TrainingError(f"not enough space for checkpoint step {step} in {folder}: {free / 2**20:.1f} MiB free, "
                            f"the last checkpoint takes {need / 2**20:.1f} MiB; {after}")


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _write(tmp: Path, step: int, agents: Sequence[Any], updaters: Sequence[Any], trainer_state: dict[str, Any],
           config: dict[str, Any], progress: Callable[[str], None]) -> None:
    for i, (agent, updater) in enumerate(zip(agents, updaters)):
        folder = agent.save(tmp)
        in_folder = getattr(agent, "full", False) and _saved_names(folder) >= set(_param_names(agent))
        torch.save({  # a full agent's weights once, not twice: its model folder has them exactly
            "params": None if in_folder else [p.detach().cpu().clone() for p in updater.params],
            "optimizer": updater.optimizer.state_dict(),
            "scheduler": updater.scheduler.state_dict(),
        }, folder / "train.pt")
        progress(f"agent {i + 1}/{len(agents)} written")
    torch.save(trainer_state, tmp / "trainer.pt")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    (tmp / "COMPLETE").write_text(json.dumps({"step": step, "sha256": checksums(tmp, "COMPLETE")}, indent=1))
    progress("checksums written")


def _param_names(agent: Any) -> list[str]:
    """A full agent's parameter names, in the order of its trainable parameters (tied weights once)."""
    return [name for name, _ in agent.model.named_parameters()]


def _saved_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    return names


def _saved_weights(folder: Path, names: Sequence[str]) -> list[torch.Tensor]:
    """The tensors `names` from a model folder's safetensors (what `_write` wrote for a full agent)."""
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for path in folder.glob("*.safetensors"):
        found.update(load_file(str(path)))
    missing = [n for n in names if n not in found]
    if missing:
        raise KeyError(f"{folder} lacks weight {missing[0]!r}")
    return [found[n] for n in names]


def _prune(folder: Path, keep: int) -> None:
    done = sorted(p for p in folder.glob(f"{PREFIX}*") if (p / "COMPLETE").is_file())
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def steps_in(run_dir: Path) -> list[Path]:
    """Every checkpoints/step_NNNNNN entry, complete or not, a folder or not, newest first."""
    folder = run_dir / "checkpoints"
    return sorted((p for p in folder.glob(f"{PREFIX}*") if p.name[len(PREFIX):].isdigit()), reverse=True) \
        if folder.is_dir() else []


def candidates(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, newest first."""
    return [p for p in steps_in(run_dir) if (p / "COMPLETE").is_file()]


def holds_checkpoints(run_dir: Path) -> bool:
    """Any step_* entry, complete or not: the run dir belongs to a run that got that far."""
    return bool(steps_in(run_dir))


def verify(path: Path) -> dict[str, Any]:
    """The COMPLETE manifest, after checking every file against its sha256; raises Unreadable.
    A checkpoint written before checksums existed is returned unverified, with a warning."""
    if not path.is_dir():
        raise Unreadable("not a folder")
    if not (path / "COMPLETE").is_file():
        raise Unreadable("no COMPLETE marker (it is written last: the write did not finish, or it was deleted)")
    try:
        manifest = json.loads((path / "COMPLETE").read_text())
    except (OSError, ValueError) as e:
        raise Unreadable(f"COMPLETE does not parse: {e}") from None
    if not isinstance(manifest, dict) or "step" not in manifest:
        raise Unreadable("COMPLETE holds no step")
    if "sha256" not in manifest:
        print(f"magrpo: checkpoint {path} has no checksums and no config (written by an older magrpo): "
              f"loading it unverified", file=sys.stderr)
        return manifest
    for name, expected in manifest["sha256"].items():
        if not (path / name).is_file():
            raise Unreadable(f"{name} is missing")
        if sha256_of(path / name) != expected:
            raise Unreadable(f"{name} does not match its sha256 in COMPLETE")
    return manifest


def stored_config(path: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The config the checkpoint was written with (None: an older checkpoint without one)."""
    if "sha256" not in manifest or "config.json" not in manifest["sha256"]:
        return None
    return json.loads((path / "config.json").read_text())


ABSENT = "<absent>"


def config_changes(stored: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ (a key set on one side only included), other than SAFE_TO_CHANGE. A
    key the checkpoint lacks because magrpo added it later is no change while it keeps its default:
    the run goes on as it was."""
    old = legacy_values(_plain(stored))  # the JSON round trip the stored one took
    new = _plain(current)
    added_later = {k: v for k, v in schema_defaults(current).items() if k not in old}
    old.update(added_later)
    keys = sorted(set(old) | set(new))
    return {k: (old.get(k, ABSENT), new.get(k, ABSENT)) for k in keys
            if old.get(k, ABSENT) != new.get(k, ABSENT) and not under(k, SAFE_TO_CHANGE)}


def legacy_values(flat: dict[str, Any]) -> dict[str, Any]:
    """Values an older magrpo wrote that mean a current one: external.history was a bool."""
    from .config import HISTORY_ALIASES

    history = flat.get("external.history")
    if isinstance(history, bool):
        flat["external.history"] = HISTORY_ALIASES[str(history).lower()]
    return flat


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    return flatten(json.loads(json.dumps(config, default=str)))


def schema_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Dotted key -> default of every TrainConfig key, and of the selected env's Config keys."""
    from .env import ENVS

    defaults = _plain(asdict(TrainConfig()))
    defaults = {k: v for k, v in defaults.items() if not under(k, ["env"])}
    name = (config.get("env") or {}).get("name")
    if name in ENVS:
        defaults.update(_plain({"env": {"name": name, **asdict(ENVS.get(name).Config())}}))
    return defaults


def check_config(path: Path, stored: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise ConfigError (one line) when the resuming config differs from the checkpoint's in a key
    that is neither safe to change nor listed in the current `resume_force`."""
    changes = config_changes(stored, current)
    forced = list(current.get("resume_force") or [])
    refused = {k: v for k, v in changes.items() if not under(k, forced)}
    if refused:
        raise ConfigError("resume", f"the config differs from checkpoint {path}'s in {_listing(refused)}; use the "
                                    f"checkpoint's values, or another logging.run_dir for a new run, or resume_force=["
                                    f"{','.join(refused)}] to continue with the new values; nothing was changed")
    if changes:
        print(f"magrpo: resuming with changed {_listing(changes)} (resume_force)", file=sys.stderr)


def _listing(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} ({_short(a)} -> {_short(b)})" for k, (a, b) in changes.items())


def _short(value: Any) -> str:
    text = json.dumps(value) if value != ABSENT else value
    return text if len(text) <= 40 else text[:37] + "..."


def matches(path: Path, config: dict[str, Any]) -> None:
    """Raise Unreadable (a file changed or missing) or ConfigError (the config differs) for the
    checkpoint at path; reads no tensors, so it runs before any model loads."""
    manifest = verify(path)
    try:
        stored = stored_config(path, manifest)
    except ValueError as e:
        raise Unreadable(f"config.json does not parse: {e}") from None
    if stored is not None:
        check_config(path, stored, config)


def choose(setting: str | None, run_dir: str | None, config: dict[str, Any]) -> Path | None:
    """The checkpoint to continue from (None: a fresh start), decided before any model loads. Raises
    ConfigError (one line) whenever going on could overwrite another run's files: a config that
    differs from the checkpoint's, no readable checkpoint in a run dir that holds some, or a fresh
    start in such a dir. `auto` falls back from an unreadable checkpoint to the one before."""
    holds = run_dir is not None and holds_checkpoints(Path(run_dir))
    if setting is None:
        if holds:
            raise ConfigError("logging.run_dir", f"{run_dir} holds checkpoints of an earlier run; continue it with "
                                                 f"resume=auto, or pick another logging.run_dir; nothing was changed")
        return None
    if setting != "auto":
        try:
            matches(Path(setting), config)
        except Unreadable as e:
            raise ConfigError("resume", f"checkpoint {setting} is unreadable ({e}); give another checkpoint "
                                        f"folder or resume=auto; nothing was changed") from None
        return Path(setting)
    for path in steps_in(Path(run_dir)):  # incomplete ones too: each skip is said
        try:
            matches(path, config)
        except Unreadable as e:
            print(f"magrpo: skipping checkpoint {path}: {e}", file=sys.stderr)
            continue
        return path
    if holds:
        raise ConfigError("resume", f"no checkpoint under {Path(run_dir) / 'checkpoints'} can be read; nothing was "
                                    f"changed: restore one, or start a new run with another logging.run_dir")
    print(f"magrpo: resume=auto: no checkpoint in {run_dir}; starting from step 1", file=sys.stderr)
    return None


def read(path: Path, agents: Sequence[Any], updaters: Sequence[Any]) -> dict[str, Any]:
    """The chosen checkpoint's contents (tensors on the CPU), checked against the agents' tensor
    shapes; changes nothing. Raises ConfigError (one line) when they do not load or fit."""
    try:
        trainer_state = torch.load(path / "trainer.pt", weights_only=False, map_location="cpu")
        parts = [torch.load(path / agent.adapter / "train.pt", weights_only=False, map_location="cpu")
                 for agent in agents]
        for agent, part in zip(agents, parts):
            if part["params"] is None:  # a full agent's weights: in its model folder
                part["params"] = _saved_weights(path / agent.adapter, _param_names(agent))
    except Exception as e:  # noqa: BLE001  only a checkpoint without checksums gets here torn or garbled
        raise ConfigError("resume", f"checkpoint {path} does not load ({describe(e)}); "
                                    f"move it away or give another with resume=PATH; nothing was changed") from None
    for agent, part, updater in zip(agents, parts, updaters):
        _check_shapes(path, agent.adapter, part["params"], updater.params)
    print(f"magrpo: resuming from {path}", file=sys.stderr)
    return {"trainer": trainer_state, "agents": parts}


def _check_shapes(path: Path, adapter: str, saved: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
    shapes = [tuple(t.shape) for t in saved], [tuple(p.shape) for p in params]
    if shapes[0] != shapes[1]:
        diff = next((i for i, (a, b) in enumerate(zip(*shapes)) if a != b), min(map(len, shapes)))
        got = f"tensor {diff}: {list(shapes[0][diff])} vs {list(shapes[1][diff])}" if diff < min(map(len, shapes)) \
            else f"{len(shapes[0])} tensors vs {len(shapes[1])}"
        raise ConfigError("resume", f"{path}/{adapter} does not fit this config's adapters ({got}); the model, "
                                    f"lora and agent settings must be the checkpoint's; nothing was changed")


def apply(contents: dict[str, Any], updaters: Sequence[Any]) -> dict[str, Any]:
    """Restore adapters and optimizers in place from `read`'s contents; returns the trainer state."""
    with torch.no_grad():
        for part, updater in zip(contents["agents"], updaters):
            for target, value in zip(updater.params, part["params"]):
                target.copy_(value)
            configured = _hyperparameters(updater)
            updater.optimizer.load_state_dict(part["optimizer"])
            updater.scheduler.load_state_dict(part["scheduler"])
            _set_hyperparameters(updater, configured)
    return contents["trainer"]


def _hyperparameters(updater: Any) -> list[dict[str, float]]:
    return [{"initial_lr": g["initial_lr"], "weight_decay": g["weight_decay"]} for g in updater.optimizer.param_groups]


def _set_hyperparameters(updater: Any, configured: list[dict[str, float]]) -> None:
    """The run's own lr, weight decay and warm-up over the checkpoint's (the same values unless a
    `resume_force` changed them): the optimizer state would otherwise keep the old ones silently."""
    scheduler = updater.scheduler
    scheduler.base_lrs = [c["initial_lr"] for c in configured]
    for group, c, factor in zip(updater.optimizer.param_groups, configured, scheduler.lr_lambdas):
        group.update(c)
        group["lr"] = c["initial_lr"] * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in updater.optimizer.param_groups]


def on_main(world: Any, read_it: Callable[[], Any]) -> Any:
    """read_it() on rank 0, its result on every rank. An error on rank 0 is raised on every rank (as a
    ConfigError when it is one, else a RuntimeError naming it), so no rank waits for the others."""
    outcome = None
    if world.is_main:
        try:
            outcome = {"value": read_it()}
        except ConfigError as e:
            outcome = {"config_error": (e.key, str(e)[len(e.key) + 2:])}
        except Exception as e:
            if world.size == 1:
                raise
            world.broadcast({"error": describe(e)})
            raise
    outcome = world.broadcast(outcome)
    if "config_error" in outcome:
        raise ConfigError(*outcome["config_error"])
    if "error" in outcome:
        raise RuntimeError(f"rank 0 failed: {outcome['error']}")
    return outcome["value"]


def remove_stale_tmp(run_dir: Path) -> None:
    """Temporary folders of checkpoints whose writer died before the rename (never a complete one)."""
    for tmp in (run_dir / "checkpoints").glob(f"{TMP_PREFIX}{PREFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)


def move_aside_strays(run_dir: Path) -> None:
    """A file (or link) where a step_NNNNNN folder belongs would stop the save of that step: renamed."""
    for path in steps_in(run_dir):
        if not path.is_dir():
            aside = aside_path(path, time.strftime("%Y%m%d-%H%M%S"))
            os.replace(path, aside)
            print(f"magrpo: {path} is not a checkpoint folder: renamed to {aside.name}", file=sys.stderr)


def claim_run_dir(run_dir: Path, step: int | None, complete_logs: Sequence[str] = LOGS) -> None:
    """Rank 0, once the resume decision is made: drop dead temp folders, and make the logs read as if
    the run had never stopped (resumed at `step`) or set an unfinished run's logs aside (None). Says
    which logged steps were dropped (after the checkpoint) and which of `complete_logs` (the logs
    that hold every step) are missing."""
    remove_stale_tmp(run_dir)
    move_aside_strays(run_dir)
    if step is None:
        set_aside_logs(run_dir)
        return
    for name in LOGS:
        kept, dropped = repair_log(run_dir / name, step)
        if dropped:
            print(f"magrpo: {name}: step(s) {step_ranges(dropped)} were logged after checkpoint step {step}: "
                  f"dropped, the resumed run logs them again", file=sys.stderr)
        missing = set(range(1, step + 1)) - kept
        if name in complete_logs and missing:
            gone = "the file is gone" if not (run_dir / name).is_file() else "deleted or moved from the file"
            print(f"magrpo: {name}: step(s) {step_ranges(missing)} are missing ({gone}); the resumed run logs "
                  f"from step {step + 1} on", file=sys.stderr)


def resume(chosen: Path | None, world: Any, agents: Sequence[Any], updaters: Sequence[Any], sampler: Any,
           load_env_state: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
    """Continue from `chosen` (the checkpoint `choose` picked; None: a fresh start): adapters,
    optimizers, the problem order, and this process's random and env state (`load_env_state`: the env's
    load_state, as the trainer calls user code) are restored; returns
    the trainer state (`step`, `env_step`; None when fresh). Rank 0 reads the checkpoint (other
    machines need no shared disk); its errors stop every rank."""
    found = on_main(world, lambda: read(chosen, agents, updaters)) if chosen else None
    if not found:
        return None
    state = apply(found, updaters)
    sampler.load_state(state["sampler"])
    ranks = state["ranks"]
    if len(ranks) != world.size and world.is_main:
        print(f"magrpo: the checkpoint was written by {len(ranks)} process(es), resuming with {world.size}: "
              f"rollouts are the same (seeded per tree), other random draws (LoRA dropout) are not", file=sys.stderr)
    mine = ranks[min(world.rank, len(ranks) - 1)]  # with fewer processes now, the last one's
    set_rng_state(mine["rng"])
    load_env_state(mine["env"])
    return state
