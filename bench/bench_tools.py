"""What tools inside a turn cost: the same training step with tools on and off (issue 31's acceptance:
a tool-using step costs at most ~1.3x the step without tools plus the tools' own time, because a
round's calls of every branch resume in one batched generate call, not one call per tool call).

Forced calls, so that every branch calls a fixed number of times whatever the model writes: with tools
on, each generate call of the turn is cut at --segment new tokens, and every segment so cut is a call of
`instant` (a deterministic tool that returns "ok" at once), up to `tools.max_calls=--calls`; a turn is
then --calls + 1 segments of --segment model tokens with a tool message between each two (fewer only
where the model writes EOS). With tools off, the turn is the same (--calls + 1) * --segment model
tokens in one piece. The prompts are the same in both: the tools preamble is left out (no model needs
to read it to make a forced call).

The default segment, 24 tokens, is about the shortest a segment that makes a call can be: the call
alone, `<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>`, is 23 tokens for SmolLM2's
tokenizer and 26 for the tiny model's. `--segment 8` is a stress case (segments too short to hold any
call, so the ~13-token tool messages outnumber the model's tokens and their own decoder work
dominates the ratio).

Per mode it prints the median seconds per step (the first step of each run warms up and is not timed)
with the 10th-90th percentile spread over --repeats runs, its generation and update (the update does
no tool work: what it gains with tools is the inserted tokens' own forward and backward, as every
later token attends to them), the tools' own seconds per step
(`tools/seconds`, summed over calls: an upper bound on their wall time, since a round's calls overlap),
generate calls per step, tool calls per completion, and the ratio (step with tools - tool seconds) /
step without: over all runs, then run by run (each run with tools against the run without just
before it, so that the machine's drift between runs cancels; its median and range are the figures to
compare between versions). It asserts nothing. Run it on an otherwise idle machine.

    python bench/bench_tools.py                           # tiny model, 2 calls x 24 tokens, 3 runs per mode
    python bench/bench_tools.py --segment 8 --repeats 8   # the stress case
    python bench/bench_tools.py --calls 1 --segment 24 --repeats 5 --extra trainer.batch_size=4
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "bench"):  # envs/ lives at the repo root, bench_vs_comlrl here
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


async def instant() -> str:
    """Returns "ok" at once (the benchmark's forced calls; async, so no thread is started per call)."""
    return "ok"


class Segmented:
    """The inner backend with every generate call cut at `tokens` new tokens."""

    def __init__(self, inner, tokens: int):
        self.inner, self.tokens = inner, tokens

    def generate(self, requests, params):
        return self.inner.generate(requests, replace(params, max_new_tokens=min(params.max_new_tokens, self.tokens)))

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.contextmanager
def forced_calls(segment: int):
    """Every segment cut short is a call of `instant`; the prompts carry no tools preamble."""
    import magrpo.tool_loop as tool_loop
    import magrpo.tools as tools

    init = tool_loop.ToolBackend.__init__

    def segmented_init(self, inner, settings, *rest):
        init(self, Segmented(inner, segment), settings, *rest)

    saved = tool_loop.ToolBackend.__init__, tool_loop.parse_call, tools.tools_preamble
    tool_loop.ToolBackend.__init__ = segmented_init
    # Only unfinished segments reach the parser (an EOS ends the turn): each of them is a call.
    tool_loop.parse_call = lambda text: tools.ToolCall("instant", {})
    tools.tools_preamble = lambda schemas: ""
    try:
        yield
    finally:
        tool_loop.ToolBackend.__init__, tool_loop.parse_call, tools.tools_preamble = saved


def counted_generate():
    """HFBackend.generate counting its calls (the run without tools has no Segmented)."""
    from magrpo.backends.hf import HFBackend

    counter = {"calls": 0}
    original = HFBackend.generate

    def generate(self, requests, params):
        counter["calls"] += 1
        return original(self, requests, params)

    return counter, original, generate


def settings(args, tools_on: bool, run_dir: Path) -> list[str]:
    model_tokens = (args.calls + 1) * args.segment
    # With tools the budget also holds the tool messages (~15 tokens each); the model's share is the same.
    budget = model_tokens + args.calls * 24 if tools_on else model_tokens
    tools = ["tools=[bench_tools:instant]", f"tools.max_calls={args.calls}"] if tools_on else []
    return ["env=length_ratio", "external=length_ratio", f"env.num_agents={args.agents}", "model=tiny",
            "model.dtype=float32", *tools,
            f"generation.max_new_tokens={budget}", f"trainer.steps={args.steps}", f"trainer.seed={args.seed}",
            f"trainer.batch_size={args.batch_size}", f"trainer.num_generations={args.k}", "trainer.num_turns=1",
            "logging.progress=false", "logging.wandb.mode=disabled", "logging.rollouts=false", "eval.at_end=false",
            "checkpoint.every=0", f"logging.run_dir={run_dir}", *args.extra]


def run(args, tools_on: bool, run_dir: Path) -> dict[str, list[float]]:
    """Per timed step: seconds, tool seconds, generate calls; and tool calls per completion."""
    from magrpo.backends.hf import HFBackend
    from magrpo.cli import main as train_main

    counter, original, generate = counted_generate()
    HFBackend.generate = generate
    try:
        with forced_calls(args.segment) if tools_on else contextlib.nullcontext(), \
                contextlib.redirect_stderr(io.StringIO()) as err:
            code = train_main(settings(args, tools_on, run_dir))
    finally:
        HFBackend.generate = original
    if code:
        sys.exit(f"tools {'on' if tools_on else 'off'} failed (exit {code}):\n{err.getvalue()[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:] or records
    completions = args.steps * args.batch_size * args.k * args.agents
    return {"step": [r["perf/step_s"] for r in timed], "tools": [r.get("tools/seconds", 0.0) for r in timed],
            "gen": [r["perf/gen_s"] for r in timed], "update": [r["perf/update_s"] for r in timed],
            "generate_calls": [counter["calls"] / args.steps],
            "calls_per_completion": [sum(r.get("tools/calls", 0.0) for r in records) / completions]}


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    deciles = statistics.quantiles(values, n=10)
    return f"{statistics.median(values):.3f} ({deciles[0]:.3f}-{deciles[-1]:.3f})"


def main(argv=None) -> int:
    from bench_vs_comlrl import cpu_state

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2, help="tool calls per completion (default 2)")
    p.add_argument("--segment", type=int, default=24,
                   help="model tokens per segment (default 24, about the shortest call; 8: the stress case)")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating off/on (default 3)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every run")
    args = p.parse_args(argv)
    print(cpu_state())
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; batch {args.batch_size} "
          f"trees, K={args.k}, length_ratio ({args.agents} agents, 1 turn); {args.calls} forced calls x "
          f"{args.segment}-token segments, {args.steps} steps x {args.repeats} runs per mode")
    runs: dict[bool, list[dict[str, list[float]]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for tools_on in (False, True):
                runs[tools_on].append(run(args, tools_on, Path(tmp) / f"r{repeat}-{int(tools_on)}"))
    results = {tools_on: {key: [v for out in outs for v in out[key]] for key in outs[0]}
               for tools_on, outs in runs.items()}
    print(f"{'tools':>5} {'step_s median (p10-p90)':>28} {'gen_s':>7} {'update_s':>8} {'tool_s':>8} "
          f"{'generate calls/step':>20} {'calls/completion':>17}")
    for tools_on, r in results.items():
        print(f"{'on' if tools_on else 'off':>5} {spread(r['step']):>28} {statistics.median(r['gen']):>7.3f} "
              f"{statistics.median(r['update']):>8.3f} {statistics.median(r['tools']):>8.4f} "
              f"{statistics.median(r['generate_calls']):>20.1f} {statistics.median(r['calls_per_completion']):>17.2f}")
    print(f"ratio (step with tools - tool seconds) / step without: {ratio(results[False], results[True]):.2f} "
          "(target <= ~1.3)")
    if args.repeats > 1:  # each run with tools against the run without just before it: the machine's drift cancels
        pairs = [ratio(off, on) for off, on in zip(runs[False], runs[True])]
        print(f"the same ratio run by run: median {statistics.median(pairs):.2f} (min {min(pairs):.2f}, max "
              f"{max(pairs):.2f}): {', '.join(f'{r:.2f}' for r in pairs)}")
    return 0


def ratio(off: dict[str, list[float]], on: dict[str, list[float]]) -> float:
    """(median step with tools - median tool seconds) / median step without."""
    return (statistics.median(on["step"]) - statistics.median(on["tools"])) / statistics.median(off["step"])


if __name__ == "__main__":
    sys.exit(main())
