"""Side-by-side speed of magrpo and the reference CoMLRL (comlrl==1.4.3) MAGRPO trainer.

Prints seconds per prompt for both libraries and the ratio comlrl / magrpo, per joint mode, plus the
machine facts. A benchmark that prints numbers: nothing here asserts on speed.

    python bench/bench_vs_comlrl.py                      # defaults below, ~2 min on 2 idle CPU cores
    python bench/bench_vs_comlrl.py --modes align --prompts 32 --comlrl-prompts 16 --threads 1

Fairness rules (what is held equal)
- Model: magrpo's tiny model folder (`magrpo.tiny.tiny_model_path()`, a ~1M-param Qwen2 whose
  tokenizer has pad != eos and no chat template, so both libraries feed the raw prompt text).
  comlrl gets one `AutoModelForCausalLM.from_pretrained(path)` per agent (as it expects) and one
  `AutoTokenizer.from_pretrained(path)` per agent; magrpo loads the same folder (`model.name=tiny`).
- Prompts: the length-ratio env's train problems, in order. comlrl trains on problems[:P_c]; magrpo
  on env.train_size=P_m, i.e. problems[:P_m] (the same list, P_c <= P_m by default), one epoch.
  Each agent's turn-0 prompt is `env.agent_prompts(problem)[i]` (comlrl: per-agent formatters
  returning exactly that, and returning comlrl's external prompt on later turns).
- Reward: `env.rewards([problem], [[text_a, text_b]])[0]`, wrapped to comlrl's reward signature.
- Between turns: `magrpo.envs.length_ratio.length_ratio_feedback` for both (comlrl `external_transition`,
  magrpo `external.mode=length_ratio`); it has comlrl's signature.
- Tree: N=2 agents, K=4 generations, T=2 turns, 32 new tokens, no early termination (comlrl's
  default threshold -0.2 would silently skip turn 2 for these non-negative rewards, so it is set to
  None), in both joint modes (magrpo align/cross = comlrl aligned/cross). The script checks and
  prints nodes per prompt: 1 + K = 5 (align) and 1 + K^2 = 17 (cross) for both.
- Sampling: temperature 1.0, top_p 1.0, top_k off (comlrl top_k=0, which transformers treats as
  off; its default 50 would add a top-k filter magrpo does not do). Same seed for both.
- Threads: `torch.set_num_threads(--threads)` (default: torch's default), the same for both, printed.
- Warm-up: one throwaway run of each library (1 prompt, T=1) before anything is timed, so one-off
  first-call costs (lazy imports, first generate/backward) are not charged to either.
- Timing: comlrl = wall clock of `trainer.train()` only (model loading excluded). magrpo = the sum of
  its per-step `perf/step_s` from metrics.jsonl (rollout + update of each step); the wall clock of
  the whole `train()` call (which also loads the models, writes the run dir and saves adapters) is
  printed too, with the model-loading part measured separately. The ratio uses the step sum.
- Both libraries train: comlrl updates full weights with its own AdamW (lr 5e-6, rollout buffer 2,
  one forward per sequence), magrpo LoRA adapters (r=16, all-linear, micro-batches of 32). Those
  are each library's own defaults and part of what is being compared.
- wandb is off for both (comlrl: no wandb_config and WANDB_MODE=disabled; magrpo:
  logging.wandb.mode=disabled), comlrl runs no evaluation (eval_interval=0, no eval dataset),
  magrpo writes no rollouts (logging.rollouts=false) and shows no progress bar.

Workarounds applied to comlrl (none changes what it computes):
- `trainer.verbose = False` after construction (hides its tqdm bar; it reads verbosity from a
  wandb config we do not pass).
- Its `_generate_completions` and `_update_from_samples` are wrapped on the instance only to time
  them and count generated tokens / generate calls; the wrapped methods run unchanged.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "bench"):  # envs/ and external/ live at the repo root, keyword_task here
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from comlrl_pair import COMLRL_MODE, TASKS, Task, Tree, comlrl_trainer, magrpo_overrides  # noqa: E402

TREE = Tree()  # N=2 agents, K=4, T=2, 32 new tokens, temperature 1.0, top_p 1.0, top_k off
NUM_AGENTS, K, T, MAX_NEW = TREE.num_agents, TREE.k, TREE.turns, TREE.max_new_tokens
DEFAULT_COMLRL_PROMPTS = {"align": 8, "cross": 4}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- magrpo

def run_magrpo(task: Task, mode: str, prompts: int, batch_size: int, turns: int, seed: int, quiet: bool,
               model: str | None = None, extra: tuple[str, ...] = ()) -> dict:
    """Train magrpo on `prompts` problems in steps of `batch_size` trees; its timings per step. `model`: a
    configs/model group (e.g. smollm2-135m) instead of the task's tiny model; `extra`: more overrides."""
    import magrpo.envs
    import magrpo.external  # noqa: F401  (registers the feedback modes)
    import magrpo.models as models
    from magrpo.cli import compose
    from magrpo.trainer import train

    batch_size = min(batch_size, prompts)
    if prompts % batch_size:
        raise SystemExit(f"--prompts ({prompts}) must be a multiple of --batch-size ({batch_size})")
    with tempfile.TemporaryDirectory(prefix="magrpo-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        cfg = compose([
            *magrpo_overrides(task, replace(TREE, turns=turns), mode, prompts, batch_size, seed,
                              model=model),
            *extra,
            "logging.progress=false",
            "logging.rollouts=false",
            "logging.wandb.mode=disabled",
            f"logging.run_dir={run_dir}",
        ])
        # Timing-only wrapper: train() imports load_agents from magrpo.models at call time.
        load = {"s": 0.0}
        original_load = models.load_agents

        def timed_load(*a, **kw):
            t0 = time.perf_counter()
            try:
                return original_load(*a, **kw)
            finally:
                load["s"] += time.perf_counter() - t0

        models.load_agents = timed_load
        seed_all(seed)
        stderr = io.StringIO() if quiet else sys.stderr
        try:
            with contextlib.redirect_stderr(stderr):
                t0 = time.perf_counter()
                train(cfg)
                wall = time.perf_counter() - t0
        finally:
            models.load_agents = original_load
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["perf/step_s"] for r in rows]
    tokens = sum(r["perf/tokens_per_s"] * r["perf/gen_s"] for r in rows)
    return {
        "prompts": prompts,
        "time_s": sum(steps),
        "step_s": steps,
        "gen_s": sum(r["perf/gen_s"] for r in rows),
        "update_s": sum(r["perf/update_s"] for r in rows),
        "wall_s": wall,
        "load_s": load["s"],
        "nodes": sum(r["tree/nodes"] for r in rows),
        "tokens": tokens,
        # mean over every joint action of every turn (what comlrl's reward calls average over)
        "reward": _all_turn_reward(rows, turns, K if mode == "align" else K ** NUM_AGENTS),
    }


