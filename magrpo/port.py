"""Port a CoMLRL / LLM_Collab MAGRPO config to magrpo overrides.

    python -m magrpo.port CONFIG.yaml     # prints `python train.py ...`, then what differs and what is not mapped

Both LLM_Collab layouts are read: the current one (`agent_model:`, `magrpo.agent_learning_rate`,
`reward_processor:`) and the older one (`model:`, `magrpo.learning_rate`, `magrpo.reward_shift`).
Every key of the file ends up in exactly one of three lists: mapped, mapped with a behavioural
difference (said why), or not mapped (said why). The differences are explained in docs/porting.md.
"""
from __future__ import annotations

import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .config import TrainerConfig, flatten
from .errors import ConfigError

# Keys that mean the same thing in both layouts, under one name.
ALIASES = {
    "agent_model.": "model.", "model.model_kwargs.torch_dtype": "model.torch_dtype",
    "model.tokenizer_kwargs.trust_remote_code": "model.trust_remote_code",
    "model.model_kwargs.trust_remote_code": "model.trust_remote_code",
    "magrpo.learning_rate": "magrpo.agent_learning_rate",
    "magrpo.termination_threshold": "magrpo.early_termination_threshold",
}
DATASETS = {"humaneval": "humaneval", "openai/openai_humaneval": "humaneval", "coophumaneval": "coophumaneval",
            "openmlrl/coophumaneval": "coophumaneval", "mbpp": "mbpp", "openmlrl/mbpp": "mbpp"}
FEEDBACK_MODES = ("plain", "level_feedback", "level_passed", "passed", "expert_edits")
BASELINES = {"mean": "mean", "raw": "none", "max": "max", "rloo": "rloo"}  # CoMLRL advantage_mode -> trainer.baseline
# Always true of a port, whatever the file says (docs/porting.md).
ALWAYS = [
    "weights: every agent trains all its weights, as in CoMLRL (agents[i].finetune=full: a float32 copy of its "
    "own, its memory said at start-up); finetune=lora trains an adapter on a shared base instead, which usually "
    "wants a learning rate ~10x higher.",
    "optimizer: CoMLRL's AdamW has torch's defaults (weight decay 0.01) and no gradient clipping; its loss sums "
    "each completion's log-probs (trainer.loss_agg=dr_grpo weighs every token alike too). It takes one step per "
    "drained rollout buffer and turn (3.5 per prompt aligned with its defaults), magrpo one per batch of trees, "
    "or one per turn with trainer.update_every=turn (docs/results/parity.md).",
    "tests: LLM_Collab's reward and feedback see the first `sandbox_slice` asserts; magrpo's code env runs "
    "every test case in its sandbox.",
]
# MAGRPOConfig defaults (CoMLRL 1.4.3) that magrpo does not share: a file that leaves them out relies on them.
COMLRL_DEFAULTS = {
    "magrpo.early_termination_threshold": "CoMLRL 1.4.3's default is -0.2 (unless the training script passes "
        "its own): a node whose mean reward is > -0.2 gets no children, so with non-negative rewards turn 2 never "
        "runs; magrpo's default is null (never stop early)",
    "magrpo.advantage_normalization": "CoMLRL 1.4.3's default is true (divide by the std); magrpo's is "
        "trainer.advantage_scale=none",
}
# Keys magrpo has no counterpart for, with the reason.
UNMAPPED = {
    "model.type": "magrpo reads the architecture from the model itself",
    "model.max_length": "magrpo does not truncate prompts (backend=vllm: vllm.max_model_len)",
    "model.special_tokens": "magrpo adds no tokens to the tokenizer",
    "critic_model": "actor-critic trainers only", "critics": "actor-critic trainers only",
    "output.base_dir": "magrpo writes one folder per run: logging.run_dir (default runs/<env>-<time>)",
    "output.verbose": "magrpo's console output: logging.progress, logging.every",
    "output.save_final_model": "magrpo always saves the adapters (RUN_DIR/adapters) and checkpoints",
    "output.save_path": "magrpo saves into the run dir (RUN_DIR/adapters)",
    "external.sandbox_slice": "magrpo's code env always runs every test case",
    "external.external_prompt_passthrough": "magrpo always builds next-turn prompts from the feedback mode",
    "magrpo.external_prompt_passthrough": "magrpo always builds next-turn prompts from the feedback mode",
    "magrpo.parallel_training": "magrpo keeps all agents in one process; scale out with torchrun (docs/long-runs.md)",
    "magrpo.agent_devices": "magrpo places every agent on model.device; scale out with torchrun",
    "magrpo.reference_devices": "the reference is the base model with the adapter disabled (no second copy)",
    "magrpo.logging_steps": "magrpo logs every step to metrics.jsonl and wandb (console: logging.every)",
    "magrpo.save_steps": "checkpoint.every counts optimizer steps, CoMLRL's save_steps counts its own batches",
    "magrpo.rollout_buffer_size": "magrpo updates once per step on all nodes of trainer.batch_size trees",
    "magrpo.train_batch_size": "magrpo updates once per step on all nodes of trainer.batch_size trees "
                               "(micro-batching for memory: trainer.micro_batch_size)",
    "magrpo.per_device_train_batch_size": "magrpo updates once per step on all nodes of trainer.batch_size trees",
    "magrpo.eval_batch_size": "magrpo evaluates every eval problem in one batched pass per turn",
    "magrpo.turn_gradient_weights": "magrpo weights every turn's tokens equally",
    "magrpo.early_termination_weight": "no counterpart in magrpo's loss",
    "magrpo.handoff": "no counterpart: magrpo expands every joint action (or trainer.expand)",
    "tokenizer.padding_side": "magrpo pads prompts on the left itself",
    "wandb.dir": "magrpo writes the wandb run into the run dir (RUN_DIR/wandb)",
}


