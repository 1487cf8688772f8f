"""Does a finished `torchrun --nproc_per_node=2` run always exit 0? Runs a tiny training N times in a
row (each round: 2 steps with a checkpoint, then `resume=auto` to step 3, as
tests/test_data_parallel.py does) and counts exits: 0, aborted (a rank killed by a signal, e.g.
SIGABRT from `terminate called without an active exception`), other failures. It asserts nothing;
the exit status is 1 when any run did not exit 0.

    .venv/bin/python bench/stress_torchrun_exit.py                   # 5 rounds (10 runs), ~10-20 s a run on 2 cores
    .venv/bin/python bench/stress_torchrun_exit.py 20                # N rounds
    .venv/bin/python bench/stress_torchrun_exit.py 20 --collectives  # N runs of tests/gloo_exit_probe.py, ~3 s each
    ~/.cache/magrpo/vllm-venv/bin/python bench/stress_torchrun_exit.py 2 --vllm  # backend=vllm, ~60-90 s a run

--collectives skips the model: a World, the late `torch.distributed.nn` import that model loading
makes, 20 rounds of collectives, close. Before World imported torch.distributed.nn ahead of
init_process_group, 4 of 10 such runs aborted on a loaded 2-core machine; the training runs, whose
last collective is further from the exit, aborted far more rarely (0 in 58 here).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ["env=length_ratio", "model=tiny", "external=length_ratio", "logging.progress=false",
            "logging.wandb.mode=disabled", "trainer.batch_size=3", "trainer.num_generations=2",
            "generation.max_new_tokens=10", "eval.every=1", "eval.at_end=false", "eval.max_problems=3",
            "eval.num_samples=2", "checkpoint.every=1"]


def launch(script: str, *args: str) -> tuple[str, str]:
    """('ok' | 'aborted' | 'failed', the stderr lines that say why)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode == 0:
        return "ok", ""
    # torchrun reports a rank killed by a signal as "Signal 6 (SIGABRT) received by PID ..."
    aborted = "terminate called" in proc.stderr or "SIGABRT" in proc.stderr or "Signal " in proc.stderr
    why = [line for line in proc.stderr.splitlines() if "terminate" in line or "Signal" in line or "rror" in line]
    return "aborted" if aborted else "failed", "\n".join(why[-5:]) or proc.stderr[-1000:]


def main() -> int:
    args = [a for a in sys.argv[1:] if a not in ("--collectives", "--vllm")]
    backend = ["backend=vllm"] if "--vllm" in sys.argv else []  # one engine per process, stopped at exit
    rounds = int(args[0]) if args else 5
    counts = {"ok": 0, "aborted": 0, "failed": 0}
    for i in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            if "--collectives" in sys.argv:
                runs = [("collectives", "tests/gloo_exit_probe.py", [])]
            else:
                stages = (("fresh", ["trainer.steps=2"]), ("resume", ["trainer.steps=3", "resume=auto"]))
                runs = [(label, "train.py", [*SETTINGS, *backend, f"logging.run_dir={run_dir}", *overrides])
                        for label, overrides in stages]
            for label, script, script_args in runs:
                start = time.perf_counter()
                outcome, why = launch(script, *script_args)
                counts[outcome] += 1
                print(f"round {i + 1}/{rounds} {label}: {outcome} ({time.perf_counter() - start:.0f} s)", flush=True)
                if why:
                    print("    " + why.replace("\n", "\n    "), flush=True)
    total = sum(counts.values())
    print(f"{total} torchrun runs: {counts['ok']} exited 0, {counts['aborted']} aborted, "
          f"{counts['failed']} failed otherwise")
    return 0 if counts["ok"] == total else 1


if __name__ == "__main__":
    sys.exit(main())
