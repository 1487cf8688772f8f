"""The MAGRPO-MT loop, top to bottom: expand trees -> feedback -> advantages -> per-agent update -> log."""
from __future__ import annotations

import random
import shutil
import signal
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np
import torch

from . import checkpoint, run_lock
from .advantage import AdvantageSettings, assign_advantages
from .backends import make_backend
from .config import LimitsConfig, TrainConfig, agent_entry, check_finite
from .console import Interrupted, StopSignals, phase_lines, progress_bar, startup_line, summary_line
from .distributed import World, world_from_env
from .env import Environment, call_env, check_problem_prompts, check_prompt_sizes, make_env
from .errors import BEFORE_RUN, ConfigError, Stopped, TrainingError, log_traceback
from .evaluation import evaluate, path_options
from .feedback import Feedback, FeedbackTarget, mode_for
from .generation import SamplingParams
from .guards import BadSteps, Halvable, oom_retry
from .loss import kept_completions
from .metrics import Counter, Maximum, reduce_over_ranks
from .rollout import Rollout, TreeSettings, expand_trees, merge_rollouts, portable
from .run_io import LOGS, RESUME_HINT, NullWriter, RunWriter, make_run_dir, put_back, top_level, tree_records, writing
from .sampling import stream_key
from .toolbox import Toolbox
from .tree import count_leaves
from .update import AgentUpdater, TrainSample, UpdateSettings
from .validation import check_problem_sizes, check_tree_size, step_size, validate


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


def prepare(
    cfg: TrainConfig, env: Environment | None = None, feedback: FeedbackTarget | None = None
) -> tuple[Environment, Feedback]:
    """Everything that can fail on bad input, before any model loads and before the run dir exists
    (the data, an expert endpoint and its key included). `env`: an env built already (the Python
    API's env instance) instead of one made from cfg.env; `feedback`: a function or FeedbackMode
    class instead of cfg.external.mode."""
    validate(cfg)
    env = env if env is not None else make_env(cfg.env, cfg.limits.user_code_timeout_s)
    check_finite(env.cfg, "env")
    # Every key the env runs with, its Config's defaults included: config.json, --cfg and resume see them all.
    cfg.env = {"name": cfg.env["name"], **asdict(env.cfg)}
    if len(cfg.agents) > env.num_agents:
        raise ConfigError(
            "agents", f"{len(cfg.agents)} entries for {env.num_agents} agent(s); give at most one per agent"
        )
    _check_split(env, "train", cfg.limits)
    if evaluates(cfg):
        _check_split(env, "eval", cfg.limits)
    check_tree_size(cfg, env.num_agents)
    cfg.external.mode = mode_for(cfg.external.mode, env)  # config.json records the mode that ran, not `auto`
    checked = Feedback(cfg.external, env, feedback, max_prompt_chars=cfg.limits.max_prompt_chars,
                       timeout_s=cfg.limits.user_code_timeout_s)
    checked.check()
    from .models import check_chat_templates

    check_chat_templates(cfg, env.num_agents)  # read from the tokenizers' files: no model loads for it
    return env, checked


def evaluates(cfg: TrainConfig) -> bool:
    return bool(cfg.eval.at_end or cfg.eval.every or cfg.eval.at_start)


def _check_split(env: Environment, split: str, limits: LimitsConfig) -> None:
    """Load a split now (the env caches it): bad data is a start-up error, and an empty split would
    leave nothing to sample, a huge record or turn-0 prompt take the machine's memory once encoded."""
    problems = call_env(env, "problems", split, where=f"loading the {split} split",
                        timeout_s=limits.user_code_timeout_s, tail=BEFORE_RUN)
    check_problem_sizes(problems, split, limits.max_problem_chars)
    check_problem_prompts(env, problems, split)
    check_prompt_sizes(env, problems, split, limits.max_prompt_chars, limits.user_code_timeout_s)
    if not problems:
        key = env.split_keys.get(split, "env")
        value = getattr(env.cfg, key.partition(".")[2], None)
        hint = (
            ""
            if split == "train"
            else "; or turn evaluation off: eval.at_end=false (and eval.every=0, eval.at_start=false)"
        )
        what = f"{value!r} selects no {split} problems" if value is not None else f"the {split} split has no problems"
        raise ConfigError(key, f"{what}; give a split with at least one{hint}")


