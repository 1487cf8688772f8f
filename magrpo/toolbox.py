"""The run's tools, set up once (issue 46): `tools.names` resolved and the MCP servers of `tools.mcp`
started, listed and held, in one `Toolbox` that the trainer opens at start-up (after every cheaper
check, before any model loads: a server that cannot start is one line naming its entry) and closes
once, however the run ends. The agents get its schemas for their prompts, the backend its tools for the
tool loop (magrpo.tool_loop); nothing else resolves a tool or holds a session.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .tools import Tool, resolve


@dataclass
class Toolbox:
    tools: tuple[Tool, ...] = ()
    max_calls: int = 4  # tools.max_calls and the rest: the tool loop's limits
    timeout_s: float = 10.0
    max_output_chars: int = 4000
    max_concurrency: int = 8
    servers: Any = None  # the MCP sessions this box opened (magrpo.mcp_tools.McpServers), ended by close()
    warnings: tuple[str, ...] = ()  # what holds the servers less than it should: said at start-up, in config.json

    @classmethod
    def open(cls, t) -> Toolbox:
        """The tools of a `tools` config section: `tools.names` resolved, then every tool of the servers of
        `tools.mcp` (started now; a ConfigError naming `tools.mcp[i]` when one cannot be used); a name used
        twice is a ConfigError. Empty when no tool is configured (generation then runs as without tools)."""
        tools = resolve(t.names, "tools.names")
        servers = None
        if t.mcp:  # the mcp package is imported only for a run with servers
            from .mcp_tools import McpServers

            servers = McpServers(t.mcp)
            try:
                tools += server_tools(servers.tools, {tool.name: "tools.names" for tool in tools})
            except BaseException:
                servers.close()
                raise
        from . import lifeline

        started = any(server.command for server in t.mcp)  # a server at a url is the user's to stop
        warnings = (lifeline.NO_TREE_WARNING,) if started and not lifeline.holds_tree() else ()
        return cls(tuple(tools), t.max_calls, t.timeout_s, t.max_output_chars, t.max_concurrency, servers, warnings)

    @property
    def schemas(self) -> tuple[dict, ...]:
        """Each tool's OpenAI function schema: what the agents' prompts show."""
        return tuple(tool.schema for tool in self.tools)

    def __bool__(self) -> bool:
        return bool(self.tools)

    def close(self) -> None:
        """End the MCP sessions (and with them the servers' processes); again: nothing."""
        servers, self.servers = self.servers, None
        if servers is not None:
            servers.close()

    def __enter__(self) -> Toolbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def server_tools(per_server: list[list[Tool]], seen: dict[str, str]) -> list[Tool]:
    """The servers' tools in config order; a ConfigError for a name another source already has."""
    out = []
    for i, tools in enumerate(per_server):
        for tool in tools:
            if tool.name in seen:
                raise ConfigError(f"tools.mcp[{i}]", f"its tool {tool.name!r} has the name of a tool of "
                                                     f"{seen[tool.name]}; choose this server's tools with "
                                                     f"tools.mcp[{i}].tools=[...]")
            seen[tool.name] = f"tools.mcp[{i}]"
            out.append(tool)
    return out
