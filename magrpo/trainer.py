"""The MAGRPO-MT loop, top to bottom: expand trees -> feedback -> advantages -> per-agent update -> log."""
from __future__ import annotations

import random
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from . import checkpoint
from .config import ConfigError, TrainConfig, check_finite, check_tree_size, step_size, validate
from .distributed import World, reduce_counters, world_from_env
from .env import Environment, call_env, make_env
from .errors import log_traceback
from .evaluation import evaluate
from .feedback import Feedback
from .generation import SamplingParams, make_backend
from .loss import kept_completions
from .rollout import Rollout, TreeSettings, assign_advantages, expand_trees, merge_rollouts, portable
from .run_io import NullWriter, RunWriter, make_run_dir, tree_records
from .sampling import stream_key
from .tree import count_leaves
from .update import AgentUpdater, TrainSample


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class ProblemSampler:
    """Epoch-wise shuffled order over the train problems, seeded."""

    def __init__(self, problems, seed: int):
        if not problems:  # prepare() reports an empty split; this guard keeps next() from looping forever
            raise TrainingError("the train split has no problems")
        self.problems, self.rng, self.order = problems, np.random.default_rng(seed), []

    def state(self) -> dict:
        return {"order": list(self.order), "rng": self.rng.bit_generator.state}

    def load_state(self, state: dict) -> None:
        self.order = list(state["order"])
        self.rng.bit_generator.state = state["rng"]

    def next(self, batch_size: int) -> list:
        while len(self.order) < batch_size:
            self.order.extend(self.rng.permutation(len(self.problems)).tolist())
        picked, self.order = self.order[:batch_size], self.order[batch_size:]
        return [self.problems[i] for i in picked]


def prepare(cfg: TrainConfig) -> tuple[Environment, Feedback]:
    """Everything that can fail on bad input, before any model loads and before the run dir exists
    (the data, an expert endpoint and its key included)."""
    validate(cfg)
    env = make_env(cfg.env)
    check_finite(env.cfg, "env")
    if len(cfg.agents) > env.num_agents:
        raise ConfigError("agents", f"{len(cfg.agents)} entries for {env.num_agents} agent(s); give at most one per agent")
    _check_split(env, "train")
    if evaluates(cfg):
        _check_split(env, "eval")
    check_tree_size(cfg, env.num_agents)
    feedback = Feedback(cfg.external, env)
    feedback.check()
    return env, feedback


def evaluates(cfg: TrainConfig) -> bool:
    return bool(cfg.eval.at_end or cfg.eval.every or cfg.eval.at_start)


def _check_split(env: Environment, split: str) -> None:
    """Load a split now (the env caches it): bad data is a start-up error, and an empty split would
    leave nothing to sample."""
    problems = call_env(env, "problems", split, where=f"loading the {split} split")
    if not problems:
        key = env.split_keys.get(split, "env")
        value = getattr(env.cfg, key.partition(".")[2], None)
        hint = "" if split == "train" else "; or turn evaluation off: eval.at_end=false (and eval.every=0, eval.at_start=false)"
        what = f"{value!r} selects no {split} problems" if value is not None else f"the {split} split has no problems"
        raise ConfigError(key, f"{what}; give a split with at least one{hint}")


class TrainingError(RuntimeError):
    """Training cannot go on (reported as one line by the CLI); the last checkpoint is intact."""


# Domains of the sampling streams: training rollouts and evaluation paths never share a stream.
TRAIN_STREAM, EVAL_STREAM = 0, 1


def train(cfg: TrainConfig, prepared: tuple[Environment, Feedback] | None = None) -> Path:
    env, feedback = prepared or prepare(cfg)
    t = cfg.trainer
    world = world_from_env(cfg.model.device, t.dist_timeout_min)
    try:
        return _train(cfg, env, feedback, world)
    finally:
        world.close()