SLOW_WRITE_S = 5.0  # a checkpoint write that has taken this long says how far it got
# Domains of the sampling streams: training rollouts and evaluation paths never share a stream.
TRAIN_STREAM, EVAL_STREAM = 0, 1


def train(cfg: TrainConfig, env: Environment | None = None, feedback: FeedbackTarget | None = None) -> Path:
    """Check cfg (prepare) and train; returns the run dir. From Python, use `magrpo.train`: it also
    composes and type-checks the config the way the command line does."""
    with StopSignals() as stop:  # from the first line: a signal while models load stops at once, cleanly
        env, feedback = prepare(cfg, env, feedback)
        # The tools, MCP servers started, once every cheaper check has passed (still before any model
        # loads); the box closes however the run ends.
        with Toolbox.open(cfg.tools) as toolbox:
            world = world_from_env(cfg.model.device, cfg.trainer.dist_timeout_min)
            try:
                with owned_run_dir(cfg, world) as run_dir:
                    return _train(cfg, env, feedback, world, run_dir, stop, toolbox)
            finally:
                world.close()


@contextmanager
def owned_run_dir(cfg: TrainConfig, world: World):
    """The run dir (made when new), locked by rank 0 for the whole run: a second writer stops here, before
    any model loads, with one line naming the holder. Every rank gets its path. A dir made here and
    still empty at the end (the run stopped before writing anything) is removed, and so is one that a
    signal during start-up stopped (it holds only the config and empty logs of a run that never began);
    one it did not make, and that holds no checkpoint, is put back as it was (run_io.put_back)."""
    held: list[run_lock.RunLock] = []
    made: list[Path] = []
    found: dict[str, int] = {}  # rank 0: the top of a run dir that was there, as it was once locked

    def take() -> str:
        path, new = make_run_dir(cfg.logging.run_dir, cfg.env["name"])
        made.extend([path] if new else [])
        held.append(run_lock.acquire(path))
        found.update({} if new else top_level(path))
        return str(path)

    path = None
    try:
        path = Path(checkpoint.on_main(world, take))
        yield path
    except Interrupted as e:
        if made and not checkpoint.holds_checkpoints(made[0]):
            shutil.rmtree(made[0], ignore_errors=True)
            made.clear()
            raise Interrupted(e.signum, f"{e}: nothing trained, the run dir it made is removed") from None
        if found and not checkpoint.holds_checkpoints(path):
            put_back(path, found)
            raise Interrupted(e.signum, f"{e}: nothing trained, what it wrote in the run dir is removed") from None
        where = f"; resume=auto logging.run_dir={path} continues from its last checkpoint, if any" if path else ""
        raise Interrupted(e.signum, f"{e}{where}") from None
    finally:
        for lock in held:
            lock.release()
        for made_path in made:
            with suppress(OSError):  # not empty: the run wrote something
                made_path.rmdir()


def _train(cfg: TrainConfig, env: Environment, feedback: Feedback, world: World, run_dir: Path,
           stop: StopSignals, toolbox: Toolbox) -> Path:
    """The loop of the README: collect -> advantages -> update -> log -> eval / checkpoint."""
    run = Run(cfg, env, feedback, world, run_dir, stop, toolbox)
    trainer = cfg.trainer
    with run:
        if cfg.eval.at_start and run.first_step == 1:
            run.log(0, run.evaluate(0))
        for step in range(run.first_step, trainer.steps + 1):
            rollout, collected = run.collect(step)                      # expand this rank's trees
            assign_advantages(rollout.nodes, run.advantage_settings)
            agent_stats, update_s = run.update(rollout)                 # each agent's LoRA on its own tokens
            run.bad_steps.check(step, agent_stats)
            metrics, whole = run.step_metrics(step, rollout, agent_stats, collected, update_s)
            run.log(step, metrics, whole)
            stopping = run.world.any(run.stop.signal is not None)     # a signal on any rank stops them all
            if run.checkpoint_due(step) or stopping:
                run.save_checkpoint(step)
            if stopping:
                raise run.stopped(step)
        run.save_adapters()
    if world.is_main:
        print(f"magrpo: done; adapters in {run.dir / 'adapters'}", file=sys.stderr)
    return run.dir