def _all_turn_reward(rows: list[dict], turns: int, joint: int) -> float:
    num = den = 0.0
    for r in rows:
        for t in range(turns):
            key = f"train/turn_{t}/reward_mean"
            if key in r:
                weight = joint ** (t + 1)  # joint actions at turn t, per tree (no early termination)
                num += r[key] * weight
                den += weight
    return num / den if den else float("nan")


# ---------------------------------------------------------------- comlrl

def run_comlrl(task: Task, mode: str, prompts: int, turns: int, seed: int) -> dict:
    problems = task.environment().problems("train")[:prompts]
    rewards_seen: list[float] = []
    seed_all(seed)
    t0 = time.perf_counter()
    trainer = comlrl_trainer(task, replace(TREE, turns=turns), mode, problems,
                             on_reward=lambda _problem, _texts, r: rewards_seen.append(r))
    load_s = time.perf_counter() - t0
    trainer.verbose = False  # workaround: no tqdm bar (comlrl reads verbosity from a wandb config)

    # Timing-only wrappers on this instance; the wrapped methods run unchanged.
    stats = {"gen_s": 0.0, "update_s": 0.0, "gen_calls": 0, "tokens": 0, "feedback_prompts": 0}
    generate, update = trainer._generate_completions, trainer._update_from_samples

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        out = generate(*a, **kw)
        stats["gen_s"] += time.perf_counter() - t
        stats["gen_calls"] += 1
        stats["tokens"] += sum(out["response_lens"])
        stats["feedback_prompts"] += sum(task.marker in p for p in out["prompts"])
        return out

    def timed_update(*a, **kw):
        t = time.perf_counter()
        try:
            return update(*a, **kw)
        finally:
            stats["update_s"] += time.perf_counter() - t

    trainer._generate_completions = timed_generate
    trainer._update_from_samples = timed_update

    seed_all(seed)
    t0 = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - t0
    return {
        "prompts": prompts,
        "time_s": elapsed,
        "load_s": load_s,
        "gen_s": stats["gen_s"],
        "update_s": stats["update_s"],
        "nodes": stats["gen_calls"] / NUM_AGENTS,
        "feedback_prompts": stats["feedback_prompts"],
        "tokens": stats["tokens"],
        "reward": float(np.mean(rewards_seen)) if rewards_seen else float("nan"),
    }


