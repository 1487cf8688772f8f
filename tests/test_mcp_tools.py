"""MCP servers as tools (issue 31, point 5): a real stdio server written with the MCP SDK
(tests/mcp_server.py) is discovered at start-up, its tools called like any other, its errors counted,
bad entries refused in one line, and a short training run uses it and leaves no server process."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from magrpo.config import McpServerConfig, TrainConfig
from magrpo.errors import ConfigError
from magrpo.tools import Tool, ToolCall, execute_calls
from tests import nobody
from tests.daemons import KINDS, after_sigkill, alive, host_pids, survivors

# It counts the host's processes, /tmp entries or SysV objects: it runs alone (.ci/run, docs/testing.md).
pytestmark = pytest.mark.alone

ROOT = Path(__file__).resolve().parent.parent


def server(*extra: str, **fields) -> McpServerConfig:
    # The SDK starts a server with a minimal environment (no PYTHONPATH): tell it where `tests` is.
    return McpServerConfig(command=[sys.executable, "-m", "tests.mcp_server", *extra], env={"PYTHONPATH": str(ROOT)},
                           **fields)


def open_servers(servers: list[McpServerConfig]):
    """The servers' sessions, as a run's Toolbox opens them; `.tools` per server, `.close()` ends them."""
    from magrpo.mcp_tools import McpServers

    return McpServers(servers)


def override(entry: McpServerConfig) -> str:
    """The entry as a command-line override, every string quoted (paths hold `/`)."""
    command = ",".join(f"'{c}'" for c in entry.command)
    tools = ",".join(entry.tools)
    return f"tools.mcp=[{{command:[{command}],tools:[{tools}],env:{{PYTHONPATH:'{ROOT}'}}}}]"


def server_processes(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (our test servers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def uid(pid: int) -> int:
    """The process's real uid."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("\nUid:")[1].split()[0])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def opened():
    """One server for the module's tests (each start costs about a second): its tools, closed at the end."""
    opened = open_servers([server()])
    [tools] = opened.tools
    yield {t.name: t for t in tools}
    opened.close()


def call(tools, *calls: ToolCall):
    return execute_calls(list(calls), list(tools.values()), 60.0, 1000, 8)


def test_discovery_gives_each_tool_its_openai_schema(opened):
    assert list(opened) == ["add", "fail", "wait", "big", "shout", "pid", "daemon"]
    add = opened["add"].schema
    assert add["name"] == "add" and add["description"] == "Add two integers."
    assert add["parameters"]["required"] == ["a", "b"]
    assert {p: v["type"] for p, v in add["parameters"]["properties"].items()} == {"a": "integer", "b": "integer"}


def test_a_call_returns_the_tools_text_and_errors_count_by_kind(opened):
    ok, refused, missing, wrong_type = call(opened, ToolCall("add", {"a": 2, "b": 40}),
                                            ToolCall("fail", {"reason": "no"}),
                                            ToolCall("add", {"a": 2}),
                                            ToolCall("add", {"a": "two", "b": 1}))
    assert (ok.text, ok.error) == ("42", None)
    # an isError result is raised, so it is counted as any tool that raises
    assert refused.error == "raised"
    assert refused.text == "error: 'fail' raised ToolError: Error executing tool fail: refused: no"
    # arguments checked against the listed schema before the call, as for any other tool
    assert missing.error == "bad_arguments" and "'b'" in missing.text
    assert wrong_type.error == "raised" and "validation error" in wrong_type.text  # the server checks types


def test_a_call_past_its_timeout_ends_and_the_session_goes_on(opened):
    [slow] = execute_calls([ToolCall("wait", {"seconds": 60})], list(opened.values()), 0.5, 1000, 8)
    assert slow.error == "timeout" and slow.text == "error: 'wait' timed out after 0.5 s"
    [after] = call(opened, ToolCall("add", {"a": 2, "b": 2}))  # the request was cancelled, not the session
    assert after.text == "4"


def test_the_sessions_serve_calls_from_round_after_round(opened):
    # every round runs in a new asyncio.run loop; the session stays in its own
    for a in range(3):
        [r] = call(opened, ToolCall("add", {"a": a, "b": 1}))
        assert r.text == str(a + 1)


