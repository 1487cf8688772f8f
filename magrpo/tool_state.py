"""What a tool knows of the branch that calls it (issue 31): the `ToolContext`, and the lifecycle of
stateful tools, verl's contract: `create(context) -> handle`, `execute(handle, **arguments)`,
`release(handle)`, once per rollout branch.

A branch is one agent's sample in one node's turn (a `Turn` of magrpo.tool_loop). Its `Session`
holds the context its tools see and the handle of every stateful tool it has called: created at the
branch's first call of that tool, released once the turn ends (`release_all`), whatever happened in
between (errors, timeouts, a generate call that raised). A branch that never calls a stateful tool
creates nothing. Also here: running a sync or async callable with a timeout, shared with
magrpo.tools.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Callable, Coroutine, Mapping, Sequence

CONTEXT = "context"  # the keyword-only parameter through which a function tool asks for its ToolContext


@dataclass(frozen=True)
class ToolContext:
    problem: Mapping[str, Any] | None = None  # env.tool_context(problem): what tools may see of the branch's problem
    agent: int | None = None  # the agent whose turn makes the call


def takes_context(fn: Callable[..., Any]) -> bool:
    """True when `fn` declares a keyword-only `context` parameter (never part of its schema)."""
    try:
        parameter = signature(fn).parameters.get(CONTEXT)
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def signature(fn: Callable[..., Any]) -> inspect.Signature:
    """fn's signature, read once per hashable callable (a tool's arguments are checked against it at
    every call); an unhashable one's is read each time."""
    try:
        return _cached_signature(fn)
    except TypeError:
        return inspect.signature(fn)  # raises TypeError itself for a builtin without a signature


@lru_cache(maxsize=256)
def _cached_signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def is_stateful(obj: Any) -> bool:
    return all(callable(getattr(obj, method, None)) for method in ("create", "execute", "release"))


class Session:
    """One branch's tools: the context they see and the stateful tools' handles (tool name ->
    (instance, handle))."""

    def __init__(self, context: ToolContext = ToolContext()):
        self.context = context
        self.handles: dict[str, tuple[Any, Any]] = {}

    async def handle(self, name: str, state: Any) -> Any:
        """The branch's handle of stateful tool `name` (instance `state`), created at its first call."""
        if name not in self.handles:
            self.handles[name] = (state, await _create(state, self.context))
        return self.handles[name][1]


async def _create(state: Any, context: ToolContext) -> Any:
    if inspect.iscoroutinefunction(state.create):
        return await state.create(context)  # cancelled at the call's timeout: no handle is left
    future = in_thread(state.create, context)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        # The call timed out while create still runs in its thread: its handle, once it comes, is
        # released there and then, as no branch will ever get it.
        future.add_done_callback(partial(_release_late, state))
        raise


def _release_late(state: Any, future: concurrent.futures.Future) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    try:
        released = state.release(future.result())
        if inspect.isawaitable(released):
            asyncio.run(released)
    except Exception:  # noqa: BLE001  (a thread of its own, nobody to tell: as a failed release at turn end)
        pass


def release_all(sessions: Sequence[Session], timeout_s: float, max_concurrency: int) -> int:
    """Release every handle the sessions hold (at most `max_concurrency` at once, each for at most
    `timeout_s` seconds) and forget them; the number of releases that raised or timed out."""
    held = [pair for session in sessions for pair in session.handles.values()]
    for session in sessions:
        session.handles.clear()
    if not held:
        return 0
    return run_coroutine(_release(held, timeout_s, max_concurrency))


async def _release(held: list[tuple[Any, Any]], timeout_s: float, max_concurrency: int) -> int:
    limit = asyncio.Semaphore(max(1, max_concurrency))

    async def one(state: Any, handle: Any) -> bool:
        async with limit:
            try:
                await asyncio.wait_for(invoke(state.release, handle), timeout_s)
            except Exception:  # noqa: BLE001  (the tool's own failure: counted, never the run's end)
                return False
        return True

    return sum(not ok for ok in await asyncio.gather(*(one(state, handle) for state, handle in held)))


def run_coroutine(coroutine: Coroutine) -> Any:
    """Run `coroutine` to its end from synchronous code, even when called inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    # Called from inside an event loop (a notebook): run ours in a thread of its own.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def invoke(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await an async tool; run a sync one in a daemon thread (`in_thread`)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    return await asyncio.wrap_future(in_thread(fn, *args, **kwargs))


def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
    """fn(*args, **kwargs) in a daemon thread, so that one that hangs past its timeout is left behind
    instead of holding up the round or the interpreter's exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        if not future.set_running_or_notify_cancel():  # a running future cannot be cancelled by a timeout
            return
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine)
            future.set_exception(e)

    threading.Thread(target=target, daemon=True, name=f"tool-{getattr(fn, '__name__', 'fn')}").start()
    return future
