"""`python train.py -m a=1,2 b=x,y`: one run per combination of the comma lists (Hydra's basic
sweeper order: the last list varies fastest), one after another in this process, each in its own
folder under one sweep folder; then a table of every run's final metrics (summary.md, summary.tsv).

Every run's config is composed and checked before the first one trains, so a bad value anywhere is
a one-line error and nothing runs. A run that fails while training is reported in the table and the
sweep goes on (a stop by signal ends the sweep); the exit code is then that of the first failure.
"""
from __future__ import annotations

import itertools
import re
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from .errors import ConfigError


def expand(overrides: Sequence[str]) -> list[tuple[list[str], list[str]]]:
    """(swept `key=value` pairs, all overrides in the order given) of every run."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, parsed = OverridesParser.create(), []
    for override in overrides:
        try:
            parsed += parser.parse_overrides([override])
        except Exception as e:  # noqa: BLE001  (hydra's syntax error, one line naming the override)
            why = " ".join(str(e).split()).split(" See https://")[0]
            raise ConfigError(override.partition("=")[0], f"cannot parse {override!r}: {why}") from None
    axes = [[f"{p.get_key_element()}={_text(v)}" for v in p.sweep_iterator()] if p.is_sweep_override() else [o]
            for o, p in zip(overrides, parsed)]
    swept = [p.is_sweep_override() for p in parsed]
    return [([o for o, s in zip(combo, swept) if s], list(combo)) for combo in itertools.product(*axes)]


def _text(value) -> str:
    """A swept value as an override's text; booleans as YAML spells them (Hydra writes True)."""
    from hydra.core.override_parser.types import Override

    return str(value).lower() if isinstance(value, bool) else Override._get_value_element_as_str(value)


def sweep_dir(overrides: Sequence[str]) -> tuple[Path, list[str]]:
    """`logging.run_dir=X` names the sweep's folder (runs go in X/<i>-<values>); default runs/sweep-<time>."""
    given = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == "logging.run_dir"]
    rest = [o for o in overrides if o.partition("=")[0] != "logging.run_dir"]
    return Path(given[-1] if given else f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S')}"), rest


def run_name(index: int, swept: Sequence[str]) -> str:
    text = ",".join(swept)
    return f"{index}-{re.sub(r'[^A-Za-z0-9_.,=+-]', '_', text)[:80]}" if text else str(index)


def final_metrics(run_dir: Path) -> dict[str, float]:
    """The last value of each metric in run_dir/metrics.jsonl (train and eval records interleave)."""
    import json

    out: dict[str, float] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.update(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            continue
    return out


def columns(finals: Sequence[dict]) -> list[str]:
    """step, the train reward, and the last turn's eval numbers (plus improvements) that any run has."""
    keys = {k for f in finals for k in f}
    turns = [int(m.group(1)) for k in keys if (m := re.match(r"eval/turn_(\d+)/", k))]
    last = f"eval/turn_{max(turns)}/" if turns else None
    evals = sorted(k for k in keys if last and k.startswith(last) or k.startswith("eval/improvement/"))
    return [k for k in ("step", "train/reward_mean") if k in keys] + evals


def summary(rows: Sequence[tuple[str, str, dict]]) -> tuple[str, str]:
    """(markdown, tsv) of (run, status, final metrics) rows."""
    cols = columns([r[2] for r in rows])
    table = [["run", "status", *cols]]
    for name, status, final in rows:
        cells = [f"{final[c]:.4g}" if isinstance(final.get(c), float) else str(final.get(c, "")) for c in cols]
        table.append([name, status, *cells])
    md = "\n".join(
        "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
        for row in table[:1] + [["---"] * len(table[0])] + table[1:]
    )
    tsv = "\n".join("\t".join(c.replace("\t", " ") for c in row) for row in table)
    return md + "\n", tsv + "\n"


def sweep(args, run: Callable[..., None], guarded: Callable[[Callable[[], None]], tuple[int, str]]) -> int:
    """Every run of the sweep, one after another: `run(args, overrides, run_dir, dry)` composes and
    trains one (cli.run), `guarded(fn)` turns its failure into (exit code, one line) (cli.guarded)."""
    runs: list[tuple[str, list[str]]] = []
    root, rest = sweep_dir(args.overrides)

    def check() -> None:  # every run's config, before any trains
        for i, (swept, overrides) in enumerate(expand(rest)):
            runs.append((run_name(i, swept), overrides))
            try:
                run(args, overrides, root / runs[-1][0], dry=True)
            except ConfigError as e:
                raise ConfigError(e.key, f"{str(e).partition(': ')[2]} (sweep run {runs[-1][0]})") from None

    code, _ = guarded(check)
    if code:
        return code
    print(f"magrpo: sweep of {len(runs)} runs in {root}", file=sys.stderr)
    rows, first_failure = [], 0
    for name, overrides in runs:
        print(f"magrpo: sweep run {name}", file=sys.stderr)
        code, line = guarded(lambda o=overrides, d=root / name: run(args, o, d))
        first_failure = first_failure or code
        rows.append((name, line or "ok", final_metrics(root / name)))
        if isinstance(code, int) and code > 128:  # stopped by a signal (cli.guarded): the whole sweep stops
            break
    if args.show:
        return first_failure
    md, tsv = summary(rows)
    root.mkdir(parents=True, exist_ok=True)
    (root / "summary.md").write_text(md)
    (root / "summary.tsv").write_text(tsv)
    print(md, end="")
    print(f"magrpo: sweep summary in {root / 'summary.md'} (and summary.tsv)", file=sys.stderr)
    return first_failure