def test_a_server_at_a_url_over_streamable_http():
    import socket
    import subprocess
    import time

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.mcp_server", "http", str(port)], cwd=ROOT,
                               stderr=subprocess.DEVNULL)
    servers = [McpServerConfig(url=f"http://127.0.0.1:{port}/mcp", tools=["add"])]
    opened = None
    try:
        deadline = time.monotonic() + 60
        while True:  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "the HTTP server did not start"
                time.sleep(0.05)
        opened = open_servers(servers)
        [tools] = opened.tools
        [r] = execute_calls([ToolCall("add", {"a": 1, "b": 2})], tools, 60.0, 1000, 8)
        assert [t.name for t in tools] == ["add"] and (r.text, r.error) == ("3", None)
    finally:
        if opened is not None:
            opened.close()
        process.kill()
        process.wait()


@pytest.mark.parametrize("kind", KINDS)
def test_a_daemon_a_tool_started_ends_with_the_server(kind):
    """A tool's `setsid` or double-forked daemon, which ignores SIGTERM, is gone once the servers close
    (issue 44: the SDK's group kill never reached it)."""
    opened = open_servers([server(f"daemon-{kind}")])  # an argument the server ignores: a session of its own
    [tools] = opened.tools
    try:
        daemon, pid = call({t.name: t for t in tools}, ToolCall("daemon", {"kind": kind}), ToolCall("pid", {}))
        pids = host_pids(os.getpid(), [int(daemon.text), int(pid.text)])  # the server's PID namespace's, as root
        assert all(alive(p) for p in pids)
    finally:
        opened.close()
    assert survivors(pids, 0) == []  # close() returns once the server's supervisor has reaped them


# A trainer that opens a server, has it start a daemon of each kind, passes their pids and the
# server's on, and hangs in a tool call until the test kills it with SIGKILL.
TRAINER = """
import sys
from magrpo.config import McpServerConfig
from magrpo.mcp_tools import McpServers
from magrpo.tools import ToolCall, execute_calls

entry = McpServerConfig(command=[sys.executable, "-m", "tests.mcp_server"], env={"PYTHONPATH": sys.argv[1]})
[tools] = McpServers([entry]).tools
for call in [ToolCall("pid", {})] + [ToolCall("daemon", {"kind": kind}) for kind in ("setsid", "double_fork")]:
    print(execute_calls([call], tools, 60.0, 1000, 8)[0].text, flush=True)
execute_calls([ToolCall("wait", {"seconds": 3600})], tools, 3600.0, 1000, 8)
"""


@pytest.mark.parametrize("user", ["own", "nobody"])
def test_a_trainer_killed_by_sigkill_mid_call_takes_its_server_and_the_daemons_along(user):
    """As the test's own user, and (for a root test run) as `nobody` with the venv's own Python and `mcp`
    SDK (tests/nobody.py: the venv may sit where `nobody` cannot read): the real start path."""
    import subprocess
    import time

    argv = [sys.executable, "-c", TRAINER, str(ROOT)]
    if user == "nobody":
        if reason := nobody.unavailable():
            pytest.skip(reason)
        argv = nobody.command(argv, [str(ROOT)])
    trainer = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids += host_pids(trainer.pid, [int(trainer.stdout.readline()) for _ in range(3)])  # server, 2 daemons
        assert all(alive(p) for p in pids)
        assert {uid(p) for p in pids} == {nobody.NOBODY if user == "nobody" else os.getuid()}
        time.sleep(0.5)  # the `wait` call is under way
    finally:
        left = after_sigkill(trainer, pids)
    assert left == []


def test_a_selection_of_a_tool_the_server_lacks_names_what_it_has():
    with pytest.raises(ConfigError, match=r"^tools\.mcp\[0\]\.tools: 'mul': not a tool of the server .*; it has: "
                                          r"add, fail, wait, big, shout, pid, daemon$"):
        open_servers([server(tools=["add", "mul"])])