class Run:
    """One training run's state and phases: models, backend, optimizers, run dir, logging. Built
    after the resume decision; a context manager that closes what it opened (and keeps the
    traceback of an error in the run dir)."""

    def __init__(self, cfg: TrainConfig, env: Environment, feedback: Feedback, world: World, run_dir: Path,
                 stop: StopSignals, toolbox: Toolbox):
        # Before any model loads: a resume that does not match its run stops here (rank 0 decides).
        chosen = checkpoint.on_main(world, lambda: checkpoint.choose(cfg.resume, str(run_dir), asdict(cfg)))
        seed_everything(cfg.trainer.seed)  # the same on every rank: identical initial adapters
        from .conversation import conversation_of
        from .models import load_agents, model_dtype

        trainer, generation = cfg.trainer, cfg.generation
        self.cfg, self.env, self.feedback, self.world = cfg, env, feedback, world
        self.agents = load_agents(cfg, env.num_agents, toolbox.schemas)
        self.conversation = conversation_of(cfg.external, self.agents)  # a template it cannot grow stops here
        self.backend = make_backend(cfg, self.agents, toolbox)
        self.has_tools = bool(toolbox)
        self.updaters = [AgentUpdater(a, agent_entry(cfg, a.index).lr or trainer.lr, trainer.weight_decay,
                                      trainer.warmup_steps) for a in self.agents]
        self.dir = run_dir
        # The same problem order on every rank; each takes its shard of every batch.
        self.timeout_s = cfg.limits.user_code_timeout_s  # every call of user code (the env's methods here)
        self.sampler = ProblemSampler(self.call_env("problems", "train", where="at start-up"), trainer.seed)
        state = checkpoint.resume(chosen, world, self.agents, self.updaters, self.sampler,
                                  partial(self.call_env, "load_state", where="resuming"))
        if state:  # the engine (vllm) still serves the adapters it started with, not the checkpoint's
            self.backend.sync_weights()
        self.first_step, self.env_step = (state["step"] + 1, state["env_step"]) if state else (1, 0)
        self.step = self.first_step  # the step being trained (progress lines)
        if world.is_main:  # only now, with a matching checkpoint loaded (or none to match), is the run dir touched
            checkpoint.claim_run_dir(self.dir, state["step"] if state else None,
                                     LOGS if cfg.logging.rollouts else LOGS[:1])
            if state and state["step"] >= trainer.steps:
                print(f"magrpo: the checkpoint is at step {state['step']}, trainer.steps={trainer.steps}: no step "
                      f"left to train; raise trainer.steps to go on", file=sys.stderr)
        warnings = (*env.warnings, *toolbox.warnings)
        recorded = {**asdict(cfg), **({"warnings": list(warnings)} if warnings else {})}
        if world.is_main:  # said once every check has passed (bad input stays one line), kept in config.json
            for line in warnings:
                print(f"WARNING: {line}", file=sys.stderr)
        self.writer = RunWriter(self.dir, recorded, cfg.logging.wandb) if world.is_main else NullWriter()
        self.eval_problems = (self.call_env("problems", "eval", where="at start-up")[: cfg.eval.max_problems or None]
                              if evaluates(cfg) else [])
        self.tree = TreeSettings.of(cfg)
        self.advantage_settings = AdvantageSettings.of(cfg)
        # per agent: its log-probs are scored under its own sampling temperature
        self.update_settings = [UpdateSettings.of(cfg, a.sampling.get("temperature")) for a in self.agents]
        self.micro_batch = Halvable("trainer.micro_batch_size", trainer.micro_batch_size)
        self.bad_steps = BadSteps(trainer.max_bad_steps)
        # Sampling log-probs feed the train/inference mismatch metrics and truncated importance sampling.
        self.sampling = SamplingParams(generation.max_new_tokens, generation.temperature, generation.top_p,
                                       generation.top_k, logprobs=True)
        if world.is_main:
            print(
                startup_line(cfg, env.num_agents, world.size, step_size(cfg, env.num_agents), self.dir,
                             model_dtype(cfg.model)), file=sys.stderr
            )
        self.bar = progress_bar(trainer.steps, cfg.logging.progress and world.is_main, initial=self.first_step - 1)
        self.stop = stop
        stop.ready()  # start-up is over: a signal now finishes the step and writes a checkpoint

    def call_env(self, method: str, *args, where: str):
        """An env method during the run: one line when it raises or runs past limits.user_code_timeout_s."""
        return call_env(self.env, method, *args, where=where, timeout_s=self.timeout_s)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, kind, error, tb) -> None:
        try:
            # the console gets one line (cli.py), the run dir the traceback; a stop by signal is no error to trace
            if isinstance(error, Exception) and not isinstance(error, Stopped):
                log = log_traceback(self.dir, error) if self.world.is_main else None
                if log is not None:
                    error.add_note(f"traceback in {log}")
        finally:
            self.bar.close()
            self.writer.close()
            self.backend.close()

    # ---------------------------------------------------------------- the phases of a step

    def collect(self, step: int) -> tuple[Rollout, dict]:
        """This rank's trees of the step (sampling keyed by the global tree index, so any number of
        processes samples the same trees), and what the step's metrics need from before the update."""
        trainer, world = self.cfg.trainer, self.world
        self.step = step
        start, tokens_before = time.perf_counter(), self.backend.generated_tokens
        problems = self.sampler.next(trainer.batch_size)
        lo, hi = world.shard(len(problems))
        rollout = oom_retry(lambda: expand_trees(problems[lo:hi], self.env, self.backend, self.feedback, self.tree,
                                                 self.sampling, seed=stream_key(trainer.seed, step, TRAIN_STREAM),
                                                 tree_offset=lo, conversation=self.conversation,
                                                 on_turn=self.turn_done),
                            self.backend.halve_batch, self.backend.batch_setting)
        return rollout, {"start": start, "tokens": self.backend.generated_tokens - tokens_before, "offset": lo,
                         "backend_metrics": self.backend.metrics()}  # this rollout's numbers, before eval adds its own

    def turn_done(self, turn: int) -> None:
        self.stopping(f"turn {turn + 1}/{self.cfg.trainer.num_turns} done; then the update and a checkpoint")

    def stopping(self, done: str) -> None:
        """After a stop signal, what the step it waits for has done (a step can take minutes)."""
        if self.stop.signal is not None and self.world.is_main:
            self.bar.write(f"magrpo: {self.stop.signal.name}: step {self.step}: {done}", file=sys.stderr)

    def update(self, rollout: Rollout) -> tuple[list[dict[str, float]], float]:
        """One optimizer step per agent on its own completions; the adapters then reach the generator."""
        start = time.perf_counter()
        self.backend.sleep()
        agent_stats = []
        trainer = self.cfg.trainer
        # update_every=turn: one step per turn, the first first; every rank walks every turn (the collectives)
        turns = [None] if trainer.update_every == "batch" else list(range(trainer.num_turns))
        for agent, updater in zip(self.agents, self.updaters):
            steps = []
            for turn in turns:
                samples = _samples_of(rollout, agent.index, trainer.mask_truncated, turn)
                # Taken once, outside the retry: a rank that retries after an out-of-memory (in its forward
                # or backward) then meets the others at the gradient all-reduce.
                counts = updater.batch_counts(samples, self.update_settings[agent.index].per_token_coef, self.world)
                if turn is not None and not counts[0]:  # no rank has a node at this turn (all stopped early)
                    continue
                step = partial(self._agent_step, updater, samples, counts)
                steps.append(oom_retry(step, self.micro_batch.halve, self.micro_batch.setting))
            agent_stats.append(steps[0] if len(steps) == 1 else mean_of_steps(steps))
        self.backend.sync_weights()  # adapters reach the generator (vllm: new version, checked by the guard)
        self.stopping("update done; writing a checkpoint")
        return agent_stats, time.perf_counter() - start

    def _agent_step(self, updater: AgentUpdater, samples: list[TrainSample], counts: tuple) -> dict[str, float]:
        # The micro-batch size is read at each try: a retry after an out-of-memory gets the halved one.
        return updater.step(samples, self.update_settings[updater.agent.index], self.micro_batch.value, self.world,
                            counts)

    def step_metrics(self, step: int, rollout: Rollout, agent_stats: list[dict], collected: dict,
                     update_s: float) -> tuple[dict[str, float], Rollout | None]:
        """The step's numbers and trees over the whole batch (rank 0; nothing elsewhere), evaluation
        included when due."""
        step_s = time.perf_counter() - collected["start"]
        world = self.world
        # Rank 0 sees the whole batch: every rank's trees (slimmed for sending) and numbers.
        parts = world.gather({"rollout": portable(rollout, collected["offset"]) if world.size > 1 else rollout,
                              "tokens": Counter(collected["tokens"]),
                              "mem": Maximum(peak_memory_gb(backend_device(self.agents)))})
        # The rollout's own numbers, read before evaluation: what evaluation counts goes in its eval/* keys
        own = self.own_metrics(self.call_env("metrics", where=f"after step {step}"), collected["backend_metrics"],
                               self.feedback.metrics())
        e = self.cfg.eval
        evaluating = (e.every and step % e.every == 0) or (e.at_end and step == self.cfg.trainer.steps)
        eval_metrics = self.evaluate(step) if evaluating else {}
        if not world.is_main:
            return {}, None
        whole, metrics = _whole_batch_metrics(parts, agent_stats, self.cfg.trainer.num_turns, self.has_tools)
        self.env_step += int(metrics["tree/joint_actions"])
        metrics.update({**own, **eval_metrics, "env_step": self.env_step, "perf/update_s": update_s,
                        "perf/step_s": step_s})
        return metrics, whole

    def evaluate(self, step: int) -> dict[str, float]:
        trainer, bar = self.cfg.trainer, self.bar
        bar.write(f"magrpo: evaluating {len(self.eval_problems)} problem(s), greedy + {self.cfg.eval.num_samples} "
                  f"sample(s), {trainer.num_turns} turn(s)", file=sys.stderr)
        out = evaluate(self.env, self.backend, self.feedback, self.eval_problems, trainer.num_turns, self.sampling,
                       self.cfg.eval.num_samples, seed=stream_key(trainer.seed, step, EVAL_STREAM), world=self.world,
                       progress=self.eval_progress(step), **path_options(self.tree, self.conversation))
        # What evaluation counted (the backend's tool calls, the feedback's expert requests: numbers reset on
        # read) is evaluation's own record, never carried into the next step's, which a resume would not repeat.
        counted = self.own_metrics(self.backend.metrics(), self.feedback.metrics())
        out.update({f"eval/{key}": value for key, value in counted.items()})
        if self.world.is_main:
            last = trainer.num_turns - 1
            summary = ", ".join(
                f"{key.split('/', 2)[2]} {out[key]:.3f}"
                for key in (f"eval/turn_{last}/greedy_reward_mean", f"eval/turn_{last}/pass@1_greedy")
                if key in out
            )
            # turn_{last}, as in the metric keys (and t0, t1 in the step line): turns count from 0 everywhere
            bar.write(f"magrpo: eval turn_{last} (last turn): {summary} ({out['perf/eval_s']:.0f} s)",
                      file=sys.stderr)
        return out

    def eval_progress(self, step: int):
        """A line per turn of the greedy and the sampled paths (rank 0's share): an evaluation can take minutes."""
        say, turns = phase_lines(self.bar, self.world.is_main, f"eval (step {step})"), self.cfg.trainer.num_turns
        return lambda paths, turn: say(f"{paths} paths, turn {turn + 1}/{turns} done")

    def own_metrics(self, *parts: dict[str, float]) -> dict[str, float]:
        """The env's, feedback's and backend's own numbers, merged over ranks by kind (rank 0)."""
        merged: dict[str, float] = {}
        for part in parts:
            merged.update(part)
        return reduce_over_ranks(self.world.gather(merged) or [{}])

    def log(self, step: int, metrics: dict[str, float], whole: Rollout | None = None) -> None:
        """Rank 0: the metrics line, the whole batch's trees (rollouts.jsonl, sample pages), the console."""
        if not self.world.is_main:
            return
        self.writer.log_metrics(step, metrics)
        if whole is None:  # the evaluation before the first step
            return
        cfg, every = self.cfg, self.cfg.logging.samples_every
        sample_trees = every and (step % every == 0 or step == cfg.trainer.steps)
        if cfg.logging.rollouts or sample_trees:
            records = tree_records(step, whole.problems, whole.nodes)
            if cfg.logging.rollouts:
                self.writer.log_trees(records)
            if sample_trees:
                self.writer.log_samples(step, records)
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics['train/reward_mean']:.3f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}")
        if cfg.logging.every and step % cfg.logging.every == 0:
            self.bar.write(summary_line(step, cfg.trainer.steps, metrics, self.env.num_agents, cfg.trainer.num_turns),
                           file=sys.stderr)

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every and step % every == 0) or step == self.cfg.trainer.steps

    def save_checkpoint(self, step: int) -> None:
        env_state = self.call_env("state", where=f"writing checkpoint {step}")
        ranks = self.world.gather({"rng": checkpoint.rng_state(), "env": env_state})
        state = {"step": step, "env_step": self.env_step, "sampler": self.sampler.state(), "ranks": ranks}
        # Rank 0 writes; its failure (a full disk) stops every rank rather than leaving them waiting for it.
        # A write that takes long (big adapters, a slow disk) says each part written once it passed SLOW_WRITE_S.
        say = phase_lines(self.bar, self.world.is_main, f"writing checkpoint step {step}", SLOW_WRITE_S)
        checkpoint.on_main(self.world, lambda: str(checkpoint.save(
            self.dir, step, self.agents, self.updaters, state, asdict(self.cfg), self.cfg.checkpoint.keep, say)))

    def stopped(self, step: int) -> Stopped:
        """The error that ends a stopped run, on every rank with the same signal (the one any rank got)."""
        got = self.world.gather(int(self.stop.signal or 0))
        sig = signal.Signals(self.world.broadcast(max(got) if got else None))
        return Stopped(sig, f"{sig.name} after step {step}; checkpoint written, continue with resume=auto "
                            f"logging.run_dir={self.dir}")

    def save_adapters(self) -> None:
        if self.world.is_main:
            with writing(self.dir / "adapters", RESUME_HINT):
                for agent in self.agents:
                    agent.save(self.dir / "adapters")
            self.writer.log_adapters(self.dir / "adapters")


