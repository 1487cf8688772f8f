"""The tree viewer (magrpo/viz.py) on real run directories of the toy env, on hand-made records, and
in a headless Chromium (skipped where it is not installed)."""
from __future__ import annotations

import itertools
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from magrpo.viz import load_tree, render_tree_html, render_tree_png, tool_calls_in

ROOT = Path(__file__).resolve().parent.parent
TRAIN = [
    "env=length_ratio", "model=tiny", "external=length_ratio", "logging.progress=false", "trainer.steps=2",
    "trainer.batch_size=2", "trainer.num_generations=2", "generation.max_new_tokens=6", "eval.at_end=false",
    "trainer.num_turns=2", "logging.wandb.mode=disabled",  # no wandb service to start: the viewer reads only files
]
CONSOLE = re.compile(r"CONSOLE[:(]\d+")  # Chromium's log lines for page console messages


def train_run(run: Path, *overrides: str) -> Path:
    done = subprocess.run([sys.executable, "train.py", *TRAIN, *overrides, f"logging.run_dir={run}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def align_run(tmp_path_factory) -> Path:
    """2 steps x 2 trees, align, K=2, T=2: 3 nodes per tree, no early termination."""
    return train_run(tmp_path_factory.mktemp("viz") / "align")


@pytest.fixture(scope="module")
def cross_run(tmp_path_factory) -> Path:
    """cross with threshold 0: every reward meets it, so every turn-0 joint action is terminated."""
    return train_run(tmp_path_factory.mktemp("viz") / "cross", "trainer.joint_mode=cross",
                     "trainer.early_termination_threshold=0.0")


def viz(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "magrpo.viz", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]


class Elements(HTMLParser):
    """Every start tag's attributes, so tests count real elements rather than substrings."""

    def __init__(self, page: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def with_class(self, cls: str) -> list[dict]:
        return [attrs for _, attrs in self.tags if cls in (attrs.get("class") or "").split()]


def assert_page_matches(page: str, record: dict) -> None:
    found = Elements(page)
    nodes = [attrs for _, attrs in found.tags if attrs.get("class") == "node"]
    joints = [attrs for _, attrs in found.tags if attrs.get("class") == "joint"]
    all_joints = [ja for node in record["nodes"] for ja in node["joint_actions"]]
    assert sorted(int(n["data-node-id"]) for n in nodes) == [node["id"] for node in record["nodes"]]
    assert len(joints) == len(all_joints)
    assert [j["data-terminated"] for j in joints] == [str(ja["terminated"]).lower() for ja in all_joints]
    assert len(found.with_class("terminated")) == sum(ja["terminated"] for ja in all_joints)
    links = {attrs.get("href") for tag, attrs in found.tags if tag == "a"}
    assert {f"#n{ja['child']}" for ja in all_joints if ja["child"] is not None} <= links


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def assert_png_drawn(path: Path) -> None:
    import matplotlib.image

    width, height = png_size(path)
    assert width >= 600 and height >= 200
    pixels = matplotlib.image.imread(path)
    assert (pixels[..., :3].min(axis=-1) < 0.3).mean() > 0.002, "next to nothing drawn"


def hand_record() -> dict:
    """3 nodes, 2 agents, K=2 (align): root joint 0 continues, joint 1 is terminated; node 1's two
    joint actions are final-turn leaves; node 2 is a second child. Texts carry HTML to escape."""
    evil = "<script>alert(1)</script>"

    def node(nid, turn, parent, joints):
        return {"id": nid, "turn": turn, "parent": parent,
                "prompts": [f"</pre><script>alert(3)</script> agent {a}" for a in range(2)],
                "completions": [[evil, 'a & b "q" \'s\''], ["x" * 500, ""]],
                "advantages": [[0.5, -0.5], [0.0, 1.25]],
                "joint_actions": [{"agents": [j, j], "reward": r, "return": g, "terminated": t, "child": c}
                                  for j, (r, g, t, c) in enumerate(joints)]}

    return {"step": 7, "tree": 1, "problem": {"prompt": "<img src=x onerror=alert(2)>", "id": "p<1>"},
            "nodes": [node(0, 0, None, [(0.5, 1.0, False, 1), (1.0, 1.0, True, None)]),
                      node(1, 1, [0, 0], [(0.5, 0.5, False, None), (0.25, 0.25, False, None)])]}


TOOL_TURN = ('I will compute it. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
             "\n<tool_response>\n42 </pre><script>alert(4)</script>\n</tool_response>\nThe answer is 42.")


def tool_record() -> dict:
    """hand_record with a turn that called a tool (its output carries HTML to escape), its call recorded
    as rollouts.jsonl does; and a call that failed, recorded though its text shows no call."""
    record = hand_record()
    record["nodes"][0]["completions"][0][1] = TOOL_TURN
    record["nodes"][0]["tool_calls"] = [
        [[], [{"name": "calculator", "arguments": {"expression": "6*7"}, "output": "42 </pre><script>alert(4)</script>",
               "error": None}]],
        [[{"name": None, "arguments": None, "output": "error: the call is not valid JSON", "error": "bad_json"}], []]]
    return record


def synthetic(k: int, n: int, t: int) -> dict:
    """A full cross tree: K^N joint actions per node, 1 + K^N + K^2N + ... nodes."""
    joints = [list(p) for p in itertools.product(range(k), repeat=n)]
    nodes: list[dict] = []

    def add(turn, parent):
        nid = len(nodes)
        nodes.append({"id": nid, "turn": turn, "parent": parent, "prompts": ["p"] * n,
                      "completions": [[f"a{a}k{i}" for i in range(k)] for a in range(n)],
                      "advantages": [[0.0] * k for _ in range(n)],
                      "joint_actions": [{"agents": ag, "reward": (nid + j) % 7 / 7, "return": 0.0,
                                         "terminated": False, "child": None} for j, ag in enumerate(joints)]})
        if turn < t - 1:
            for j in range(len(joints)):
                nodes[nid]["joint_actions"][j]["child"] = add(turn + 1, [nid, j])
        return nid

    add(0, None)
    return {"step": 1, "tree": 0, "problem": {"prompt": "P"}, "nodes": nodes}


# ------------------------------------------------------------------------------------ CLI on real runs


@pytest.mark.slow
@pytest.mark.parametrize("run_name", ["align_run", "cross_run"])
def test_cli_writes_html_and_png_of_the_last_step(request, run_name):
    run = request.getfixturevalue(run_name)
    done = viz("tree", run)
    assert done.returncode == 0, done.stderr
    html_path, png_path = run / "viz" / "tree_step2_tree0.html", run / "viz" / "tree_step2_tree0.png"
    assert done.stdout.split() == [str(html_path), str(png_path)]
    record = next(r for r in records(run) if (r["step"], r["tree"]) == (2, 0))
    if run_name == "cross_run":  # the setting must really have stopped branches, or nothing is tested
        assert len(record["nodes"]) == 1 and all(ja["terminated"] for ja in record["nodes"][0]["joint_actions"])
    else:
        assert len(record["nodes"]) == 3
    page = html_path.read_text()
    assert_page_matches(page, record)
    assert "http://" not in page and "https://" not in page and "<link" not in page  # self-contained
    assert_png_drawn(png_path)


@pytest.mark.slow
def test_step_tree_and_out_options(align_run, tmp_path):
    out = tmp_path / "pages" / "page.html"
    done = viz("tree", align_run, "--step", 1, "--tree", 1, "--out", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(out), str(out.with_suffix(".png"))]
    record = next(r for r in records(align_run) if (r["step"], r["tree"]) == (1, 1))
    assert load_tree(align_run, 1, 1) == record
    page = out.read_text()
    assert "step 1 · tree 1" in page
    assert_page_matches(page, record)
    assert_png_drawn(out.with_suffix(".png"))


@pytest.mark.slow
def test_load_tree_defaults_to_the_last_step_and_tree_0(align_run):
    last = records(align_run)[-2]  # a step's trees are written in tree order: 0, then 1
    assert (last["step"], last["tree"]) == (2, 0)
    assert load_tree(align_run, None, 0) == last


def test_load_tree_skips_the_half_written_last_line_of_a_live_run(tmp_path):
    first, second = hand_record(), {**hand_record(), "step": 8}
    text = json.dumps(first) + "\n" + json.dumps(second) + "\n"
    (tmp_path / "rollouts.jsonl").write_text(text + json.dumps({**first, "step": 9})[:50])
    assert load_tree(tmp_path, None, 1) == second


# ------------------------------------------------------------------------------------ hand-made records


def test_html_escapes_every_text():
    page = render_tree_html(hand_record())
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>alert" not in page and "<img" not in page and "</pre><script>" not in page
    assert page.count("<script") == 1  # the page's own script, nothing from the record
    assert "a &amp; b &quot;q&quot; &#x27;s&#x27;" in page


def test_html_shows_tool_calls_and_outputs_inline_and_escaped():
    page = render_tree_html(tool_record())
    dom = Elements(page)
    calls = dom.with_class("tool-call")
    assert len(calls) == 1 and len(dom.with_class("tool-output")) == 1 + 2  # inline, and each recorded call's
    assert page.count("1 tool call</span>") == 2  # counted from the records: the failed call too
    assert len(dom.with_class("call")) == 2 and "bad_json</span>" in page
    assert "calculator({&quot;expression&quot;: &quot;6*7&quot;})" in page
    assert "&lt;tool_call&gt;{&quot;name&quot;: &quot;calculator&quot;" in page
    assert "42 &lt;/pre&gt;&lt;script&gt;alert(4)" in page and page.count("<script") == 1
    assert render_tree_html(hand_record()).count("tool-call") == 1  # no tool, no span (the CSS rule alone)


def test_html_marks_terminated_leaf_and_continuing_joint_actions():
    record = hand_record()
    page = render_tree_html(record)
    assert_page_matches(page, record)
    found = Elements(page)
    assert len(found.with_class("terminated")) == 1 and len(found.with_class("leaf")) == 2
    joint0 = page.index('id="n0-j0"')
    assert '<a href="#n1">' in page[joint0: page.index("</tr>", joint0)]
    # the 500-character completion starts collapsed, the short ones do not
    assert re.search(r"<details><summary>x{80}… \(500 chars\)</summary><pre>x{500}</pre></details>", page)
    assert "<details><summary>&lt;script" not in page


def test_html_header_shows_the_tree_shape():
    page = render_tree_html(hand_record())
    shape = dict(re.findall(r"<dt>([^<]+)</dt><dd>([^<]+)</dd>", page))
    assert shape == {"step": "7", "tree": "1", "nodes": "2", "agents": "2", "K": "2", "turns": "2",
                     "joint actions": "4", "terminated": "1"}


def test_png_of_a_hand_record(tmp_path):
    path = render_tree_png(hand_record(), tmp_path / "sub" / "tree.png")
    assert path == tmp_path / "sub" / "tree.png"
    assert_png_drawn(path)


def test_png_of_a_deep_cross_tree_stays_bounded(tmp_path):
    # K=4, N=3, T=3 cross: 64 joint actions per node, 1 + 64 + 4096 nodes: the deepest turn is left
    # out and the 64-edge fans go unlabelled, so the picture stays a readable size.
    record = synthetic(4, 3, 3)
    assert len(record["nodes"]) == 4161
    width, height = png_size(render_tree_png(record, tmp_path / "big.png"))
    assert width <= 1200 and height <= 7000


# ------------------------------------------------------------------------------------ one-line errors


def test_missing_run_dir_and_missing_rollouts_are_one_line_errors(tmp_path):
    for run, message in [(tmp_path / "nope", "does not exist"), (tmp_path, "no rollouts.jsonl in")]:
        done = viz("tree", run)
        assert done.returncode == 2 and done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


@pytest.mark.slow
def test_unknown_step_or_tree_lists_what_exists(align_run):
    for args, message in [(["--step", "9"], "step 9 is not in"),
                          (["--step", "2", "--tree", "5"], "tree 5 is not at step 2")]:
        done = viz("tree", align_run, *args)
        assert done.returncode == 2 and done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
    assert "steps: 1, 2" in viz("tree", align_run, "--step", "9").stderr
    assert "trees: 0, 1" in viz("tree", align_run, "--tree", "5").stderr


# ------------------------------------------------------------------------------------ headless Chromium


@pytest.fixture
def chromium(tmp_path):
    """Runs `chromium --headless=new` on a file with a fresh profile; returns the finished process."""
    if shutil.which("chromium") is None:
        pytest.skip("chromium not installed: apt-get install chromium")

    def run(page: Path, *args: str) -> subprocess.CompletedProcess:
        profile = tempfile.mkdtemp(dir=tmp_path, prefix="chromium-profile-")
        done = subprocess.run(
            ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
             f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    return run


def console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if CONSOLE.search(line)]


@pytest.mark.slow
def test_chromium_console_check_detects_a_thrown_error(chromium, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text(render_tree_html(hand_record()).replace("</body>", '<script>throw new Error("x")</script></body>'))
    done = chromium(page, "--virtual-time-budget=2000", "--dump-dom")
    assert any("Uncaught Error: x" in line for line in console_messages(done.stderr)), done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hand", "cross", "tools"])
def test_page_renders_in_chromium_without_console_errors(chromium, tmp_path, source):
    record = {"hand": hand_record, "tools": tool_record}.get(source, lambda: synthetic(2, 2, 2))()
    page = tmp_path / "tree.html"
    page.write_text(render_tree_html(record))
    done = chromium(page, "--virtual-time-budget=2000", "--dump-dom")
    assert console_messages(done.stderr) == []
    dom = Elements(done.stdout)
    assert len([a for _, a in dom.tags if a.get("class") == "node"]) == len(record["nodes"])
    body = next(attrs for tag, attrs in dom.tags if tag == "body")
    assert body.get("data-rendered-nodes") == str(len(record["nodes"]))  # the page's script ran to the end
    calls = sum(tool_calls_in(t) for n in record["nodes"] for agent in n["completions"] for t in agent)
    assert len(dom.with_class("tool-call")) == calls  # the browser's DOM holds every call, inline
    recorded = sum(len(c) for n in record["nodes"] for agent in n.get("tool_calls", []) for c in agent)
    assert len(dom.with_class("call")) == recorded  # and every recorded call, listed


@pytest.mark.slow
def test_chromium_screenshot_of_a_run_page(chromium, align_run, tmp_path):
    page = tmp_path / "tree.html"
    assert viz("tree", align_run, "--out", page).returncode == 0
    shot = tmp_path / "shot.png"
    done = chromium(page, "--hide-scrollbars", "--window-size=1400,1000", f"--screenshot={shot}")
    assert console_messages(done.stderr) == []
    assert png_size(shot) == (1400, 1000)
    assert shot.stat().st_size > 20_000  # a blank page of this size is a few KB