def _train(cfg: TrainConfig, env: Environment, feedback: Feedback, world: World) -> Path:
    # Before any model loads: a resume that does not match its run stops here (rank 0 decides).
    chosen = checkpoint.on_main(world, lambda: checkpoint.choose(cfg.resume, cfg.logging.run_dir, asdict(cfg)))
    seed_everything(cfg.trainer.seed)  # the same on every rank: identical initial adapters
    t = cfg.trainer
    from .models import load_agents

    agents = load_agents(cfg, env.num_agents)
    backend = make_backend(cfg, agents)
    updaters = [AgentUpdater(a, t.lr, t.weight_decay, t.warmup_steps) for a in agents]
    run_dir = Path(world.broadcast(str(make_run_dir(cfg.logging.run_dir, cfg.env["name"])) if world.is_main else None))
    sampler = ProblemSampler(env.problems("train"), t.seed)  # the same order on every rank; each takes its shard
    first_step, env_step = 1, 0
    # Rank 0 reads the checkpoint (other machines need no shared disk); its errors stop every rank.
    found = checkpoint.on_main(world, lambda: checkpoint.read(chosen, agents, updaters)) if chosen else None
    state = checkpoint.apply(found, updaters) if found else None
    if state:
        first_step, env_step = state["step"] + 1, state["env_step"]
        sampler.load_state(state["sampler"])
        ranks = state["ranks"]
        if len(ranks) != world.size and world.is_main:
            print(f"magrpo: the checkpoint was written by {len(ranks)} process(es), resuming with {world.size}: "
                  f"rollouts are the same (seeded per tree), other random draws (LoRA dropout) are not",
                  file=sys.stderr)
        mine = ranks[min(world.rank, len(ranks) - 1)]
        checkpoint.set_rng_state(mine["rng"])
        env.load_state(mine["env"])
    if world.is_main:  # only now, with a matching checkpoint loaded (or none to match), is the run dir touched
        checkpoint.claim_run_dir(run_dir, state["step"] if state else None)
    writer = RunWriter(run_dir, asdict(cfg), cfg.logging.wandb) if world.is_main else NullWriter()
    eval_problems = env.problems("eval")[: cfg.eval.max_problems or None] if evaluates(cfg) else []
    tree = TreeSettings(t.num_generations, t.num_turns, t.joint_mode, t.early_termination_threshold, cfg.reward.on_error,
                        t.expand, t.resample_zero_std, t.cross_credit, cfg.reward.team_weight)
    bad_in_row = 0
    micro = [t.micro_batch_size]  # halved for the rest of the run after an out-of-memory
    g = cfg.generation
    # Sampling log-probs feed the train/inference mismatch metrics and truncated importance sampling.
    sampling = SamplingParams(g.max_new_tokens, g.temperature, g.top_p, g.top_k, logprobs=True)
    if world.is_main:
        procs = f", {world.size} processes" if world.size > 1 else ""
        nodes, completions = step_size(cfg, env.num_agents)
        print(f"magrpo: {env.num_agents} agent(s), K={t.num_generations}, T={t.num_turns}, {t.joint_mode}{procs}; "
              f"up to {nodes:,} nodes and {completions:,} completions per step; run dir {run_dir}", file=sys.stderr)
    bar = _progress(t.steps, cfg.logging.progress and world.is_main, initial=first_step - 1)
    stop = _StopSignals()

    def save_checkpoint(step: int) -> None:
        ranks = world.gather({"rng": checkpoint.rng_state(), "env": env.state()})
        if world.is_main:
            state = {"step": step, "env_step": env_step, "sampler": sampler.state(), "ranks": ranks}
            checkpoint.save(run_dir, step, agents, updaters, state, asdict(cfg), cfg.checkpoint.keep)

    def own_metrics(*parts: dict[str, float]) -> dict[str, float]:
        """The env's, feedback's and backend's own numbers, merged over ranks (rank 0)."""
        merged: dict[str, float] = {}
        for part in parts:
            merged.update(part)
        return reduce_counters(world.gather(merged) or [{}])

    def run_eval(step: int) -> dict[str, float]:
        bar.write(f"magrpo: evaluating {len(eval_problems)} problem(s), greedy + {cfg.eval.num_samples} sample(s), "
                  f"{t.num_turns} turn(s)", file=sys.stderr)
        out = evaluate(env, backend, feedback, eval_problems, t.num_turns, sampling, cfg.eval.num_samples,
                       seed=stream_key(t.seed, step, EVAL_STREAM), world=world,
                       early_termination_threshold=t.early_termination_threshold, on_reward_error=cfg.reward.on_error)
        if not world.is_main:
            return out
        last = t.num_turns - 1
        summary = ", ".join(f"{key.split('/', 2)[2]} {out[key]:.3f}" for key in
                            (f"eval/turn_{last}/greedy_reward_mean", f"eval/turn_{last}/pass@1_greedy") if key in out)
        bar.write(f"magrpo: eval turn {last + 1}: {summary} ({out['perf/eval_s']:.0f} s)", file=sys.stderr)
        return out

    try:
        if cfg.eval.at_start and first_step == 1:
            start_eval = run_eval(0)
            writer.log_metrics(0, {**start_eval, **own_metrics(feedback.metrics(), backend.metrics())})
        for step in range(first_step, t.steps + 1):
            start = time.perf_counter()
            tokens_before = backend.generated_tokens
            problems = sampler.next(t.batch_size)
            lo, hi = world.shard(len(problems))  # this rank's trees; sampling is keyed by the global tree index
            rollout = oom_retry(lambda: expand_trees(problems[lo:hi], env, backend, feedback, tree, sampling,
                                                     seed=stream_key(t.seed, step, TRAIN_STREAM), tree_offset=lo),
                                getattr(backend, "halve_batch", None),
                                "generation.max_batch_rows" if cfg.backend == "hf" else "vllm.gpu_memory_utilization")
            new_tokens = backend.generated_tokens - tokens_before  # before evaluation adds its own tokens
            assign_advantages(rollout.nodes, t.discount, t.cross_credit, t.baseline, t.advantage_scale, t.group_by,
                              cfg.reward.team_weight)

            u0 = time.perf_counter()
            backend_metrics = backend.metrics()  # this rollout's numbers (e.g. prefix-cache hits), before eval
            backend.sleep()
            agent_stats = []
            for a, up in zip(agents, updaters):
                samples = _samples_of(rollout, a.index, t.mask_truncated)
                # Taken once, outside the retry: a rank that retries after an out-of-memory (in its forward
                # or backward) then meets the others at the gradient all-reduce.
                counts = up.batch_counts(samples, t.kl_coef + t.entropy_coef, world)
                agent_stats.append(oom_retry(
                    lambda: up.step(samples, loss_agg=t.loss_agg, max_new_tokens=g.max_new_tokens,
                                    micro_batch_size=micro[0], ppo_epochs=t.ppo_epochs, clip_eps=t.clip_eps,
                                    kl_coef=t.kl_coef, max_grad_norm=t.max_grad_norm, tis_cap=t.tis_cap,
                                    temperature=g.temperature, clip_eps_high=t.clip_eps_high,
                                    ratio_level=t.ratio_level, entropy_coef=t.entropy_coef,
                                    world=world, counts=counts),
                    lambda: _halve(micro), "trainer.micro_batch_size"))
            backend.sync_weights()  # adapters reach the generator (vllm: new version, checked by the guard)
            update_s = time.perf_counter() - u0
            bad = [a for a, stats in enumerate(agent_stats) if stats["skipped_updates"]]
            bad_in_row = bad_in_row + 1 if bad else 0
            if bad_in_row > t.max_bad_steps:
                raise TrainingError(f"{bad_in_row} steps in a row had a NaN/inf loss or gradient (agents {bad}; last at "
                                    f"step {step}); stopping (trainer.max_bad_steps={t.max_bad_steps}). Lower trainer.lr "
                                    f"or check the rewards; the last checkpoint is intact")
            step_s = time.perf_counter() - start

            # Rank 0 sees the whole batch: every rank's trees (slimmed for sending) and numbers.
            parts = world.gather({"rollout": portable(rollout, lo) if world.size > 1 else rollout, "tokens": new_tokens,
                                  "mem": peak_memory_gb(backend_device(agents))})
            own = own_metrics(env.metrics(), backend_metrics)
            evaluating = (cfg.eval.every and step % cfg.eval.every == 0) or (cfg.eval.at_end and step == t.steps)
            eval_metrics = run_eval(step) if evaluating else {}
            own.update(own_metrics(feedback.metrics()))  # after evaluation: its expert calls count too
            every = cfg.logging.samples_every
            sample_trees = every and (step % every == 0 or step == t.steps)
            if world.is_main:
                whole, metrics = _whole_batch_metrics(parts, agent_stats, t.num_turns)
                env_step += int(metrics["tree/joint_actions"])
                metrics.update({**own, **eval_metrics, "env_step": env_step, "perf/update_s": update_s,
                                "perf/step_s": step_s})
                writer.log_metrics(step, metrics)
                if cfg.logging.rollouts or sample_trees:
                    records = tree_records(step, whole.problems, whole.nodes)
                    if cfg.logging.rollouts:
                        writer.log_trees(records)
                    if sample_trees:
                        writer.log_samples(step, records)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['train/reward_mean']:.3f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}")
                if cfg.logging.every and step % cfg.logging.every == 0:
                    bar.write(summary_line(step, t.steps, metrics, env.num_agents, t.num_turns), file=sys.stderr)
            stopping = world.any(stop.signal is not None)  # a signal that reached any rank stops them all here
            every = cfg.checkpoint.every
            if (every and step % every == 0) or step == t.steps or stopping:
                save_checkpoint(step)
            if stopping:
                if world.is_main:
                    name = stop.signal.name if stop.signal else "a signal to another process"
                    print(f"\nmagrpo: stopped by {name} after step {step}; checkpoint written, continue "
                          f"with resume=auto logging.run_dir={run_dir}", file=sys.stderr)
                return run_dir
        if world.is_main:
            _save(agents, run_dir / "adapters")
            writer.log_adapters(run_dir / "adapters")
    except Exception as e:
        log = log_traceback(run_dir, e) if world.is_main else None  # the console gets one line (cli.py)
        if log is not None:
            e.add_note(f"traceback in {log}")
        raise
    finally:
        stop.restore()
        bar.close()
        writer.close()
        backend.close()
    if world.is_main:
        print(f"magrpo: done; adapters in {run_dir / 'adapters'}", file=sys.stderr)
    return run_dir