def _samples_of(rollout: Rollout, agent: int, mask_truncated: bool = False, turn: int | None = None
                ) -> list[TrainSample]:
    """The agent's trained completions (of one turn's nodes, or of all)."""
    completions = [(node, k, c) for node in rollout.nodes if turn is None or node.turn == turn
                   for k, c in enumerate(node.completions[agent])]
    kept = kept_completions([c.finished for _, _, c in completions], mask_truncated)
    return [TrainSample(c.prompt_ids, c.token_ids, float(node.advantages[agent, k]), c.logprobs, c.model_mask)
            for node, k, c in (completions[i] for i in kept)]


SUMMED_STEP_KEYS = ("trained_seqs", "skipped_updates")  # counts: the turn steps' total


def mean_of_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """An agent's numbers over its optimizer steps of one batch (trainer.update_every=turn): counts summed,
    grad_norm the largest, lr the first step's, the rest their mean over the steps that have them."""
    out = {}
    for key in dict.fromkeys(k for s in steps for k in s):
        values = [s[key] for s in steps if key in s]
        out[key] = (sum(values) if key in SUMMED_STEP_KEYS else max(values) if key == "grad_norm"
                    else values[0] if key == "lr" else sum(values) / len(values))
    return out


def _whole_batch_metrics(
    parts: list[dict], agent_stats: list[dict], num_turns: int, tools: bool = False
) -> tuple[Rollout, dict[str, float]]:
    """Rank 0: every rank's trees merged as one process would have built them, and the step's tree,
    reward, agent and speed metrics over the whole batch."""
    whole = merge_rollouts([part["rollout"] for part in parts])  # nodes keep the advantages their rank gave them
    metrics = _metrics(whole, agent_stats, num_turns, tools)
    metrics["train/reward_errors"] = whole.reward_errors
    metrics["train/resampled_nodes"] = whole.resampled_nodes
    totals = reduce_over_ranks([{"tokens": part["tokens"], "mem": part["mem"]} for part in parts])
    metrics.update({
        "perf/tokens_per_s": totals["tokens"] / max(whole.timings["gen_s"], 1e-9),
        **{f"perf/{k}": v for k, v in whole.timings.items()},
        "perf/peak_mem_gb": totals["mem"],  # the fullest process
    })
    return whole, metrics


