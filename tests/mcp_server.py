"""A real MCP server for the tests (tests/test_mcp_tools.py), written with the MCP SDK:
`python -m tests.mcp_server` (stdio) from the repository root."""
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("magrpo-test", log_level="WARNING")  # INFO would log every request to our stderr


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def fail(reason: str) -> str:
    """Always fails, with the reason given."""
    raise ToolError(f"refused: {reason}")  # its message reaches the client (any other exception's does not)


@server.tool()
async def wait(seconds: float) -> str:
    """Answer after some seconds (a test's call times out first)."""
    import anyio

    await anyio.sleep(seconds)
    return "waited"


@server.tool()
def big(size: int) -> str:
    """An answer of `size` characters (a tool that reads a huge file, or a shell tool running `yes`)."""
    return "x" * size


@server.tool()
def shout(size: int) -> str:
    """Write `size` characters to the server's stderr (a server that logs a lot)."""
    import sys

    sys.stderr.write("y" * size + "\n")
    sys.stderr.flush()
    return "done"


@server.tool()
def pid() -> str:
    """The server's process id (a test checks it is gone after the run)."""
    import os

    return str(os.getpid())


@server.tool()
def daemon(kind: str) -> str:
    """Start a daemon that escapes the server's process group (tests/daemons.py: setsid or double_fork);
    its pid."""
    from tests.daemons import start

    return str(start(kind))


if __name__ == "__main__":  # `python -m tests.mcp_server http PORT`: streamable HTTP at /mcp; otherwise stdio
    import sys

    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