def _samples_of(rollout: Rollout, agent: int, mask_truncated: bool = False) -> list[TrainSample]:
    completions = [(node, k, c) for node in rollout.nodes for k, c in enumerate(node.completions[agent])]
    return [
        TrainSample(c.prompt_ids, c.token_ids, float(node.advantages[agent, k]), c.logprobs)
        for node, k, c in (completions[i] for i in kept_completions([c.finished for _, _, c in completions], mask_truncated))
    ]


def _whole_batch_metrics(parts: list[dict], agent_stats: list[dict], num_turns: int) -> tuple[Rollout, dict[str, float]]:
    """Rank 0: every rank's trees merged as one process would have built them, and the step's tree,
    reward, agent and speed metrics over the whole batch."""
    whole = merge_rollouts([part["rollout"] for part in parts])  # nodes keep the advantages their rank gave them
    metrics = _metrics(whole, agent_stats, num_turns)
    metrics["train/reward_errors"] = whole.reward_errors
    metrics["train/resampled_nodes"] = whole.resampled_nodes
    metrics.update({
        "perf/tokens_per_s": sum(part["tokens"] for part in parts) / max(whole.timings["gen_s"], 1e-9),
        **{f"perf/{k}": v for k, v in whole.timings.items()},
        "perf/peak_mem_gb": max(part["mem"] for part in parts),  # the fullest process
    })
    return whole, metrics


