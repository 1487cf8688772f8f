"""MCP servers as tools (issue 31, point 5): `tools.mcp` lists servers (a stdio command or a URL);
at start-up each is connected with the MCP SDK's client, its tools are listed, and each becomes a
magrpo `Tool` whose `fn` calls it, so the tool loop treats it like any other tool (docs/tools.md).

One session per server for the whole run. Sessions live in one event loop, on a daemon thread of its
own: `execute_calls` runs every round in a fresh `asyncio.run` loop, and an MCP session (its anyio
task groups and streams) must stay in the loop that opened it, so a call hands its request over to
the sessions' loop and awaits the answer. The run's Toolbox (magrpo.toolbox) opens the servers once,
at start-up, and closes them once at the end of the run, however it ends. Imported only when
`tools.mcp` is set.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import inspect
import json
import os
import shutil
import sys
import tempfile
import threading
from contextlib import AsyncExitStack
from typing import Any, Sequence

from . import lifeline
from .config import McpServerConfig
from .errors import ConfigError
from .tools import Tool


class ToolError(Exception):
    """An MCP tool answered with `isError`: raised, so the call counts as `raised` (tools/errors/raised)."""


class McpServers:
    """The open sessions of some servers and their tools; `close` ends them (and the servers' processes)."""

    def __init__(self, servers: Sequence[McpServerConfig]):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="mcp-sessions")
        self.thread.start()
        self.stop: asyncio.Event | None = None
        self.tools: list[list[Tool]] = []  # per server, in config order
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self.owner = asyncio.run_coroutine_threadsafe(self._own(servers, ready), self.loop)
        try:
            self.tools = ready.result()
        except BaseException:
            self._end_loop()
            raise

    async def _own(self, servers: Sequence[McpServerConfig], ready: concurrent.futures.Future) -> None:
        """Open every session in this one task and hold them until `close`: anyio's task groups (inside
        the transports) must be left by the task that entered them."""
        self.stop = asyncio.Event()
        connecting = 0  # the entry being connected: a transport's own task may fail after _connect returned
        try:
            async with AsyncExitStack() as stack:
                tools = []
                for connecting, server in enumerate(servers):
                    tools.append(await self._connect(stack, f"tools.mcp[{connecting}]", server))
                ready.set_result(tools)
                await self.stop.wait()
        except BaseException as e:  # noqa: BLE001  (start-up failures go to the caller; later ones end quietly)
            if not ready.done():
                ready.set_exception(start_error(e, connecting, servers[connecting]))

    async def _connect(self, stack: AsyncExitStack, key: str, server: McpServerConfig) -> list[Tool]:
        import anyio
        from mcp import ClientSession

        stderr = stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))
        try:
            read, write = await stack.enter_async_context(transport(server, stderr))
            session = await stack.enter_async_context(ClientSession(read, write))
            with anyio.fail_after(server.start_timeout_s):
                await session.initialize()
                listed = await list_all(session)
        except TimeoutError:
            raise ConfigError(key, f"{where(server)} did not finish the MCP handshake and list its tools within "
                                   f"{server.start_timeout_s:g} s (start_timeout_s){last_line(stderr)}") from None
        except Exception as e:  # noqa: BLE001  (a process that cannot start or dies: one line naming the entry)
            raise ConfigError(key, f"{where(server)} could not be used: {first_error(e)}{last_line(stderr)}") from None
        by_name = {t.name: t for t in listed}
        missing = [name for name in server.tools if name not in by_name]
        if missing:
            raise ConfigError(f"{key}.tools", f"{', '.join(map(repr, missing))}: not a tool of {where(server)}; it "
                                              f"has: {', '.join(by_name) or 'none'}")
        tools = [self._tool(session, by_name[name]) for name in (server.tools or by_name)]
        for tool in tools:
            check_size(tool, key, server)
        return tools

    def _tool(self, session, listed) -> Tool:
        name, loop = listed.name, self.loop

        async def call(**arguments: Any) -> str:
            # The request runs in the sessions' loop; cancelling this coroutine (a timeout) cancels it there.
            future = asyncio.run_coroutine_threadsafe(session.call_tool(name, arguments), loop)
            return result_text(await asyncio.wrap_future(future))

        call.__signature__ = signature(listed.input_schema)  # unknown or missing arguments: bad_arguments
        call.__name__ = name
        schema = {"name": name, "description": listed.description or "", "parameters": listed.input_schema}
        return Tool(name, schema, call)

    def close(self) -> None:
        """End every session (the SDK closes a stdio server's stdin, then terminates it after a grace period)."""
        if self.loop.is_closed():
            return
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        try:
            self.owner.result(timeout=30)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            pass
        self._end_loop()

    def _end_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


def check_size(tool: Tool, key: str, server: McpServerConfig) -> None:
    """A ConfigError when the tool's schema is longer than the entry's max_schema_chars: every prompt
    shows it (a server once described a tool in 4 MB, 524k tokens of every prompt)."""
    size = len(json.dumps(tool.schema, ensure_ascii=False))
    if size > server.max_schema_chars:
        raise ConfigError(f"{key}.max_schema_chars", f"{where(server)} lists {tool.name!r} with a schema of {size:,} "
                                                     f"characters (description and inputSchema as JSON), more than "
                                                     f"{server.max_schema_chars:,}; every prompt would show it: leave "
                                                     f"it out with {key}.tools=[...] or raise the limit")