@dataclass
class Ported:
    overrides: list[str] = field(default_factory=list)
    differences: list[tuple[str, str]] = field(default_factory=list)  # (CoMLRL key, what behaves differently)
    unmapped: list[tuple[str, str]] = field(default_factory=list)  # (CoMLRL key, why it is not mapped)


def hydra_value(value: Any) -> str:
    """A value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if re.fullmatch(r"[A-Za-z_][\w./-]*", text) and text.lower() not in ("true", "false", "null", "none"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def split_size(split: str) -> int | None:
    """Problems in a split spec with both bounds, e.g. test[33:163] -> 130; None when it cannot tell."""
    m = re.fullmatch(r"\w+\[(\d+):(\d+)\]", split.strip())
    return int(m.group(2)) - int(m.group(1)) if m else None


def normalise(config: dict) -> dict[str, Any]:
    """Dotted keys of the file, with the two layouts' synonyms under one name."""
    out = {}
    for key, value in flatten(config).items():
        for old, new in ALIASES.items():
            if key == old or (old.endswith(".") and key.startswith(old)):
                key = new + key[len(old):]
                break
        out.setdefault(key, value)  # the current layout's key wins when a file has both
    return out


def port(config: dict) -> Ported:
    """The magrpo overrides that reproduce a CoMLRL / LLM_Collab MAGRPO config, with every key accounted for."""
    if not isinstance(config, dict) or not isinstance(config.get("magrpo"), dict):
        raise ConfigError("magrpo", "the file has no `magrpo:` section; expected a CoMLRL / LLM_Collab MAGRPO config")
    keys = normalise(config)
    out = Ported()
    done: set[str] = set()

    def take(key: str) -> Any:
        done.add(key)
        return keys[key]

    def put(override: str, key: str, difference: str = "") -> None:
        out.overrides.append(override)
        if difference:
            out.differences.append((key, difference))

    def skip(key: str, why: str) -> None:
        done.add(key)
        out.unmapped.append((key, why))

    def simple(key: str, target: str, convert: Callable[[Any], Any] = lambda v: v) -> None:
        if key in keys:
            put(f"{target}={hydra_value(convert(take(key)))}", key)

    # Model: a hub id goes through the hf option (its dtype and lr defaults, then the file's).
    if keys.get("model.name"):
        put("model=hf", "model.name")
        put(f"model.name={hydra_value(take('model.name'))}", "model.name")
    simple("model.torch_dtype", "model.dtype")
    simple("model.trust_remote_code", "model.trust_remote_code")
    # Every agent trains its full weights, as CoMLRL's do (each its own copy).
    agents = keys.get("agents")
    if isinstance(agents, list) and agents:
        take("agents")
        put(f"agents={hydra_value([{'model': a, 'finetune': 'full'} for a in agents])}", "agents")
    else:
        if "agents" in keys:
            done.add("agents")  # null: every agent uses model.name, as in magrpo
        count = keys.get("magrpo.num_agents", 2)  # MAGRPOConfig's default
        put(f"agents={hydra_value([{'finetune': 'full'}] * int(count))}", "agents")

    # Data: the code env's named datasets and their splits.
    name = str(keys.get("dataset.type") or keys.get("dataset.name") or "")
    if name:
        dataset = DATASETS.get(name.lower()) or DATASETS.get(str(keys.get("dataset.name", "")).lower())
        for key in ("dataset.type", "dataset.name"):
            if key in keys:
                done.add(key)
        if dataset:
            put("env=code", "dataset.name")
            put(f"env.dataset={dataset}", "dataset.name")
        else:
            out.unmapped.append(
                (
                    "dataset.name",
                    f"{name!r} is not one of the code env's datasets "
                    "(humaneval, coophumaneval, mbpp); export it to a .jsonl for env.dataset",
                )
            )
    simple("dataset.train_split", "env.train_split")
    simple("dataset.eval_split", "env.eval_split")
    simple("seed", "trainer.seed")

    # Sampling: LLM_Collab reads magrpo.* first, then the model section.
    for leaf, target in (
        ("temperature", "generation.temperature"),
        ("top_p", "generation.top_p"),
        ("top_k", "generation.top_k"),
    ):
        chosen = f"magrpo.{leaf}" if f"magrpo.{leaf}" in keys else f"model.{leaf}"
        for key in (f"magrpo.{leaf}", f"model.{leaf}"):
            if key in keys and key != chosen:
                skip(key, f"{chosen} is used instead (LLM_Collab reads magrpo.* first)")
        simple(chosen, target, lambda v: 0 if v is None else v)  # CoMLRL top_k null = off = magrpo's 0
    simple("magrpo.max_new_tokens", "generation.max_new_tokens")

    # The tree.
    simple("magrpo.num_agents", "env.num_agents")
    simple("magrpo.num_turns", "trainer.num_turns")
    simple("magrpo.num_generations", "trainer.num_generations")
    if "magrpo.discount" in keys:  # read into its config, never used in its returns (magrpo.py:1049-1051)
        put("trainer.discount=1.0", "magrpo.discount",
            f"discount: CoMLRL 1.4.3 does not use magrpo.discount ({take('magrpo.discount')} here) in training, "
            "its returns are undiscounted; the port sets trainer.discount=1.0 to train the same")
    if "magrpo.joint_mode" in keys:
        mode = str(take("magrpo.joint_mode")).lower()
        if mode in ("align", "aligned"):
            put("trainer.joint_mode=align", "magrpo.joint_mode")
        elif mode == "cross":
            put("trainer.joint_mode=cross", "magrpo.joint_mode")
            put(
                "trainer.cross_credit=sum",
                "magrpo.joint_mode",
                "cross credit: CoMLRL gives a completion the SUM of the returns of the joint actions containing "
                "it, so set trainer.cross_credit=sum here; magrpo's default (mean) keeps advantages on the reward's "
                "scale",
            )
        else:
            out.unmapped.append(("magrpo.joint_mode", f"{mode!r}: CoMLRL 1.4.3 forms cross joint actions for 'crossed' "
                                 "but assigns credit as in align mode; choose cross or align explicitly"))
    if "magrpo.early_termination_threshold" in keys:
        threshold = take("magrpo.early_termination_threshold")
        put(f"trainer.early_termination_threshold={hydra_value(threshold)}", "magrpo.early_termination_threshold",
            "early termination: CoMLRL stops a whole node when the MEAN reward of its joint actions is > the "
            "threshold; magrpo stops each joint action whose own reward is >= it (null = never)")

    # Optimisation.
    if "magrpo.agent_learning_rate" in keys:
        put(f"trainer.lr={hydra_value(take('magrpo.agent_learning_rate'))}", "magrpo.agent_learning_rate")
    put("trainer.weight_decay=0.01", "optimizer")  # torch's AdamW default, which CoMLRL keeps
    put("trainer.max_grad_norm=0", "optimizer")  # CoMLRL clips no gradient
    put("trainer.loss_agg=dr_grpo", "optimizer")  # CoMLRL: -A x the sum of a completion's log-probs
    if "magrpo.num_train_epochs" in keys:
        epochs = take("magrpo.num_train_epochs")
        size = split_size(str(keys.get("dataset.train_split", "")))
        if size:
            batch = TrainerConfig().batch_size
            put(f"trainer.steps={math.ceil(epochs * size / batch)}", "magrpo.num_train_epochs",
                f"epochs: {epochs} passes over {size} train problems at trainer.batch_size={batch} trees per step")
        else:
            out.unmapped.append(("magrpo.num_train_epochs", "the train split's size is not known from its spec "
                                 "(give trainer.steps = epochs * problems / trainer.batch_size)"))
    if "magrpo.advantage_mode" in keys:
        mode = str(take("magrpo.advantage_mode")).lower()
        if mode in BASELINES:
            put(f"trainer.baseline={BASELINES[mode]}", "magrpo.advantage_mode")
        else:
            out.unmapped.append(("magrpo.advantage_mode", f"{mode!r} is not one of CoMLRL's mean, raw, max, rloo"))
    if "magrpo.advantage_normalization" in keys:
        on = bool(take("magrpo.advantage_normalization"))
        put(f"trainer.advantage_scale={'std' if on else 'none'}", "magrpo.advantage_normalization",
            "" if not on or keys.get("magrpo.advantage_mode", "mean") == "mean" else
            "normalisation: CoMLRL re-centres the advantages before dividing by their std; magrpo only divides")
    if keys.get("magrpo.reference_kl_enabled"):
        take("magrpo.reference_kl_enabled")
        put(f"trainer.kl_coef={hydra_value(keys.get('magrpo.reference_kl_coef', 0.1))}", "magrpo.reference_kl_enabled",
            "KL: CoMLRL subtracts the KL to the reference from the returns; magrpo adds a k3 KL term to the loss")
        done.add("magrpo.reference_kl_coef")
    elif "magrpo.reference_kl_enabled" in keys:
        done.update({"magrpo.reference_kl_enabled", "magrpo.reference_kl_coef"})  # off, as magrpo's default
    simple("magrpo.eval_num_samples", "eval.num_samples")
    if "magrpo.eval_interval" in keys:
        put(
            f"eval.every={hydra_value(take('magrpo.eval_interval'))}",
            "magrpo.eval_interval",
            "eval interval: CoMLRL counts training prompts, magrpo counts optimizer steps "
            "(trainer.batch_size trees each)",
        )

    # Reward: CoMLRL applies r * scale_factor + shift; the code env computes (levels + shift) * scale.
    shift = keys.get("reward_processor.shift", keys.get("magrpo.reward_shift"))
    scale = keys.get("reward_processor.scale_factor", 1.0)
    enabled = keys.get("reward_processor.enabled", "reward_processor.shift" not in keys)
    for key in (
        "reward_processor.enabled",
        "reward_processor.shift",
        "reward_processor.scale_factor",
        "magrpo.reward_shift",
    ):
        if key in keys:
            done.add(key)
    if enabled and (shift or scale != 1.0):
        if scale == 0:
            out.unmapped.append(("reward_processor.scale_factor", "0 would make every reward 0"))
        else:
            if scale != 1.0:
                put(f"env.reward.scale={hydra_value(float(scale))}", "reward_processor.scale_factor")
            if shift:
                put(f"env.reward.shift={hydra_value(float(shift) / float(scale))}", "reward_processor.shift",
                    "reward shift: moves every reward, so the early-termination threshold and the logged rewards; "
                    "with the mean, rloo or max baseline the advantages do not change")

    # Feedback between turns.
    if "external.mode" in keys:
        mode = str(take("external.mode"))
        if mode in FEEDBACK_MODES:
            put(f"external={mode}", "external.mode")
        else:
            out.unmapped.append(
                ("external.mode", f"{mode!r} is not one of magrpo's modes: {', '.join(FEEDBACK_MODES)}")
            )
    simple("external.original_prompt", "external.original_prompt")
    if "external.previous_response" in keys:
        if take("external.previous_response"):
            pass  # magrpo always shows the agent's previous code
        else:
            out.unmapped.append(("external.previous_response", "magrpo always shows the agent's previous code"))
    if "external.expert_model" in keys:
        put(f"external.expert.model={hydra_value(take('external.expert_model'))}", "external.expert_model",
            "expert: magrpo asks an OpenAI-compatible server at external.expert.base_url (or the offline "
            "reference expert when it is empty); give the server's URL")

    # CoMLRL 1.4.3 defaults that differ from magrpo's, where the file relies on them.
    for key, why in COMLRL_DEFAULTS.items():
        if key not in keys:
            out.differences.append((f"{key} (not in the file)", why))

    # Logging.
    for leaf in ("project", "entity", "name", "tags"):
        simple(f"wandb.{leaf}", f"logging.wandb.{leaf}")

    for key, why in UNMAPPED.items():
        if key in keys and key not in done:
            skip(key, why)
    for key in keys:
        if key not in done:
            out.unmapped.append((key, "not a CoMLRL / LLM_Collab MAGRPO key magrpo knows"))
    return out