def _metrics(rollout: Rollout, agent_stats: list[dict], num_turns: int) -> dict[str, float]:
    nodes = rollout.nodes
    zero_std = np.array([n.zero_std for n in nodes])  # (nodes, N)
    out: dict[str, float] = {
        "train/reward_mean": float(np.mean([n.rewards.mean() for n in nodes if n.turn == 0])),
        "tree/nodes": len(nodes),
        "tree/leaves": count_leaves(nodes),
        "tree/joint_actions": sum(len(n.joint) for n in nodes),
    }
    for turn in range(num_turns):
        at = [n for n in nodes if n.turn == turn]
        if not at:
            continue
        rewards = np.concatenate([n.rewards for n in at])
        out[f"train/turn_{turn}/reward_mean"] = float(rewards.mean())
        out[f"train/turn_{turn}/reward_max"] = float(rewards.max())
        out[f"train/turn_{turn}/return_mean"] = float(np.concatenate([n.returns for n in at]).mean())
        if turn < len(rollout.terminated_per_turn):
            out[f"train/turn_{turn}/terminated"] = rollout.terminated_per_turn[turn]
        # neither stopped nor expanded: left out by trainer.expand (the last turn expands nothing)
        out[f"train/turn_{turn}/unexpanded"] = 0 if turn == num_turns - 1 else sum(
            c is None and not stopped for n in at for c, stopped in zip(n.children, n.terminated))
    for a, stats in enumerate(agent_stats):
        for key, value in stats.items():
            out[f"train/agent_{a}/{key}"] = value
        out[f"train/agent_{a}/adv_abs_mean"] = float(np.mean([np.abs(n.advantages[a]).mean() for n in nodes]))
        out[f"train/agent_{a}/frac_zero_std"] = float(zero_std[:, a].mean())
        out[f"train/agent_{a}/truncated_frac"] = float(np.mean([not c.finished for n in nodes for c in n.completions[a]]))
        own = [n.agent_rewards[:, a] for n in nodes if n.agent_rewards is not None]
        if own:  # the env gives per-agent rewards: agent a's own, before mixing with the team's
            out[f"train/agent_{a}/reward_mean"] = float(np.concatenate(own).mean())
    return out


