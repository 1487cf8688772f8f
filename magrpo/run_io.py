"""Run directory outputs: resolved config, metrics.jsonl, rollouts.jsonl, adapters, wandb."""
from __future__ import annotations

import errno
import json
import netrc
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from .config import flatten
from .errors import MagrpoError, TrainingError
from .tree import Node

# Less free than this right after a failed write: the disk was full, whatever error the writer raised.
FULL_BYTES = 1 << 20


def os_error_of(error: BaseException, folder: Path) -> str | None:
    """The OS error behind a failed write, in words (None: it was no OS error, e.g. a bug). torch and
    safetensors wrap a full disk in their own errors (`[enforce fail at inline_container.cc:672]`),
    so a disk found full right after the failure says so."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"[Errno {seen.errno}] {os.strerror(seen.errno)}"
        seen = seen.__cause__ or seen.__context__
    try:
        full = shutil.disk_usage(folder).free < FULL_BYTES
    except OSError:
        return None
    return f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}" if full else None


@contextmanager
def writing(path: Path, after: str, partial: Path | None = None) -> Iterator[None]:
    """A write to `path`: an OS failure (a full disk above all) becomes one TrainingError line naming
    the path and the OS error, then `after`; `partial` (what the write was building) is removed first,
    so nothing half-written is left filling the disk."""
    try:
        yield
    except Exception as e:
        reason = None if isinstance(e, MagrpoError) else os_error_of(e, path.parent)  # before the clean-up frees space
        if partial is not None and partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        elif partial is not None:
            partial.unlink(missing_ok=True)
        if reason is None:
            raise
        raise TrainingError(f"cannot write {path}: {reason}; {after}") from e


RESUME_HINT = "free space, then resume=auto continues from the last complete checkpoint"


def make_run_dir(run_dir: str | None, env_name: str) -> tuple[Path, bool]:
    """The run dir, made when new; and whether this call made it."""
    path = Path(run_dir) if run_dir else Path("runs") / f"{env_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return path, made


LOGS = ("metrics.jsonl", "rollouts.jsonl")


def repair_log(path: Path, last_step: int) -> tuple[set[int], set[int]]:
    """Keep every valid line with step <= last_step, in order; drop valid lines after it (the resumed
    run writes those steps again). Lines that are not a JSON object with a step (a torn last line, or
    garbage in the middle) move, byte for byte, to `<file>.corrupt`, with one line saying so. The log
    is read line by line and rewritten atomically. Returns (steps kept, steps dropped)."""
    kept, dropped, bad = set(), set(), []
    if not path.is_file():
        return kept, dropped
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, "free space, then resume again", partial=tmp), open(path, "rb") as log, open(tmp, "wb") as out:
        for number, line in enumerate(log, 1):
            step = _step_of(line)
            if step is None:
                bad.append(number)
                with open(path.with_name(path.name + ".corrupt"), "ab") as aside:
                    aside.write(_ended(line))
            elif step <= last_step:
                out.write(_ended(line))
                kept.add(step)
            else:
                dropped.add(step)
    if bad:
        print(f"magrpo: {path}: line(s) {', '.join(map(str, bad))} are not valid JSON records (torn or "
              f"garbled); moved to {path.name}.corrupt", file=sys.stderr)
    os.replace(tmp, path)
    return kept, dropped


def step_ranges(steps: Iterable[int]) -> str:
    """1, 2, 3, 5 -> "1-3, 5"."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _ended(line: bytes) -> bytes:
    return line if line.endswith(b"\n") else line + b"\n"


def _step_of(line: bytes) -> int | None:
    try:
        record = json.loads(line)
    except ValueError:  # UnicodeDecodeError included
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def top_level(folder: Path) -> dict[str, int]:
    """The entries at the top of a folder, by name, with their inode numbers (`put_back` compares them)."""
    return {p.name: p.lstat().st_ino for p in folder.iterdir()}


def put_back(folder: Path, before: dict[str, int]) -> None:
    """Undo a start that trained nothing in a run dir it did not make: each entry that was there (`before`,
    from top_level) gets its name back where the start renamed it (its logs set aside), and what the start
    wrote (STARTED_FILES) is removed; anything else new there is not the run's and is left. Only the top
    level: nested folders (checkpoints/) hold what a later start redoes anyway."""
    from .paths import remove_tree

    now = {p.lstat().st_ino: p for p in folder.iterdir()}
    for name, inode in before.items():
        moved = now.get(inode)
        if moved is not None and moved.name != name:
            with suppress(OSError):  # a folder where a new entry of that name is a non-empty folder: left
                os.replace(moved, folder / name)
    for path in map(folder.joinpath, STARTED_FILES):
        if path.exists() and path.lstat().st_ino not in before.values():
            if path.is_dir() and not path.is_symlink():
                remove_tree(path)
            else:
                path.unlink(missing_ok=True)


def aside_path(path: Path, stamp: str) -> Path:
    """`<name>.before-<stamp>`, unused yet (two starts within a second get -1, -2, ...)."""
    aside, n = path.with_name(f"{path.name}.before-{stamp}"), 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.before-{stamp}-{n}")
    return aside