def shell_word(override: str) -> str:
    """One override as a shell word; Hydra's own single quotes go inside double quotes, as the docs write them."""
    if shlex.quote(override) == override:
        return override
    return f'"{override}"' if not set(override) & set('"$`\\!') else shlex.quote(override)


def render(path: str, ported: Ported) -> str:
    lines = [f"# magrpo equivalent of {path} (CoMLRL / LLM_Collab MAGRPO config)", "python train.py \\"]
    words = [shell_word(o) for o in ported.overrides]
    lines += [f"    {w} \\" for w in words[:-1]] + [f"    {w}" for w in words[-1:]]
    lines.append("\n# Mapped, but magrpo behaves differently (docs/porting.md):")
    lines += [f"#   {key}: {why}" for key, why in ported.differences] + [f"#   {text}" for text in ALWAYS]
    lines.append("\n# Not mapped:" if ported.unmapped else "\n# Not mapped: none")
    lines += [f"#   {key}: {why}" for key, why in ported.unmapped]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    import yaml

    path = Path(argv[0])
    try:
        config = yaml.safe_load(path.read_text())
        print(render(argv[0], port(config)))
    except OSError as e:
        print(f"config error: {path}: cannot be read ({e.strerror})", file=sys.stderr)
        return 2
    except yaml.YAMLError as e:
        print(f"config error: {path}: not valid YAML ({' '.join(str(e).split())[:200]})", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