def _save(agents, folder: Path) -> None:
    for agent in agents:
        agent.save(folder)


def _halve(cell: list[int]) -> int:
    cell[0] = max(1, cell[0] // 2)
    return cell[0]


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def oom_retry(run, shrink, setting: str):
    """run(); on out-of-memory, shrink() (halves `setting`, returns the new size) and run once more.
    A second out-of-memory (or a first one with nothing to shrink) stops training with a line naming
    the setting; the last checkpoint stays."""
    try:
        return run()
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        if shrink is None:
            raise TrainingError(f"out of memory; lower {setting}; the last checkpoint is intact") from None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    size = shrink()
    from tqdm import tqdm  # a warning even in quiet mode; tqdm.write keeps a progress bar intact

    tqdm.write(f"magrpo: out of memory; retrying with {setting}={size} (kept for the rest of the run)", file=sys.stderr)
    try:
        return run()
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        raise TrainingError(f"out of memory again with {setting}={size}; lower {setting} (or the batch size, "
                            f"K, max_new_tokens); the last checkpoint is intact") from None


def backend_device(agents) -> torch.device:
    return next(agents[0].model.parameters()).device


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory on a GPU, else the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def summary_line(step: int, steps: int, m: dict[str, float], num_agents: int, num_turns: int) -> str:
    """The compact console line: rewards per turn, loss per agent, speed, eval when it ran."""
    turns = " ".join(f"t{t} {m[f'train/turn_{t}/reward_mean']:.3f}" for t in range(num_turns)
                     if f"train/turn_{t}/reward_mean" in m)
    losses = " ".join(f"a{a} {m[f'train/agent_{a}/loss']:+.3g}" for a in range(num_agents))
    line = (f"step {step}/{steps} | reward {m['train/reward_mean']:.3f} ({turns}) | loss {losses} | "
            f"{m['perf/tokens_per_s']:.0f} tok/s | {m['perf/step_s']:.1f} s/step")
    last = f"eval/turn_{num_turns - 1}/pass@1_greedy"
    return line + (f" | eval pass@1 {m[last]:.3f}" if last in m else "")


class _NoBar:
    def write(self, s, file=None): ...
    def update(self, n): ...
    def set_postfix(self, **kw): ...
    def close(self): ...


def _progress(total: int, enabled: bool, initial: int = 0):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="magrpo", unit="step", dynamic_ncols=True)


class _StopSignals:
    """SIGTERM/SIGINT end the run after the current step, with a checkpoint (a second one stops now)."""

    def __init__(self):
        self.signal: signal.Signals | None = None
        self.since = 0.0
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    REPEAT_S = 2.0  # Ctrl-C under torchrun arrives twice at once: from the terminal and forwarded by torchrun

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            if time.monotonic() - self.since < self.REPEAT_S:
                return
            raise KeyboardInterrupt
        self.signal, self.since = signal.Signals(signum), time.monotonic()
        print(f"\nmagrpo: {self.signal.name}: finishing this step, then writing a checkpoint", file=sys.stderr)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