def _metrics(rollout: Rollout, agent_stats: list[dict], num_turns: int, tools: bool = False) -> dict[str, float]:
    nodes = rollout.nodes
    zero_std = np.array([n.zero_std for n in nodes])  # (nodes, N)
    out: dict[str, float] = {
        "train/reward_mean": float(np.mean([n.rewards.mean() for n in nodes if n.turn == 0])),
        "tree/nodes": len(nodes),
        "tree/leaves": count_leaves(nodes),
        "tree/joint_actions": sum(len(n.joint) for n in nodes),
        "tree/done_leaves": int(sum(n.done.sum() for n in nodes)),  # ended by the env (Scored.done)
        "tree/truncated_leaves": int(sum(n.truncated.sum() for n in nodes)),  # by trainer.stop_on_truncation
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
        out.update(turn_tool_metrics(turn, [c for n in at for agent in n.completions for c in agent], tools))
    for a, stats in enumerate(agent_stats):
        for key, value in stats.items():
            out[f"train/agent_{a}/{key}"] = value
        out[f"train/agent_{a}/adv_abs_mean"] = float(np.mean([np.abs(n.advantages[a]).mean() for n in nodes]))
        out[f"train/agent_{a}/frac_zero_std"] = float(zero_std[:, a].mean())
        out[f"train/agent_{a}/truncated_frac"] = float(
            np.mean([not c.finished for n in nodes for c in n.completions[a]])
        )
        own = [n.agent_rewards[:, a] for n in nodes if n.agent_rewards is not None]
        if own:  # the env gives per-agent rewards: agent a's own, before mixing with the team's
            out[f"train/agent_{a}/reward_mean"] = float(np.concatenate(own).mean())
    return out


def turn_tool_metrics(turn: int, completions: list, tools: bool = False) -> dict[str, float]:
    """One turn's tool numbers over its completions (all samples): in a run with tools, for every turn
    (0 where nothing was called: a dashboard's curve must not skip the steps without a call); without
    tools, only where a turn inserted tokens, so such runs log nothing new."""
    calls = [call for c in completions for call in c.tool_calls]
    inserted = sum(len(c.model_mask) - sum(c.model_mask) for c in completions if c.model_mask is not None)
    if not tools and not calls and not inserted:
        return {}
    return {f"tools/turn_{turn}/calls": len(calls),
            f"tools/turn_{turn}/errors": sum(call["error"] is not None for call in calls),
            f"tools/turn_{turn}/seconds": float(sum(call["seconds"] for call in calls)),
            f"tools/turn_{turn}/call_rate": float(np.mean([bool(c.tool_calls) for c in completions])),
            f"train/turn_{turn}/masked_token_share": inserted / max(1, sum(len(c.token_ids) for c in completions))}


def backend_device(agents) -> torch.device:
    return next(agents[0].model.parameters()).device


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory on a GPU, else the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
