"""A warm start for SmolLM2-135M with the code env's `run_tests` tool (issue 31): the untrained model
never writes a tool call (0 of ~128 completions), because its chat template shows no tools and the
plain format (docs/tools.md) is new to it. This fine-tunes it briefly (a LoRA, merged into the weights
afterwards) on transcripts of `env.dataset=easy` **train** problems: the agent's real prompt (as
magrpo renders it: chat template, tools preamble), then a reply that either

* calls `run_tests` on a draft (the reference, or a plausibly wrong variant of it), reads the tool's
  real output (run through the sandbox, tokenized as the tool loop appends it, masked from the loss),
  then writes the final code (the reference); or
* writes the reference code directly, with no call, so the model keeps both behaviours and GRPO
  has a choice to learn from. The reply's first token (call or code) is taught apart, as probability
  `WarmSpec.call_share` of calling (as envs/tool_arith_warm.py does).

The fine-tune is magrpo.sft's, the tiny tool_arith warm start's too, and runs pinned to portable
kernels (magrpo.pinned): the same weights under every kernel set of one machine. Saved as an ordinary HF folder, built
once and cached by its recipe under `$MAGRPO_CACHE/smollm2_tool_warm/` (atomic rename):

    python -m magrpo.envs.code.tool_warm         # prints the folder, for model.name=<folder>
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from magrpo import sft
from magrpo.conversation import encode_text
from magrpo.models import Agent, peft_deprecation_silenced
from magrpo.paths import cache_root
from magrpo.tiny import build_once
from magrpo.tool_state import ToolContext
from magrpo.tools import CALL_END, CALL_START, TOOLS, response_text

from .env import CodeEnv
from .reward import helper_names
from .tools import run_tests

FORMAT_VERSION = 3  # bump when the recipe below changes in a way WarmSpec does not show
TOOL = "run_tests"
LABEL = "SmolLM2 run_tests warm start"


@dataclass(frozen=True)
class WarmSpec:
    model: str = "smollm2-135m"  # an OFFLINE_MODELS name or a folder
    num_agents: int = 2  # env.num_agents the prompts are rendered for (every agent's role is shown)
    transcripts: int = 160
    call_share: float = 0.5  # transcripts whose reply calls run_tests; the rest answer directly
    wrong_share: float = 0.5  # calls whose draft is a wrong variant of the reference (the output shows failures)
    lr: float = 5e-4
    lora_r: int = 16
    lora_alpha: int = 32
    seed: int = 0


@dataclass
class Transcript:
    """One agent's turn on one train problem: prompt ids, then (ids, written by the model) segments."""

    task_id: str
    agent: int
    prompt_ids: list[int]
    segments: list[tuple[list[int], bool]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    call: dict[str, Any] | None = None  # {"name", "arguments"} of the reply's call, None when it answers directly

    def ids(self) -> list[int]:
        return self.prompt_ids + [t for ids, _ in self.segments for t in ids]

    def learn_mask(self) -> list[bool]:
        """True where the token is the model's own (the loss covers exactly these)."""
        return [False] * len(self.prompt_ids) + [by_model for ids, by_model in self.segments for _ in ids]


def code_env(num_agents: int, sandbox: str = "bwrap") -> CodeEnv:
    """The code env on the easy dataset's train split, the only split transcripts are drawn from."""
    return CodeEnv(CodeEnv.Config(dataset="easy", train_split="train", eval_split="heldout",
                                  num_agents=num_agents, sandbox=sandbox))


def prompt_agents(tokenizer, num_agents: int, chat_template: str = "auto") -> list[Agent]:
    """Agents as `magrpo.models.load_agents` builds them for `tools=[run_tests]` (the same chat-template
    choice and tools schema), without a model: only their prompt and text encoding are used."""
    use_template = chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))
    return [Agent(index=i, model=None, tokenizer=tokenizer, use_chat_template=use_template, model_path="",
                  tool_schemas=(TOOLS.get(TOOL).schema,)) for i in range(num_agents)]


def call_text(code: str) -> str:
    """The reply's call, in the plain format the tool loop parses (magrpo.tools.parse_call)."""
    return f"{CALL_START}{json.dumps({'name': TOOL, 'arguments': {'code': code}})}{CALL_END}"


def reference(problem: dict, name: str) -> ast.FunctionDef:
    """The problem's reference solution as a function named `name` (docstring dropped)."""
    tree = ast.parse(problem["prompt"] + problem["canonical_solution"])
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == problem["entry_point"])
    fn.body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))] or fn.body
    fn.name = name
    return fn


def wrong_variant(fn: ast.FunctionDef, rng: random.Random) -> str | None:
    """The function with one plausible slip (an operator swapped, a constant off by one); None if none applies."""
    swaps = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Mod: ast.FloorDiv,
             ast.FloorDiv: ast.Mod}
    tree = ast.parse(ast.unparse(fn))  # a copy to edit
    spots = [(node, kind) for node in ast.walk(tree) for kind in ("op", "ops", "value")
             if (kind == "op" and isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in swaps)
             or (kind == "ops" and isinstance(node, ast.Compare) and type(node.ops[0]) in swaps)
             or (kind == "value" and isinstance(node, ast.Constant) and type(node.value) is int)]
    if not spots:
        return None
    node, kind = rng.choice(spots)
    if kind == "op":
        node.op = swaps[type(node.op)]()
    elif kind == "ops":
        node.ops = [swaps[type(node.ops[0])](), *node.ops[1:]]
    else:
        node.value += 1
    return ast.unparse(tree)