def set_aside_logs(run_dir: Path) -> None:
    """A fresh start in a run dir that holds logs but no checkpoint (a run stopped before its first):
    the old files are renamed, never overwritten."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = [(name, aside_path(run_dir / name, stamp)) for name in (*LOGS, "config.json") if (run_dir / name).is_file()]
    for name, aside in moved:
        os.replace(run_dir / name, aside)
    if moved:
        print(f"magrpo: no checkpoint in {run_dir}: starting over; the earlier {', '.join(n for n, _ in moved)} "
              f"renamed to {', '.join(a.name for _, a in moved)}", file=sys.stderr)


def write_config(run_dir: Path, config: Mapping[str, Any]) -> None:
    """config.json: this start's resolved config. It is never rewritten in place: an earlier one that
    differs (a resume with other safe keys, e.g. trainer.steps) is kept as config.json.before-<time>."""
    path, text = run_dir / "config.json", json.dumps(config, indent=2, default=str)
    if path.is_file():
        changed = _changed_keys(path.read_text(), config)
        if not changed:
            return
        aside = aside_path(path, time.strftime("%Y%m%d-%H%M%S"))
        os.replace(path, aside)
        print(f"magrpo: {path} kept as {aside.name}: this start's config differs in {changed}", file=sys.stderr)
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, "free space, then resume again", partial=tmp):
        tmp.write_text(text)
    os.replace(tmp, path)


def _changed_keys(old_text: str, config: Mapping[str, Any]) -> str:
    """The keys that differ, listed ("" when none). `resume` is not counted: it says how a start
    began (the first has none, the later ones auto), not what the run is."""
    try:
        old = flatten(json.loads(old_text))
    except ValueError:
        return "every key (the earlier config.json does not parse)"
    new = flatten(json.loads(json.dumps(config, default=str)))
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "resume")
    return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def tree_records(step: int, problems: Sequence[Mapping[str, Any]], nodes: list[Node]) -> list[dict]:
    """One JSON record per tree; node ids are local to the tree (0 = root). Schema in docs/outputs.md."""
    local: dict[int, int] = {}
    per_tree: dict[int, list[dict]] = {}
    for gid, node in enumerate(nodes):
        records = per_tree.setdefault(node.tree, [])
        local[gid] = len(records)
        records.append({
            "id": len(records),
            "turn": node.turn,
            "parent": None if node.parent is None else [local[node.parent[0]], node.parent[1]],
            "prompts": node.prompts,
            "completions": [[c.text for c in agent] for agent in node.completions],
            **token_fields(node),
            "advantages": node.advantages.round(6).tolist(),
            "joint_actions": [
                {
                    "agents": node.joint[j].tolist(),
                    "reward": float(node.rewards[j]),
                    "return": float(node.returns[j]),
                    "terminated": bool(node.terminated[j]),
                    "child": None,  # filled below once the child's local id is known
                    **per_agent(node, j),
                    **ended_by(node, j),
                }
                for j in range(len(node.joint))
            ],
        })
    for gid, node in enumerate(nodes):
        for j, child in enumerate(node.children):
            if child is not None:
                per_tree[node.tree][local[gid]]["joint_actions"][j]["child"] = local[child]
    return [
        {"step": step, "tree": t, "problem": dict(problems[t]), "nodes": per_tree[t]} for t in sorted(per_tree)
    ]


def token_fields(node: Node) -> dict[str, list]:
    """What each agent read and wrote at the node, as token ids: its prompt (the whole input before its
    reply: chat template, system prompt, tools preamble, earlier turns) and each completion; then, where
    the node has any, each completion's loss mask (0: an inserted token, a tool's output) and its tool
    calls. prompt_ids + completion_ids is exactly the sequence the update scores."""
    out: dict[str, list] = {
        "prompt_ids": [list(agent[0].prompt_ids) if agent else [] for agent in node.completions],
        "completion_ids": [[list(c.token_ids) for c in agent] for agent in node.completions],
    }
    completions = [c for agent in node.completions for c in agent]
    if any(c.model_mask is not None for c in completions):
        out["loss_mask"] = [[[int(m) for m in c.model_mask] if c.model_mask is not None else [1] * len(c.token_ids)
                             for c in agent] for agent in node.completions]
    if any(c.tool_calls for c in completions):
        out["tool_calls"] = [[[{key: call[key] for key in ("name", "arguments", "output", "error", "inserted")}
                               for call in c.tool_calls] for c in agent] for agent in node.completions]
    return out


def per_agent(node: Node, j: int) -> dict[str, list[float]]:
    """Joint action j's per-agent rewards and returns, when the env gave them (absent otherwise)."""
    out = {}
    if node.agent_rewards is not None:
        out["agent_rewards"] = node.agent_rewards[j].tolist()
    if node.agent_returns is not None:
        out["agent_returns"] = node.agent_returns[j].tolist()
    return out


