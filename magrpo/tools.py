"""Tools a model may call inside a turn (issue 31): what a tool is, the `TOOLS` registry, the plain
call format and its parser, and `execute_calls`, which runs one round's calls concurrently. Pure: no
model; the loop that generates, stops at a call and resumes is magrpo.tool_loop.

A call is the model's text `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5/Qwen3's
own format), and its result goes back as `<tool_response>\n...\n</tool_response>` (docs/tools.md).
Nothing a model writes crashes a run: a bad call gets an error text as its result, counted by kind.
Stateful tools (create / execute / release per rollout branch) and the context a tool may ask for:
magrpo.tool_state.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .config import choice
from .errors import ConfigError, valid_text
from .registry import Registry
from .tool_state import CONTEXT, Session, invoke, is_stateful, release_all, run_coroutine, signature, takes_context

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESPONSE_START, RESPONSE_END = "<tool_response>\n", "\n</tool_response>\n"
TOOLS_HINT = ("or your own: tools=[package.module:function] (its docstring describes it), "
              "tools=[package.module:Class] (a stateful tool: schema, create, execute, release) or "
              "tools=[package.module:NAME] (a magrpo.tools.Tool)")
ERROR_KINDS = ("bad_json", "unknown_tool", "bad_arguments", "raised", "timeout", "truncated")
# Bounds on what a call may carry (docs/tools.md): past them the call is bad_arguments. A tool's arguments
# are a few values; a model that loops writes megabytes, or `{` after `{` until the tokens run out.
MAX_CALL_CHARS = 100_000  # the JSON between the call markers
MAX_ARGUMENT_DEPTH = 32  # objects and arrays nested in the arguments (the arguments object itself is 1)


@dataclass(frozen=True)
class Tool:
    name: str
    schema: dict  # the OpenAI function schema: {"name", "description", "parameters": JSON schema}
    fn: Callable[..., Any]  # called with the call's arguments as keywords; sync or async; returns text
    state: Any = None  # a stateful tool's instance (fn is its execute, called with the branch's handle first)


TOOLS: Registry[Tool] = Registry("tool")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class CallError:
    kind: str  # one of ERROR_KINDS
    message: str  # the tool message the model gets back


@dataclass
class ToolResult:
    text: str  # what goes back to the model (an error's message, or the tool's output, capped)
    error: str | None = None  # an ERROR_KINDS entry, None when the tool answered in full
    seconds: float = 0.0


@dataclass
class ToolStats:
    """One step's tool numbers (logged as tools/calls, tools/errors/<kind>, tools/seconds,
    tools/call_rate)."""

    calls: int = 0
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    completions: int = 0  # completions generated with tools available
    calling: int = 0  # of those, the ones that made at least one call

    def add_completions(self, completions: int, calling: int) -> None:
        self.completions += completions
        self.calling += calling

    def add(self, results: Sequence[ToolResult]) -> None:
        for r in results:
            self.calls += 1
            self.seconds += r.seconds
            if r.error:
                self.count(r.error, 1)

    def count(self, kind: str, n: int) -> None:
        """n more errors of `kind` (release: a stateful tool's release that raised or timed out)."""
        if n:
            self.errors[kind] = self.errors.get(kind, 0) + n

    def metrics(self) -> dict[str, float]:
        from .metrics import Counter, Gauge

        out = {"tools/calls": Counter(self.calls), "tools/seconds": Counter(self.seconds)}
        out.update({f"tools/errors/{kind}": Counter(n) for kind, n in self.errors.items()})
        if self.completions:  # a rate: averaged over torchrun processes, whose shares are equal
            out["tools/call_rate"] = Gauge(self.calling / self.completions)
        return out


def resolve(names: Sequence[str], key: str = "tools") -> list[Tool]:
    """Registered names or `package.module:attr` (a Tool, a stateful tool's class or instance, or a
    function: its name and docstring make the schema); anything else is a ConfigError naming `key`
    and the registered tools."""
    out = []
    for name in names:
        if ":" not in name:
            choice(key, name, TOOLS.names(), TOOLS_HINT)
            out.append(TOOLS.get(name))
            continue
        from .plugins import import_module

        module_name, _, attr = name.partition(":")
        obj = getattr(import_module(key, module_name), attr, None)
        if isinstance(obj, Tool):
            out.append(obj)
        elif is_stateful(obj):
            try:
                out.append(stateful_tool(obj))
            except Exception as e:  # noqa: BLE001  (the user's class: its own error, in one line)
                raise ConfigError(key, f"{name!r}: not a usable stateful tool: {type(e).__name__}: {e}") from None
        elif callable(obj):
            out.append(function_tool(obj))
        else:
            raise ConfigError(key, f"{name!r}: module {module_name!r} has no Tool or function {attr!r}")
    seen = [t.name for t in out]
    if len(set(seen)) != len(seen):
        raise ConfigError(key, f"two tools share a name: {', '.join(seen)}")
    return out


def function_tool(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A Tool from a plain function: every parameter a string unless annotated int/float/bool. A
    keyword-only `context` parameter is no argument of the model's: it gets the branch's ToolContext."""
    kinds = {int: "integer", float: "number", bool: "boolean", "int": "integer", "float": "number",
             "bool": "boolean"}
    params = {p: v for p, v in inspect.signature(fn).parameters.items()
              if not (p == CONTEXT and v.kind is inspect.Parameter.KEYWORD_ONLY)}
    properties = {p: {"type": kinds.get(v.annotation, "string")} for p, v in params.items()}
    required = [p for p, v in params.items() if v.default is inspect.Parameter.empty]
    schema = {"name": name or fn.__name__, "description": inspect.getdoc(fn) or "",
              "parameters": {"type": "object", "properties": properties, "required": required}}
    return Tool(schema["name"], schema, fn)


def stateful_tool(obj: Any) -> Tool:
    """A Tool from a stateful tool (verl's contract): a class (instantiated without arguments) or an
    instance with `schema` (the OpenAI function schema, or a method returning it), `create(context)
    -> handle`, `execute(handle, **arguments) -> str` and `release(handle)`, each sync or async."""
    instance = obj() if inspect.isclass(obj) else obj
    schema = instance.schema() if callable(instance.schema) else instance.schema
    if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
        raise ValueError(f"its schema must be a dict with a string 'name', got {schema!r:.80}")
    return Tool(schema["name"], schema, instance.execute, state=instance)


def parse_call(text: str) -> ToolCall | CallError | None:
    """The call a model segment ends with (generation stops at CALL_END), an error when its body is
    not `{"name": str, "arguments": object}` (bad_json) or its arguments are past MAX_CALL_CHARS or
    MAX_ARGUMENT_DEPTH (bad_arguments), or None when the segment makes no call. Never raises: whatever
    the model wrote, a call or an error comes back, its strings valid text. A segment that ends in
    CALL_END with no CALL_START before it (the marker in prose or in code) is a bad_json call too: the
    turn goes on after the error, counted, instead of ending there as if cut at its token budget."""
    stripped = text.rstrip()
    if not stripped.endswith(CALL_END):
        return None
    if CALL_START not in stripped:
        return CallError("bad_json", f"error: {CALL_END} ends no call (no {CALL_START} before it); a call is "
                                     f'{CALL_START}{{"name": "<tool>", "arguments": {{...}}}}{CALL_END}')
    body = stripped[stripped.rindex(CALL_START) + len(CALL_START) : -len(CALL_END)]
    if len(body) > MAX_CALL_CHARS:
        return CallError("bad_arguments", f"error: the call is {len(body):,} characters long, more than "
                                          f"{MAX_CALL_CHARS:,}")
    call = read_json(body, "the call is")
    if isinstance(call, CallError):
        return call
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return CallError("bad_json", 'error: a call is {"name": "<tool>", "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string (OpenAI's wire form)
        arguments = read_json(arguments, "arguments are")
        if isinstance(arguments, CallError):
            return arguments
    if not isinstance(arguments, dict):
        return CallError("bad_arguments", f"error: arguments must be a JSON object, got {type(arguments).__name__}")
    try:
        return ToolCall(valid_text(call["name"]), valid_json(arguments))
    except ValueError:
        return CallError("bad_arguments", f"error: arguments are nested more than {MAX_ARGUMENT_DEPTH} levels deep")


def read_json(text: str, what: str) -> Any:
    """json.loads(text), or a bad_json CallError saying `what` "not valid JSON"; every way JSON text
    can fail becomes that error."""
    try:
        return json.loads(text)
    except RecursionError:  # Python's parser recurses per `[` or `{`: ~1000 of them, even unclosed
        return CallError("bad_json", f"error: {what} not valid JSON (nested too deeply to read)")
    except ValueError as e:  # JSONDecodeError, and a number past int()'s 4,300-digit limit
        return CallError("bad_json", f"error: {what} not valid JSON ({str(e).split(';')[0][:120]})")


def valid_json(value: Any, depth: int = 1) -> Any:
    """A parsed JSON value with every string (keys too) made valid text; ValueError when objects and
    arrays nest deeper than MAX_ARGUMENT_DEPTH (copies of it made later recurse as deep)."""
    if isinstance(value, str):
        return valid_text(value)
    if not isinstance(value, (dict, list)):
        return value
    if depth > MAX_ARGUMENT_DEPTH:
        raise ValueError(f"nested deeper than {MAX_ARGUMENT_DEPTH}")
    if isinstance(value, list):
        return [valid_json(v, depth + 1) for v in value]
    return {valid_text(k): valid_json(v, depth + 1) for k, v in value.items()}


def execute_calls(calls: Sequence[ToolCall | CallError], tools: Sequence[Tool], timeout_s: float,
                  max_output_chars: int, max_concurrency: int,
                  sessions: Sequence[Session] | None = None) -> list[ToolResult]:
    """One result per call, in order. At most `max_concurrency` run at once, each for at most
    `timeout_s` seconds; errors (a parse error, an unknown tool, bad arguments, a raise, a timeout)
    become error texts, and every text is cut to `max_output_chars`. `sessions`: each call's branch
    (the tool loop's, released when its turn ends); None: each call a branch of its own, released here."""
    by_name = {t.name: t for t in tools}
    own = sessions is None
    sessions = [Session() for _ in calls] if own else sessions
    try:
        return run_coroutine(_run_all(calls, sessions, by_name, timeout_s, max_output_chars, max_concurrency))
    finally:
        if own:
            release_all(sessions, timeout_s, max_concurrency)


async def _run_all(calls, sessions: Sequence[Session], by_name: dict[str, Tool], timeout_s: float,
                   max_output_chars: int, max_concurrency: int) -> list[ToolResult]:
    limit = asyncio.Semaphore(max(1, max_concurrency))

    async def one(call, session: Session) -> ToolResult:
        async with limit:
            result = await _run_one(call, session, by_name, timeout_s)
        result.text = valid_text(result.text)  # a tool's output or exception may hold lone surrogates
        return cap(result, max_output_chars)

    return list(await asyncio.gather(*(one(c, s) for c, s in zip(calls, sessions))))


async def _run_one(call: ToolCall | CallError, session: Session, by_name: dict[str, Tool],
                   timeout_s: float) -> ToolResult:
    if isinstance(call, CallError):
        return ToolResult(call.message, call.kind)
    tool = by_name.get(call.name)
    if tool is None:
        return ToolResult(f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(by_name))}", "unknown_tool")
    arguments = dict(call.arguments)
    if takes_context(tool.fn):
        if CONTEXT in arguments:  # the model's own `context` never stands in for the branch's
            return ToolResult(f"error: bad arguments for {call.name!r}: unexpected argument {CONTEXT!r}",
                              "bad_arguments")
        arguments[CONTEXT] = session.context
    handle = () if tool.state is None else (None,)  # a stateful tool's execute takes the handle first
    try:
        signature(tool.fn).bind(*handle, **arguments)
    except TypeError as e:
        return ToolResult(f"error: bad arguments for {call.name!r}: {e}", "bad_arguments")
    spent: list[float] = []

    async def execute() -> Any:  # a stateful tool's create counts against the call's timeout too
        # The call's own seconds: from when it starts running to when it ends (or is cancelled at its
        # timeout), not the time the round's other calls take in between on the same event loop.
        start = time.perf_counter()
        try:
            if tool.state is None:
                return await invoke(tool.fn, **arguments)
            return await invoke(tool.fn, await session.handle(tool.name, tool.state), **arguments)
        finally:
            spent.append(time.perf_counter() - start)

    try:
        output = await asyncio.wait_for(execute(), timeout_s)
        text = output if isinstance(output, str) else str(output)  # str() may raise too (an int of 5,000 digits)
    except asyncio.TimeoutError:
        return ToolResult(f"error: {call.name!r} timed out after {timeout_s:g} s", "timeout", sum(spent))
    except Exception as e:  # noqa: BLE001  (a tool's own failure is the model's to see, not the run's)
        return ToolResult(f"error: {call.name!r} raised {type(e).__name__}: {e}", "raised", sum(spent))
    return ToolResult(text, None, sum(spent))


def cap(result: ToolResult, max_output_chars: int) -> ToolResult:
    """Cut a text longer than `max_output_chars` (0: no cap), saying how much was left out."""
    if max_output_chars and len(result.text) > max_output_chars:
        left_out = len(result.text) - max_output_chars
        result.text = f"{result.text[:max_output_chars]}... [truncated: {left_out} more characters]"
        result.error = result.error or "truncated"
    return result


def tools_preamble(schemas: Sequence[dict]) -> str:
    """What a prompt starts with when the chat template cannot show the tools itself (the plain format)."""
    lines = "\n".join(json.dumps(s) for s in schemas)
    return (f"You may call these tools, one at a time, by writing {CALL_START}{{\"name\": NAME, \"arguments\": "
            f"{{...}}}}{CALL_END}; the result follows in {RESPONSE_START.strip()}:\n{lines}\n\n")


def response_text(result: str) -> str:
    """A tool result as it is appended to the turn (the plain format, also Qwen's tool message body)."""
    return f"\n{RESPONSE_START}{result}{RESPONSE_END}"


def calculator(expression: str) -> str:
    """Evaluate arithmetic: numbers, + - * / // % ** and parentheses, e.g. "(2 + 3) * 4"."""
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.USub: operator.neg, ast.UAdd: operator.pos}

    def bounded(result: float) -> float:
        # Every step stays small, so the next one is fast: chained powers, ((10**100)**100)**100..., would
        # otherwise hold the GIL (and the trainer) for minutes while the timeout thread waits
        if isinstance(result, int) and result.bit_length() > 4096:
            raise ValueError("result too large (more than 4096 bits)")
        return result

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:  # 9**9**9 would run for hours
                raise ValueError("exponent too large")
            return bounded(ops[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    return str(value(ast.parse(expression, mode="eval").body))


TOOLS.register("calculator")(function_tool(calculator))