# ---------------------------------------------------------------- report

def machine_facts(threads: int, default_threads: int) -> list[str]:
    import transformers

    def version(name: str) -> str:
        try:
            from importlib.metadata import PackageNotFoundError
            from importlib.metadata import version as v
            return v(name)
        except PackageNotFoundError:
            return "?"

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return [
        f"machine: {cpu}; os.cpu_count()={os.cpu_count()}; cuda available: {torch.cuda.is_available()}",
        (f"torch threads: intra-op {threads} (torch default {default_threads}), "
         f"inter-op {torch.get_num_interop_threads()}"),
        (f"python {platform.python_version()}; torch {torch.__version__}; transformers {transformers.__version__}; "
         f"peft {version('peft')}; comlrl {version('comlrl')}; magrpo {version('magrpo')}"),
    ]


def cpu_state(sample_s: float = 1.0) -> str:
    """Load average, plus how busy all CPUs are over `sample_s` while this process sleeps: anything
    well above zero is another process competing with the benchmark."""
    def ticks():
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        one, five, fifteen = os.getloadavg()
        total0, idle0 = ticks()
        time.sleep(sample_s)
        total1, idle1 = ticks()
    except (OSError, ValueError, IndexError):
        return "cpu state unavailable"
    busy = 1.0 - (idle1 - idle0) / max(total1 - total0, 1)
    note = ""
    if busy > 0.25:
        note = " -- WARNING: other processes are using the CPUs, timings are unreliable"
    return (f"CPUs {busy:.0%} busy while the bench idles{note}; "
            f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores")


def per_prompt(r: dict, key: str) -> float:
    return r[key] / r["prompts"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(TASKS), default="length_ratio",
                   help="env, feedback and tiny model (default length_ratio)")
    p.add_argument("--modes", nargs="+", choices=["align", "cross"], default=["align", "cross"])
    p.add_argument("--prompts", type=int, default=16, help="magrpo prompts per mode (default 16)")
    p.add_argument("--batch-size", type=int, default=16, help="magrpo prompts per step (default 16)")
    p.add_argument("--comlrl-prompts", type=int, default=None,
                   help="comlrl prompts per mode (default: 8 for align, 4 for cross)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up runs")
    p.add_argument("--verbose", action="store_true", help="show magrpo's own stderr lines")
    a = p.parse_args(argv)

    default_threads = torch.get_num_threads()
    threads = a.threads or default_threads
    torch.set_num_threads(threads)
    start = time.perf_counter()
    task = TASKS[a.task]
    print(f"magrpo vs comlrl: N=2 agents, K=4, T=2, 32 new tokens, temperature 1.0, {task.about}")
    for line in machine_facts(threads, default_threads):
        print("  " + line)
    print("  " + cpu_state())
    import transformers

    import magrpo.envs
    import magrpo.external  # noqa: F401
    from magrpo.tiny import tiny_model_path

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars, once per model load

    log(f"tiny model at {tiny_model_path(task.spec())}")

    if not a.no_warmup:
        log("warm-up: magrpo (1 prompt, T=1) ...")
        run_magrpo(task, "align", 1, 1, 1, a.seed, quiet=not a.verbose)
        log("warm-up: comlrl (1 prompt, T=1) ...")
        run_comlrl(task, "align", 1, 1, a.seed)
        log("warm-up done")

    results: dict[str, dict[str, dict]] = {}
    for mode in a.modes:
        results[mode] = {}
        log(f"{mode}: magrpo, {a.prompts} prompts, batch {min(a.batch_size, a.prompts)} ...")
        m = run_magrpo(task, mode, a.prompts, a.batch_size, T, a.seed, quiet=not a.verbose)
        results[mode]["magrpo"] = m
        log(f"{mode}: magrpo done: steps {', '.join(f'{s:.2f}' for s in m['step_s'])} s; "
            f"train() wall {m['wall_s']:.2f} s (model load {m['load_s']:.2f} s)")
        cp = a.comlrl_prompts or DEFAULT_COMLRL_PROMPTS[mode]
        log(f"{mode}: comlrl ({COMLRL_MODE[mode]}), {cp} prompts ...")
        c = run_comlrl(task, mode, cp, T, a.seed)
        results[mode]["comlrl"] = c
        log(f"{mode}: comlrl done: train() {c['time_s']:.2f} s (model load {c['load_s']:.2f} s, not timed)")

    print()
    print("seconds per prompt (magrpo: sum of perf/step_s; comlrl: trainer.train() wall clock)")
    head = f"{'mode':<6} {'library':<7} {'prompts':>7} {'s/prompt':>9} {'gen':>7} {'update':>7} " \
           f"{'nodes/p':>8} {'tok/p':>7} {'reward':>7}"
    print(head)
    print("-" * len(head))
    for mode, by_lib in results.items():
        for lib in ("magrpo", "comlrl"):
            r = by_lib[lib]
            print(f"{mode:<6} {lib:<7} {r['prompts']:>7} {per_prompt(r, 'time_s'):>9.3f} "
                  f"{per_prompt(r, 'gen_s'):>7.3f} {per_prompt(r, 'update_s'):>7.3f} "
                  f"{per_prompt(r, 'nodes'):>8.1f} {per_prompt(r, 'tokens'):>7.0f} {r['reward']:>7.3f}")
    print()
    for mode, by_lib in results.items():
        m, c = by_lib["magrpo"], by_lib["comlrl"]
        ratio = per_prompt(c, "time_s") / per_prompt(m, "time_s")
        wall = (m["wall_s"] - m["load_s"]) / m["prompts"]
        print(f"{mode}: comlrl / magrpo = {ratio:.1f}x per prompt "
              f"(magrpo train() wall minus model load: {wall:.3f} s/prompt -> {per_prompt(c, 'time_s') / wall:.1f}x)")
        expected_nodes = 1 + (K if mode == "align" else K ** NUM_AGENTS)
        for lib, r in by_lib.items():
            if abs(per_prompt(r, "nodes") - expected_nodes) > 1e-9:
                print(f"  WARNING: {lib} expanded {per_prompt(r, 'nodes'):.1f} nodes/prompt, expected {expected_nodes}")
        want_fb = (expected_nodes - 1) * NUM_AGENTS * c["prompts"]
        if c["feedback_prompts"] != want_fb:
            print(f"  WARNING: comlrl generated from {c['feedback_prompts']} feedback prompts, expected {want_fb}")
    print()
    print("notes: gen/update = seconds per prompt inside generation / optimizer updates; nodes/p = tree nodes per")
    print("  prompt (each node: K samples from each agent); tok/p = generated tokens per prompt; reward = mean")
    print("  reward over all joint actions of all turns. Both libraries train: comlrl updates full weights (AdamW,")
    print("  rollout buffer 2, one forward per sequence), magrpo updates LoRA adapters (one step per batch).")
    print("  comlrl is timed around trainer.train() (model loading excluded); magrpo by its per-step times.")
    print(f"after the runs: {cpu_state()}")
    print(f"total bench runtime {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