def ended_by(node: Node, j: int) -> dict[str, bool]:
    """What ended joint action j before the turn limit: the env's done, truncation (keys absent otherwise)."""
    return {key: True for key, flags in (("done", node.done), ("truncated", node.truncated))
            if flags is not None and flags[j]}


def wandb_mode(setting: str) -> str:
    """auto: online when an API key is configured (env var or `wandb login`), else offline."""
    if setting != "auto":
        return setting
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1]):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


# wandb metric families: x-axis is the optimizer step everywhere; eval summaries keep the best value.
METRIC_FAMILIES = ["train/*", "tree/*", "perf/*", "env/*", "expert/*", "env_step"]


def sample_rows(step: int, record: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """One table row per joint action of one tree: each agent's prompt, completion and advantage."""
    nodes = record["nodes"]
    num_agents = len(nodes[0]["prompts"]) if nodes else 0
    columns = ["step", "tree", "turn", "node", "joint", "problem"]
    for a in range(num_agents):
        columns += [f"agent_{a}/prompt", f"agent_{a}/completion", f"agent_{a}/advantage"]
    columns += ["reward", "return", "terminated"]
    rows = []
    for node in nodes:
        for j, joint in enumerate(node["joint_actions"]):
            row = [step, record["tree"], node["turn"], node["id"], j, str(record["problem"].get("prompt", ""))]
            for a, k in enumerate(joint["agents"]):
                row += [node["prompts"][a], node["completions"][a][k], node["advantages"][a][k]]
            rows.append(row + [joint["reward"], joint["return"], joint["terminated"]])
    return columns, rows


class NullWriter:
    """What data-parallel ranks other than 0 write: nothing."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def log_trees(self, records: list[dict]) -> None: ...
    def log_samples(self, step: int, records: list[dict]) -> None: ...
    def log_adapters(self, folder: Path) -> None: ...
    def close(self) -> None: ...


# What a start writes at the top of the run dir before its first step (RunWriter, write_config, wandb's dir=).
STARTED_FILES = ("config.json", "config.json.tmp", *LOGS, "wandb")


class RunWriter:
    """Every metric goes to metrics.jsonl, and to wandb when enabled; trees to rollouts.jsonl."""

    def __init__(self, path: Path, config: Mapping[str, Any], wandb_cfg: Any):
        self.path = path
        write_config(path, config)
        self.metrics = open(path / "metrics.jsonl", "a")
        self.rollouts = open(path / "rollouts.jsonl", "a")
        self.wandb = None
        self.wandb_cfg = wandb_cfg
        mode = wandb_mode(wandb_cfg.mode)
        if mode != "disabled":
            import wandb

            # wandb's own telemetry follows the process-wide settings, not init(mode=...): without this an
            # offline run still sends it to wandb's server from a background thread.
            wandb.setup(settings=wandb.Settings(mode=mode))
            self.wandb = wandb.init(
                project=wandb_cfg.project, entity=wandb_cfg.entity, name=wandb_cfg.name or path.name,
                group=wandb_cfg.group, tags=list(wandb_cfg.tags) or None, mode=mode, config=dict(config),
                dir=str(path),
            )
            self.wandb.define_metric("step")
            for family in METRIC_FAMILIES:
                self.wandb.define_metric(family, step_metric="step")
            self.wandb.define_metric("eval/*", step_metric="step", summary="max")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        with writing(self.path / "metrics.jsonl", RESUME_HINT):  # a torn line is set aside on resume
            self.metrics.write(json.dumps({"step": step, **metrics}) + "\n")
            self.metrics.flush()
        if self.wandb is not None:
            self.wandb.log({"step": step, **metrics}, step=step)

    def log_trees(self, records: list[dict]) -> None:
        with writing(self.path / "rollouts.jsonl", RESUME_HINT):
            for record in records:
                self.rollouts.write(json.dumps(record, default=str) + "\n")
            self.rollouts.flush()

    def log_samples(self, step: int, records: list[dict]) -> None:
        """Sample rollouts for wandb: a Table of every tree's joint actions and the first tree's page."""
        if self.wandb is None or not records:
            return
        import wandb

        from .viz import render_tree_html

        columns, rows = sample_rows(step, records[0])
        for record in records[1:]:
            rows += sample_rows(step, record)[1]
        self.wandb.log({"samples/rollouts": wandb.Table(columns=columns, data=rows),
                        "samples/tree": wandb.Html(render_tree_html(records[0]), inject=False)}, step=step)

    def log_adapters(self, folder: Path) -> None:
        if self.wandb is None or not self.wandb_cfg.log_adapters:
            return
        import wandb

        artifact = wandb.Artifact(re.sub(r"[^\w.-]", "-", f"{self.wandb.name}-adapters"), type="model")
        artifact.add_dir(str(folder))
        self.wandb.log_artifact(artifact)

    def close(self) -> None:
        for log in (self.metrics, self.rollouts):
            try:
                log.close()
            except OSError:  # every line was flushed as written: a failed one was already reported
                pass
        if self.wandb is not None:
            self.wandb.finish()