def test_bad_entries_stop_at_start_up_in_one_line(run_cli):
    code, lines = run_cli("tools.mcp=[{command:['/nonexistent/mcp-server']}]")
    assert code == 2 and lines[-1].startswith("config error: tools.mcp[0]: the server '/nonexistent/mcp-server' "
                                              "could not be used: FileNotFoundError")
    code, lines = run_cli(f"tools.mcp=[{{command:['{sys.executable}',-c,'raise SystemExit(\"no such server\")']}}]")
    assert code == 2 and "tools.mcp[0]" in lines[-1] and lines[-1].endswith("its stderr ends: no such server")
    port = free_port()  # nothing listens there
    code, lines = run_cli(f"tools.mcp=[{{url:'http://127.0.0.1:{port}/mcp'}}]")
    assert code == 2 and lines[-1].startswith(f"config error: tools.mcp[0]: the server at http://127.0.0.1:{port}/mcp "
                                              f"could not be used: ")
    code, lines = run_cli("tools.mcp=[{tools:[add]}]")
    assert code == 2 and "tools.mcp[0]: give exactly one of command" in lines[-1]
    code, lines = run_cli("tools.mcp=[{url:'ftp://x'}]")
    assert code == 2 and "tools.mcp[0].url" in lines[-1]
    code, lines = run_cli("tools.mcp=[{cmd:[x]}]")
    assert code == 2 and lines[-1].endswith("tools.mcp[i].cmd: unknown key; allowed: command, url, tools, env, "
                                            "start_timeout_s, max_schema_chars, max_message_bytes")
    for key in ("max_schema_chars", "max_message_bytes"):
        code, lines = run_cli(f"tools.mcp=[{{command:[x],{key}:0}}]")
        assert code == 2 and f"tools.mcp[0].{key}" in lines[-1]


def test_a_tool_schema_past_max_schema_chars_stops_at_start_up_in_one_line():
    """A server once described a tool in 4 MB: 524k tokens in every prompt (issue 44)."""
    with pytest.raises(ConfigError, match=r"^tools\.mcp\[0\]\.max_schema_chars: the server .* lists 'add' with a "
                                          r"schema of \d+ characters .*, more than 50; every prompt would show it: "
                                          r"leave it out with tools\.mcp\[0\]\.tools=\[\.\.\.\] or raise the limit$"):
        open_servers([server(tools=["add"], max_schema_chars=50)])


# A server without the SDK, whose `echo` answers text with the JSON escape \ud800 (a lone surrogate)
RAW_SERVER = r"""
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    method, params = msg.get("method"), msg.get("params") or {}
    if method == "initialize":
        result = {"protocolVersion": params["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "raw", "version": "0"}}
    elif method == "tools/list":
        schema = {"type": "object", "properties": {}}
        result = {"tools": [{"name": n, "description": n, "inputSchema": schema} for n in ("echo", "ok")]}
    elif method == "tools/call":
        text = "a\\ud800b" if params["name"] == "echo" else "fine"
        sys.stdout.write('{"jsonrpc": "2.0", "id": %d, "result": {"content": [{"type": "text", "text": "%s"}]}}\n'
                         % (msg["id"], text))
        sys.stdout.flush()
        continue
    else:
        continue
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}) + "\n")
    sys.stdout.flush()
"""


def test_a_servers_answer_holding_a_lone_surrogate_is_an_error_and_the_session_goes_on():
    """The SDK refuses the message (its JSON parser takes no lone surrogate): the call ends as a
    timeout, never a lone surrogate in the model's tokens, and the next call is answered."""
    opened = open_servers([McpServerConfig(command=[sys.executable, "-c", RAW_SERVER])])
    try:
        [tools] = opened.tools
        refused, answered = (execute_calls([ToolCall(name, {})], tools, 0.5, 1000, 8)[0] for name in ("echo", "ok"))
        assert (refused.error, answered.text) == ("timeout", "fine")
    finally:
        opened.close()


def test_an_answer_past_max_message_bytes_fails_the_call_at_once_and_the_session_goes_on():
    """The SDK's client copies a line's whole text for each chunk it gets: a 20 MB answer took it 28 s
    and 265 MB, in the thread that serves every call. A relay drops such a line as it streams and answers
    the call with an error naming the size."""
    opened = open_servers([server(max_message_bytes=100_000)])
    [tools] = opened.tools
    try:
        big, small, add = call({t.name: t for t in tools}, ToolCall("big", {"size": 300_000}),
                               ToolCall("big", {"size": 1_000}), ToolCall("add", {"a": 1, "b": 2}))
    finally:
        opened.close()
    # (the text twice: as content and as structured content)
    assert (big.error, big.text) == ("raised", "error: 'big' raised MCPError: the server's answer was 600,123 bytes, "
                                               "past max_message_bytes (100,000)")
    assert (small.error, small.text, add.error, add.text) == (None, "x" * 1000, None, "3")


