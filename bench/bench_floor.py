"""How far a training step is from its floor, phase by phase (HF backend).

Runs `--steps` training steps of a config (any `train.py` overrides) and records what the step
actually did: every decode call (its rows' prompt ids and completion lengths) and every agent's
update (its samples). Then it times the floor of the same work on the same model:

- generate: one plain `model.generate` per recorded decode call, over exactly those rows (the same
  batch size, each row its own prompt), forced to decode exactly as many tokens as the call did
  (its longest completion), sampling with the run's temperature / top-p / top-k, the agent's adapter on;
- update: one forward and backward per recorded micro-batch size over the same prompt + completion
  tokens (log-probs of the completion tokens summed), no optimizer step.

For generate it also times a bare floor: the model's own forward, one per token over the same rows
with a KV cache, the adapters off, the next token by argmax, no sampling and no `generate` around it:
what decoding those tokens costs the model itself (the `bare` columns).

Scoring and feedback have no floor here (the env's and feedback's own work); they are printed as
measured. The first step is a warm-up and is left out of the means when there are more steps.

    .venv/bin/python bench/bench_floor.py                                   # tiny model, toy env
    .venv/bin/python bench/bench_floor.py --steps 2 model=smollm2-135m env=code trainer.batch_size=1

It prints numbers and asserts nothing; run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULTS = ["env=length_ratio", "model=tiny", "external=length_ratio", "trainer.batch_size=4",
            "trainer.num_generations=4", "trainer.num_turns=2", "generation.max_new_tokens=32"]
QUIET = ["eval.at_end=false", "eval.at_start=false", "eval.every=0", "logging.wandb.mode=disabled",
         "logging.progress=false", "logging.samples_every=0", "logging.rollouts=false", "model.device=cpu"]


class Recorder:
    """Wraps the HF backend's decode and the updater's step to keep what they were given."""

    def __init__(self):
        self.decodes: list[dict] = []  # per decode call: rows' prompt ids, completion lengths, model
        self.updates: list[dict] = []  # per agent update: samples, micro-batch size, model, step index
        self.step = 0  # the current training step
        self.collecting = False  # decodes outside a step's rollout (evaluation) are not the step's

    def install(self):
        from magrpo.backends.hf import HFBackend
        from magrpo.update import AgentUpdater

        recorder, real_rows, real_step = self, HFBackend._generate_rows, AgentUpdater.step

        def generate_rows(backend, requests, rows, keys, prompt_ids, params, *args, **kwargs):
            completions = real_rows(backend, requests, rows, keys, prompt_ids, params, *args, **kwargs)
            if not recorder.collecting:
                return completions
            agent = backend.agents[requests[rows[0]].agent]
            recorder.decodes.append({"step": recorder.step, "agent": agent, "params": params,
                                     "prompts": [prompt_ids[r] for r in rows],
                                     "lengths": [len(c.token_ids) for c in completions]})
            return completions

        def step(updater, samples, settings, micro_batch_size, *args, **kwargs):
            recorder.updates.append({"step": recorder.step, "agent": updater.agent, "samples": list(samples),
                                     "micro": micro_batch_size})
            return real_step(updater, samples, settings, micro_batch_size, *args, **kwargs)

        HFBackend._generate_rows, AgentUpdater.step = generate_rows, step
        return lambda: (setattr(HFBackend, "_generate_rows", real_rows), setattr(AgentUpdater, "step", real_step))


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (rows, longest prompt): the mask comes from the lengths, since a
    prompt may contain the pad id itself."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def floor_generate(call: dict) -> float:
    agent, params = call["agent"], call["params"]
    model, tok = agent.model, agent.tokenizer
    ids, mask = left_padded(call["prompts"], tok.pad_token_id)
    steps = max(call["lengths"])
    model.set_adapter(agent.adapter)
    sampling = {
        "do_sample": True,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or None,
    }
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       pad_token_id=tok.pad_token_id, **sampling)
    return time.perf_counter() - start


def floor_forward(call: dict) -> float:
    """The bare decode: prefill every row, then one forward per token, base model, argmax."""
    from magrpo.models import cache_keyword

    agent = call["agent"]
    model = agent.model
    ids, mask = left_padded(call["prompts"], agent.tokenizer.pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    key = cache_keyword(model)
    start = time.perf_counter()
    with torch.no_grad(), model.disable_adapter():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        for _ in range(max(call["lengths"]) - 1):
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            out = model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), attention_mask=mask,
                        position_ids=positions, use_cache=True, **{key: out[key]})
    return time.perf_counter() - start


def floor_update(update: dict) -> float:
    agent, samples, micro = update["agent"], update["samples"], update["micro"]
    model, pad = agent.model, agent.tokenizer.pad_token_id
    model.set_adapter(agent.adapter)
    start = time.perf_counter()
    for lo in range(0, len(samples), micro):
        part = samples[lo: lo + micro]
        seqs = [s.prompt_ids + s.completion_ids for s in part]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        targets = torch.zeros_like(ids, dtype=torch.bool)
        for row, s in enumerate(part):
            targets[row, len(s.prompt_ids): len(s.prompt_ids) + len(s.completion_ids)] = True
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (logp * targets[:, 1:]).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def progress(message: str) -> None:
    print(f"bench_floor: {message}", file=sys.stderr, flush=True)


def measure(overrides: list[str], steps: int) -> dict[str, dict[str, float]]:
    """{phase: {"step": mean seconds, "floor": mean seconds or None, "bare": mean seconds or None}} over
    the measured steps."""
    import magrpo.envs
    import magrpo.external  # noqa: F401
    from magrpo.cli import compose
    from magrpo.trainer import train

    recorder = Recorder()
    uninstall = recorder.install()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose([*DEFAULTS, *overrides, *QUIET, f"trainer.steps={steps}", f"logging.run_dir={tmp}/run"])
        import magrpo.trainer as trainer_module

        real_collect = trainer_module.Run.collect

        def collect(run, step):
            recorder.step, recorder.collecting = step, True
            try:
                return real_collect(run, step)
            finally:
                recorder.collecting = False

        trainer_module.Run.collect = collect
        try:
            progress(f"training {steps} step(s), recording every decode call and update")
            run_dir = train(cfg)
        finally:
            trainer_module.Run.collect = real_collect
            uninstall()
        metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        measured = [m for m in metrics if m["step"] >= (2 if steps > 1 else 1)]
        # Floors only for the measured steps: the warm-up step's would be timed and thrown away.
        per_step = {m["step"]: {"generate": 0.0, "bare": 0.0, "update": 0.0} for m in measured}
        decodes = [call for call in recorder.decodes if call["step"] in per_step]
        updates = [update for update in recorder.updates if update["step"] in per_step]
        for i, call in enumerate(decodes, 1):
            progress(f"floor of decode call {i}/{len(decodes)} ({len(call['prompts'])} rows)")
            per_step[call["step"]]["generate"] += floor_generate(call)
            per_step[call["step"]]["bare"] += floor_forward(call)
        for i, update in enumerate(updates, 1):
            progress(f"floor of agent update {i}/{len(updates)} ({len(update['samples'])} samples)")
            per_step[update["step"]]["update"] += floor_update(update)
    kept = [per_step[m["step"]] for m in measured]

    def mean(values):
        return statistics.fmean(values) if values else 0.0

    out = {
        "generate": {"step": mean([m["perf/gen_s"] for m in measured]), "floor": mean([f["generate"] for f in kept]),
                     "bare": mean([f["bare"] for f in kept])},
        "score": {"step": mean([m["perf/reward_s"] for m in measured]), "floor": None, "bare": None},
        "feedback": {"step": mean([m["perf/feedback_s"] for m in measured]), "floor": None, "bare": None},
        "update": {"step": mean([m["perf/update_s"] for m in measured]), "floor": mean([f["update"] for f in kept]),
                   "bare": mean([f["update"] for f in kept])},
    }
    out["step"] = {"step": mean([m["perf/step_s"] for m in measured]),
                   "floor": out["generate"]["floor"] + out["update"]["floor"],
                   "bare": out["generate"]["bare"] + out["update"]["bare"]}
    return out


def table(result: dict[str, dict[str, float]]) -> str:
    """Markdown: each phase's step seconds next to its floor (plain generate / forward-backward) and its
    bare floor (the decode as bare forwards; the update's floor again)."""
    lines = ["| phase | step s | floor s | step / floor | bare floor s | step / bare |",
             "|---|---:|---:|---:|---:|---:|"]
    for phase, r in result.items():
        cells = [f"{r['step']:.3f}"]
        for floor in (r["floor"], r["bare"]):
            cells += [f"{floor:.3f}", f"{r['step'] / floor:.2f}"] if floor else ["-", "-"]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (the first is a warm-up when > 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args, overrides = parser.parse_known_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"bench_floor: load average {load:.1f} on {os.cpu_count()} CPUs: other work skews these numbers",
              file=sys.stderr)
    print(table(measure(overrides, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