def entry_stub(fn: ast.FunctionDef, entry: str) -> str:
    """`def entry(same params): return helper(same params)`: what a helper writer's run_tests call needs,
    since the examples call the entry point (docs/tools.md)."""
    params = [a.arg for a in fn.args.args]
    return f"def {entry}({', '.join(params)}):\n    return {fn.name}({', '.join(params)})"


def build_transcripts(env: CodeEnv, agents: Sequence[Agent], spec: WarmSpec) -> list[Transcript]:
    """`spec.transcripts` transcripts of the env's train problems, seeded (the same list for the same
    spec); the tool outputs are the real tool's, run in the env's sandbox."""
    rng = random.Random(f"smollm2_tool_warm:{spec.seed}")
    problems = env.problems("train")
    names = helper_names(env.num_agents - 1) if env.num_agents > 1 else []
    out = []
    for _ in range(spec.transcripts):
        problem = rng.choice(problems)
        k = rng.randrange(env.num_agents)
        agent, entry = agents[k], problem["entry_point"]
        fn = reference(problem, names[k] if k < len(names) else entry)
        final = ast.unparse(fn)
        t = Transcript(problem["task_id"], k, agent.encode_prompts([env.agent_prompts(problem)[k]])[0])
        if rng.random() < spec.call_share:
            draft = (wrong_variant(fn, rng) if rng.random() < spec.wrong_share else None) or final
            code = draft if fn.name == entry else f"{draft}\n\n{entry_stub(fn, entry)}"
            output = run_tests(code, context=ToolContext(problem=env.tool_context(problem), agent=k))
            t.call = {"name": TOOL, "arguments": {"code": code}}
            _add(t, agent, call_text(code), True)
            _add(t, agent, response_text(output), False)
        _add(t, agent, final, True)
        t.segments[-1][0].append(agent.tokenizer.eos_token_id)  # the reply ends (generation stops at EOS)
        out.append(t)
    return out


def _add(t: Transcript, agent: Agent, text: str, by_model: bool) -> None:
    """A segment as the tool loop holds it: each tokenized apart (generation stops at a call's end and
    resumes after the tool message), the tool message with the loop's own encoder."""
    ids = list(agent.tokenizer(text, add_special_tokens=False)["input_ids"]) if by_model else encode_text(agent, text)
    t.segments.append((ids, by_model))
    t.texts.append(text)


def base_path(spec: WarmSpec) -> Path:
    from magrpo.models import resolve_model_path

    return Path(resolve_model_path(spec.model))


def warm_model_path(spec: WarmSpec = WarmSpec(), cache_dir: str | Path | None = None, sandbox: str = "bwrap") -> Path:
    """The warm-started model's folder, built on first use (cached; the key covers the base model's
    folder name, the recipe and a sample transcript, so a change to the prompt format builds anew)."""
    from transformers import AutoTokenizer

    base = base_path(spec)
    tok = AutoTokenizer.from_pretrained(base, padding_side="left")
    env = code_env(spec.num_agents, sandbox)
    sample = build_transcripts(env, prompt_agents(tok, spec.num_agents), dataclasses.replace(spec, transcripts=2))
    payload = json.dumps({"format": FORMAT_VERSION, "base": base.name, "spec": dataclasses.asdict(spec),
                          "sample": [t.ids() for t in sample]}, sort_keys=True)
    final = cache_root(cache_dir) / "smollm2_tool_warm" / hashlib.sha256(payload.encode()).hexdigest()[:16]
    arguments = {"spec": dataclasses.asdict(spec), "base": str(base), "sandbox": sandbox}
    return build_once(final, lambda tmp: sft.build_pinned("magrpo.envs.code.tool_warm:build", arguments, tmp, LABEL),
                      "warm-started SmolLM2 (run_tests)")


def build(out: str, spec: dict, base: str, sandbox: str) -> None:
    """The build, in the pinned child (magrpo.sft.build_pinned)."""
    warm = WarmSpec(**spec)
    _train(warm, Path(base), code_env(warm.num_agents, sandbox), Path(out))


def _train(spec: WarmSpec, base: Path, env: CodeEnv, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.seed)
    tok = AutoTokenizer.from_pretrained(base, padding_side="left")
    transcripts = build_transcripts(env, prompt_agents(tok, spec.num_agents), spec)
    calls = sum(t.call is not None for t in transcripts)
    print(f"{len(transcripts)} transcripts, {calls} with a call", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with peft_deprecation_silenced():
        model = get_peft_model(model, LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    examples = ([sft.Example(t.ids(), t.learn_mask(), len(t.prompt_ids))] for t in transcripts)
    sft.fit(model, examples, choices=_first_tokens(transcripts), target=[spec.call_share, 1 - spec.call_share],
            pad_id=tok.pad_token_id, lr=spec.lr, label=LABEL, log_every=10, total=len(transcripts))
    merged = model.merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    sft.write_record(out, {"transcripts": len(transcripts), "with_call": calls})


def _first_tokens(transcripts: Sequence[Transcript]) -> tuple[int, int]:
    """The reply's first token when it calls and when it writes code (`<` and `def` for SmolLM2)."""
    firsts = {t.call is not None: t.segments[0][0][0] for t in transcripts}
    if len({t.segments[0][0][0] for t in transcripts}) != 2 or len(firsts) != 2:
        raise sft.WarmStartError(f"{LABEL}: the replies do not start with one token for a call and one for code "
                                 "with this tokenizer; set WarmSpec.model to a model whose tokenizer does")
    return firsts[True], firsts[False]


if __name__ == "__main__":
    sys.exit(sft.main_printing(warm_model_path))