def test_the_file_that_keeps_a_servers_stderr_stays_bounded_over_the_run(opened):
    """The trainer keeps a server's stderr in a temporary file for the whole run (its last line explains a
    failed start); a server that logs every call (MCPServer's default) or a tool's arguments grew it
    without end. The relay empties it past STDERR_BYTES, keeping the last TAIL bytes."""
    from magrpo.mcp_relay import STDERR_BYTES

    [said] = call(opened, ToolCall("pid", {}))
    [pid] = host_pids(os.getpid(), [int(said.text)])
    relay = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the server's parent
    for _ in range(3):
        [r] = call(opened, ToolCall("shout", {"size": STDERR_BYTES // 2}))
        assert (r.error, r.text) == (None, "done")
    kept = os.stat(f"/proc/{relay}/fd/2")  # the trainer's file, as the relay writes it
    assert kept.st_size <= STDERR_BYTES and kept.st_blocks * 512 <= STDERR_BYTES + (1 << 16)


def test_the_relay_drops_a_long_line_that_answers_nothing_and_passes_the_rest():
    from magrpo.mcp_relay import Lines

    notice = b'{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"' + b"y" * 5000 + b'"}}\n'
    theirs, sink = os.pipe()
    bad_id = b'{"jsonrpc":"2.0","id":"\\u12","result":"' + b"w" * 2000 + b'"}\n'  # an escape that does not parse
    Lines(sink, 1000).add(notice + b'{"jsonrpc":"2.0","id":7,"result":{}}\n' + bad_id + b"z" * 3000 + b"\n" + b"tail")
    os.close(sink)
    with os.fdopen(theirs, "rb") as f:
        assert f.read() == b'{"jsonrpc":"2.0","id":7,"result":{}}\n'  # no answer for lines without an id


def test_a_server_that_never_answers_times_out(monkeypatch):
    silent = McpServerConfig(command=[sys.executable, "-c", "import sys; sys.stdin.read()"], start_timeout_s=0.5)
    with pytest.raises(ConfigError, match=r"tools\.mcp\[0\]: .* did not finish the MCP handshake .* within 0.5 s"):
        open_servers([silent])


def test_a_name_used_twice_across_sources_is_refused(monkeypatch):
    import magrpo.mcp_tools
    from magrpo.toolbox import Toolbox

    twin = Tool("calculator", {"name": "calculator"}, lambda: "")
    closed = []

    class Servers:  # two servers, the second offering a `calculator`
        def __init__(self, entries):
            self.tools = [[], [twin]]

        def close(self):
            closed.append(True)

    monkeypatch.setattr(magrpo.mcp_tools, "McpServers", Servers)
    t = TrainConfig().tools
    t.names, t.mcp = ["calculator"], [server(), server()]
    with pytest.raises(ConfigError, match=r"^tools\.mcp\[1\]: its tool 'calculator' has the name of a tool of "
                                          r"tools\.names; choose"):
        Toolbox.open(t)
    assert closed == [True]  # the sessions it opened end with the refusal


def test_without_servers_the_mcp_module_is_not_imported(monkeypatch):
    from magrpo.toolbox import Toolbox

    monkeypatch.setitem(sys.modules, "magrpo.mcp_tools", None)  # importing it now fails
    t = TrainConfig().tools
    t.names = ["calculator"]
    with Toolbox.open(t) as box:
        assert [tool.name for tool in box.tools] == ["calculator"]


def test_the_command_line_shape_parses(make_cfg):
    cfg = make_cfg("tools.mcp=[{command:[python,-m,tests.mcp_server],tools:[add]},{url:'http://127.0.0.1:9/mcp'}]")
    assert cfg.tools.mcp == [McpServerConfig(command=["python", "-m", "tests.mcp_server"], tools=["add"]),
                             McpServerConfig(url="http://127.0.0.1:9/mcp")]


@pytest.mark.slow
def test_a_training_run_calls_an_mcp_tool_and_ends_its_server(make_cfg, monkeypatch):
    """The tiny model never writes `<tool_call>`: here any text ending in "e" calls the server's `add`,
    so a real run discovers, calls through the session, splices the answer and closes the server."""
    import magrpo.mcp_tools
    import magrpo.tool_loop
    from magrpo.toolbox import Toolbox
    from magrpo.trainer import train

    marker = f"mcp-run-{os.getpid()}"  # an argument the server ignores, to find its process
    cfg = make_cfg(override(server(marker, tools=["add"])), "tools.max_calls=1", "trainer.steps=1",
                   "trainer.num_turns=1", "eval.at_end=false", "generation.max_new_tokens=24")
    opened, real = [], magrpo.mcp_tools.McpServers
    monkeypatch.setattr(magrpo.mcp_tools, "McpServers", lambda servers: opened.append(real(servers)) or opened[-1])
    with Toolbox.open(cfg.tools) as box:
        assert [s["name"] for s in box.schemas] == ["add"]  # the selection: fail and pid are not offered
        assert server_processes(marker)
    assert server_processes(marker) == []  # ended with its box
    monkeypatch.setattr(magrpo.tool_loop, "CALL_END", "e")
    monkeypatch.setattr(magrpo.tool_loop, "parse_call", lambda text: (
        ToolCall("add", {"a": 40, "b": 2}) if text.endswith("e") else None))
    monkeypatch.setattr(magrpo.lifeline, "holds_tree", lambda: False)  # as for a user without a PID namespace
    run = train(cfg)
    assert json.loads((run / "config.json").read_text())["warnings"] == [magrpo.lifeline.NO_TREE_WARNING]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(m["tools/calls"] > 0 for m in metrics) and not any("tools/errors/raised" in m for m in metrics)
    assert "<tool_response>\\n42\\n</tool_response>" in (run / "rollouts.jsonl").read_text()
    assert len(opened) == 2 and server_processes(marker) == []  # the run's own box: opened once, closed


def test_a_server_whose_supervisor_cannot_hold_its_tree_is_said_at_start_up(monkeypatch):
    """Unprivileged, no PID namespace: what a server's supervisor does not hold is a start-up warning (the
    trainer prints it and keeps it in config.json); where one is made (root here), nothing is said."""
    import subprocess

    import magrpo.lifeline
    from magrpo.config import ToolsConfig
    from magrpo.toolbox import Toolbox

    unshare = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0
    assert magrpo.lifeline.holds_tree() == unshare  # asked of a child, as util-linux's unshare asks
    for holds, said in ((False, (magrpo.lifeline.NO_TREE_WARNING,)), (True, ())):
        monkeypatch.setattr(magrpo.lifeline, "holds_tree", lambda holds=holds: holds)
        with Toolbox.open(ToolsConfig(mcp=[server()])) as box:
            assert box.warnings == said
    with Toolbox.open(ToolsConfig()) as box:  # no server: no probe, nothing said
        assert box.warnings == ()


def test_the_docs_server_example_runs_under_command_python(tmp_path):
    """docs/tools.md's server, saved as my_pkg/server.py and started as `command: [python, -m, my_pkg.server]`:
    `python` is the trainer's own interpreter, whose packages (the SDK) the server needs; on the SDK's
    minimal PATH it was another Python (here one without `mcp`), and the server failed to start."""
    import re

    doc = (ROOT / "docs" / "tools.md").read_text()
    [example] = [block for block in re.findall(r"```python\n(.*?)```", doc, re.DOTALL) if "MCPServer(" in block]
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "server.py").write_text(example)
    opened = open_servers([McpServerConfig(command=["python", "-m", "my_pkg.server"],
                                           env={"PYTHONPATH": str(tmp_path)})])
    try:
        [tools] = opened.tools
        [result] = execute_calls([ToolCall("add", {"a": 2, "b": 40})], tools, 10.0, 1000, 1)
    finally:
        opened.close()
    assert [t.name for t in tools] == ["add"] and result.text == "42" and result.error is None