PYTHON = ("python", "python3")  # a stdio server's command naming these runs under sys.executable
RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcp_relay.py")


def transport(server: McpServerConfig, stderr):
    """The SDK's client transport for an entry: stdio for a command (its stderr kept aside for errors),
    streamable HTTP for a URL."""
    if server.command:
        from mcp import StdioServerParameters, stdio_client
        from mcp.client.stdio import get_default_environment

        # Under a lifeline supervisor (magrpo/lifeline.py): the server and every process it starts die
        # with this process, even by SIGKILL. Its grace after the SDK's SIGTERM (1 s) ends before the
        # SDK's SIGKILL of the group (2 s later), which would leave the supervisor no time to clean up.
        env = get_default_environment() | dict(server.env)
        # `python` is the trainer's own interpreter (its venv and packages), not the first on the SDK's PATH
        executable = sys.executable if server.command[0] in PYTHON else shutil.which(server.command[0],
                                                                                      path=env.get("PATH"))
        if executable is None:  # found here, as the SDK would have: the supervisor could only say it later
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), server.command[0])
        # Through a relay that drops any line of its stdout past max_message_bytes (magrpo/mcp_relay.py).
        relay = [sys.executable, "-I", "-S", RELAY, str(server.max_message_bytes), "--"]
        argv = lifeline.command([*relay, executable, *server.command[1:]], grace_s=1.0)
        return stdio_client(StdioServerParameters(command=argv[0], args=argv[1:], env=env), errlog=stderr)
    from mcp.client.streamable_http import streamable_http_client

    return streamable_http_client(server.url)


async def list_all(session) -> list:
    """Every tool the server lists, following its pages."""
    from mcp.types import PaginatedRequestParams

    out, cursor = [], None
    while True:
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        out += page.tools
        cursor = page.next_cursor
        if not cursor:
            return out


def signature(input_schema: dict) -> inspect.Signature:
    """Keyword parameters from a JSON schema's properties (required ones without a default), so that
    `execute_calls` reports unknown or missing arguments as it does for any tool."""
    properties = input_schema.get("properties") or {}
    required = set(input_schema.get("required") or ())
    params = [inspect.Parameter(p, inspect.Parameter.KEYWORD_ONLY,
                                **({} if p in required else {"default": None}))
              for p in sorted(properties, key=lambda p: p not in required) if p.isidentifier()]
    if input_schema.get("additionalProperties", True) is not False or len(params) < len(properties):
        params.append(inspect.Parameter("more", inspect.Parameter.VAR_KEYWORD))  # the server decides
    return inspect.Signature(params)


def result_text(result) -> str:
    """A CallToolResult as text: its text items joined, other items named briefly, structured content
    when there is nothing else; an error result raised as ToolError."""
    parts = [content_text(c) for c in result.content]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content)]
    text = "\n".join(parts)
    if result.is_error:
        raise ToolError(text or "the tool reported an error")
    return text


def content_text(content) -> str:
    kind = getattr(content, "type", "")
    if kind == "text":
        return content.text
    if kind in ("image", "audio"):
        return f"[{kind}: {content.mime_type}, {len(content.data)} base64 characters]"
    if kind == "resource_link":
        return f"[resource: {content.uri}]"
    if kind == "resource":
        inner = content.resource
        return getattr(inner, "text", None) or f"[resource: {inner.uri}, {inner.mime_type or 'binary'}]"
    return f"[{kind or type(content).__name__} content]"


def where(server: McpServerConfig) -> str:
    return f"the server {' '.join(server.command)!r}" if server.command else f"the server at {server.url}"


def first_error(e: BaseException) -> str:
    """The first real error inside anyio's exception groups, as `Type: message`."""
    while getattr(e, "exceptions", None):  # an exception group (Python 3.11+; duck-typed for 3.10)
        e = e.exceptions[0]
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def last_line(stderr) -> str:
    """'; its stderr ends: <line>' from a server's kept stderr, or ''."""
    try:
        stderr.flush()
        stderr.seek(0)
        lines = [line.strip() for line in stderr.read()[-4000:].splitlines() if line.strip()]
    except (OSError, ValueError):
        return ""
    return f"; its stderr ends: {lines[-1][:300]}" if lines else ""


def start_error(e: BaseException, i: int, server: McpServerConfig) -> BaseException:
    """The ConfigError raised inside the transports' task groups (they may wrap it in a group), else
    the first error there, as a ConfigError naming the entry being connected."""
    if getattr(e, "exceptions", None):
        matched, _ = e.split(ConfigError)
        while getattr(matched, "exceptions", None):
            matched = matched.exceptions[0]
        if matched is not None:
            return matched
    return e if isinstance(e, ConfigError) else ConfigError(f"tools.mcp[{i}]", f"{where(server)} could not be used: "
                                                                               f"{first_error(e)}")
