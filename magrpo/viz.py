"""Rollout-tree viewer: one tree of a run's rollouts.jsonl as a self-contained HTML page and a PNG.

    python -m magrpo.viz tree RUN_DIR [--step S] [--tree I] [--out PATH]

The HTML shows everything the record holds (every completion, advantage, joint action) and needs
no network, so it can be attached to a bug report or opened from a remote machine's run dir. The
PNG is the overview: boxes per node by turn, one edge per joint action labelled with its reward.
"""
from __future__ import annotations

import argparse
import functools
import html
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Sequence

AGENT_HUES = (210, 30, 280, 160, 340, 60)  # one hue per agent (cycled): stripe and name colour
COLLAPSE_CHARS = 240  # longer completions/prompts start collapsed in a <details>
COLLAPSE_LINES = 6

# PNG geometry, in inches (the axes use inches as data units, so text sizes stay fixed).
ROW_IN = 0.22  # one labelled edge
BOX_ROWS = 2.6  # a node box's height in rows
FAN_ROWS = 3.0  # height of the unlabelled fan of a node with many joint actions
COL_IN = 3.3  # one turn: box, edge bus and edge labels
BOX_W_IN = 1.25
STUB_IN = 1.5  # length of an edge that ends without a drawn child
LABEL_MAX = 8  # a node with more joint actions draws its edges without labels (cross: K^N of them)
MAX_DRAWN_NODES = 100  # deeper turns are left out of the PNG once the tree is bigger than this
MAX_HEIGHT_IN = 120.0  # stay far below Agg's pixel limit whatever the tree


# ------------------------------------------------------------------------------------------ loading


def load_tree(run_dir: Path, step: int | None = None, tree: int = 0) -> dict:
    """The record of `tree` at `step` (None: the last step) from RUN_DIR/rollouts.jsonl.

    Raises FileNotFoundError or LookupError with a one-line message naming what is available.
    """
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    path = Path(run_dir) / "rollouts.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no rollouts.jsonl in {run_dir} "
                                "(not a run directory, no step finished yet, or logging.rollouts=false)")
    trees: dict[int, dict[int, int]] = {}  # step -> tree -> line number
    lines = path.read_text(encoding="utf-8").split("\n")
    # A run still in progress may have a half-written last line: the writer ends every record with
    # a newline, so the piece after the last one is not a record yet.
    for number, line in enumerate(lines[:-1], start=1):
        if line.strip():
            head = _parse(line, path, number)
            trees.setdefault(int(head["step"]), {})[int(head["tree"])] = number
    if not trees:
        raise LookupError(f"{path} holds no trees yet")
    if step is None:
        step = max(trees)
    if step not in trees:
        raise LookupError(f"step {step} is not in {path}; steps: {_listing(trees)}")
    if tree not in trees[step]:
        raise LookupError(f"tree {tree} is not at step {step} in {path}; trees: {_listing(trees[step])}")
    return _parse(lines[trees[step][tree] - 1], path, trees[step][tree])


def _parse(line: str, path: Path, number: int) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise LookupError(f"{path} line {number} is not JSON ({err.msg})") from None


def _listing(keys: Any) -> str:
    return ", ".join(str(k) for k in sorted(keys))


# ------------------------------------------------------------------------------------------ summary


def _shape(record: dict) -> dict[str, int]:
    nodes = record["nodes"]
    joints = [ja for node in nodes for ja in node["joint_actions"]]
    root = nodes[0] if nodes else {"completions": []}
    return {
        "nodes": len(nodes),
        "agents": len(root["completions"]),
        "K": len(root["completions"][0]) if root["completions"] else 0,
        "turns": 1 + max((node["turn"] for node in nodes), default=-1),
        "joint actions": len(joints),
        "terminated": sum(bool(ja["terminated"]) for ja in joints),
    }


def _mean_reward(node: dict) -> float:
    rewards = [ja["reward"] for ja in node["joint_actions"]]
    return sum(rewards) / len(rewards) if rewards else math.nan


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "nan" if x is None or not math.isfinite(x) else format(x, spec)


# ------------------------------------------------------------------------------------------ HTML

CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 6px; }
dl.shape { display: flex; flex-wrap: wrap; gap: 4px 18px; margin: 0 0 10px; }
dl.shape div { display: flex; gap: 4px; } dt { font-weight: 600; } dd { margin: 0; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font: 12px/1.35 ui-monospace, monospace; }
.problem > pre { background: #f4f4f4; padding: 8px; border-radius: 4px; }
.legend { color: #555; margin: 8px 0 12px; }
.swatch { display: inline-block; width: 44px; height: 10px; vertical-align: middle;
          background: linear-gradient(90deg, hsl(0 70% 62%), #fff, hsl(130 60% 62%)); }
.turns { display: flex; gap: 16px; align-items: flex-start; overflow-x: auto; }
.turn { flex: 0 0 460px; }
.turn > h2 { font-size: 15px; margin: 4px 0 8px; }
.node { border: 1px solid #bbb; border-radius: 6px; padding: 8px; margin-bottom: 12px; background: #fff; }
.node:target, .node.lit { outline: 3px solid #f5a623; }
.node h3 { font-size: 14px; margin: 0 0 4px; } .meta { color: #666; font-weight: normal; }
.agent { border-left: 5px solid hsl(var(--hue) 60% 45%); padding-left: 6px; margin: 8px 0; }
.agent-name { color: hsl(var(--hue) 60% 32%); font-weight: 600; }
.completion { border-radius: 4px; padding: 2px 6px; margin: 3px 0; border: 1px solid #0001; }
.completion.lit { outline: 2px solid #222; }
.cmeta { font-size: 11px; color: #444; } .empty { color: #999; font-style: italic; }
summary { cursor: pointer; color: #555; }
table.joints { border-collapse: collapse; width: 100%; margin-top: 6px; font-size: 12px; }
.joints th, .joints td { border-top: 1px solid #ddd; padding: 2px 4px; text-align: left; }
.joint { cursor: pointer; } .joint:hover { background: #f2f2f2; }
.joint[data-terminated="true"] { background: #fdecea; }
.badge { border-radius: 3px; padding: 0 5px; font-size: 11px; white-space: nowrap; }
.badge.terminated { background: #d62728; color: #fff; } .badge.leaf { background: #ddd; }
.badge.tools { background: #1f77b4; color: #fff; }
.tool-call { background: #dbe9f7; border-radius: 3px; } .tool-output { background: #fff3cd; border-radius: 3px; }
"""

# Clicking a joint action outlines what its links point to (the completions it combines and its
# child node); the body's data-rendered-nodes tells a headless browser that the script ran to the end.
JS = """
for (const row of document.querySelectorAll('.joint')) {
  row.addEventListener('click', () => {
    for (const el of document.querySelectorAll('.lit')) el.classList.remove('lit');
    for (const link of row.querySelectorAll('a')) document.getElementById(link.hash.slice(1))?.classList.add('lit');
  });
}
document.body.dataset.renderedNodes = document.querySelectorAll('.node').length;
"""


def render_tree_html(record: dict) -> str:
    """A self-contained page (inline CSS and JS, no network) showing one rollout tree."""
    shape = _shape(record)
    nodes = record["nodes"]
    # Advantages are compared within an agent, so each agent's colours span its own largest |A|.
    scale = [
        max((abs(a) for node in nodes for a in node["advantages"][agent] if math.isfinite(a)), default=0.0)
        for agent in range(shape["agents"])
    ]
    by_turn: dict[int, list[dict]] = {}
    for node in nodes:
        by_turn.setdefault(node["turn"], []).append(node)
    columns = "".join(
        f'<div class="turn"><h2>turn {turn} <span class="meta">({len(column)} node{"s" * (len(column) != 1)})'
        f'</span></h2>{"".join(_node_html(node, scale) for node in column)}</div>'
        for turn, column in sorted(by_turn.items())
    )
    problem = dict(record.get("problem") or {})
    prompt = str(problem.pop("prompt", ""))
    fields = "".join(
        f"<tr><th>{html.escape(str(key))}</th><td>{_text_html(value if isinstance(value, str) else json.dumps(value))}"
        f"</td></tr>"
        for key, value in problem.items()
    )
    title = html.escape(f"step {record['step']} · tree {record['tree']}")
    shape_html = "".join(f"<div><dt>{k}</dt><dd>{html.escape(str(v))}</dd></div>" for k, v in
                         {"step": record["step"], "tree": record["tree"], **shape}.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>magrpo tree · {title}</title>
<style>{CSS}</style></head>
<body>
<header>
<h1>magrpo rollout tree · {title}</h1>
<dl class="shape">{shape_html}</dl>
<section class="problem"><h2>problem</h2><pre>{html.escape(prompt)}</pre>
{f'<details><summary>other fields</summary><table>{fields}</table></details>' if fields else ''}</section>
<p class="legend">completion background: advantage within its agent's scale
(<span class="swatch"></span> most negative → 0 → most positive); click a joint action to outline
the completions it combines and its child node.</p>
</header>
<main class="turns">{columns}</main>
<script>{JS}</script>
</body></html>
"""


def _node_html(node: dict, scale: list[float]) -> str:
    nid = node["id"]
    origin = ""
    if node["parent"] is not None:
        parent, joint = node["parent"]
        origin = f' · from <a href="#n{parent}-j{joint}">node {parent}, joint {joint}</a>'
    agents = "".join(
        f'<div class="agent" style="--hue: {AGENT_HUES[agent % len(AGENT_HUES)]}">'
        f'<div class="agent-name">agent {agent}</div>'
        f'<details><summary>prompt</summary>{_text_html(node["prompts"][agent], collapse=False)}</details>'
        + "".join(
            f'<div class="completion" id="n{nid}-a{agent}-k{k}" style="background: {_adv_colour(adv, scale[agent])}">'
            f'<div class="cmeta">k{k} · advantage {_fmt(adv, "+.3f")}{_calls_note(calls)}</div>{_text_html(text)}'
            f"{_calls_html(calls)}</div>"
            for k, (text, adv, calls) in enumerate(zip(node["completions"][agent], node["advantages"][agent],
                                                       _recorded_calls(node, agent)))
        )
        + "</div>"
        for agent in range(len(node["completions"]))
    )
    rows = "".join(_joint_html(nid, j, ja) for j, ja in enumerate(node["joint_actions"]))
    return (
        f'<section class="node" id="n{nid}" data-node-id="{nid}" data-turn="{node["turn"]}">'
        f'<h3>node {nid} <span class="meta">turn {node["turn"]}{origin}</span></h3>{agents}'
        f'<table class="joints"><tr><th>joint</th><th>completions</th><th>reward</th><th>return</th>'
        f"<th>next</th></tr>{rows}</table></section>"
    )


def _recorded_calls(node: dict, agent: int) -> list[list[dict]]:
    """Each of the agent's completions' tool calls, as rollouts.jsonl records them ([] without any)."""
    recorded = node.get("tool_calls")
    return recorded[agent] if recorded else [[] for _ in node["completions"][agent]]


def _calls_note(calls: list[dict]) -> str:
    n = len(calls)
    return f' · <span class="badge tools">{n} tool call{"s" if n != 1 else ""}</span>' if n else ""


def _calls_html(calls: list[dict]) -> str:
    """The completion's calls from the record: name and arguments, then the error kind or the output."""
    if not calls:
        return ""
    rows = []
    for call in calls:
        head = f'{html.escape(str(call["name"]))}({html.escape(json.dumps(call["arguments"], ensure_ascii=False))})'
        error = f'<span class="badge terminated">{html.escape(call["error"])}</span> ' if call["error"] else ""
        rows.append(f'<li class="call" data-error="{html.escape(call["error"] or "")}"><code>{head}</code> → '
                    f'{error}<span class="tool-output">{html.escape(str(call["output"]))}</span></li>')
    return f'<details class="calls"><summary>tool calls</summary><ol>{"".join(rows)}</ol></details>'


def _joint_html(nid: int, j: int, ja: dict) -> str:
    links = " ".join(f'<a href="#n{nid}-a{agent}-k{k}">a{agent}:k{k}</a>' for agent, k in enumerate(ja["agents"]))
    if ja["child"] is not None:
        nxt = f'<a href="#n{ja["child"]}">node {ja["child"]} →</a>'
    elif ja["terminated"]:
        nxt = '<span class="badge terminated">terminated</span>'
    else:
        nxt = '<span class="badge leaf">leaf</span>'
    return (
        f'<tr class="joint" id="n{nid}-j{j}" data-terminated="{str(bool(ja["terminated"])).lower()}">'
        f'<td>{j}</td><td>{links}</td><td>{_fmt(ja["reward"])}</td><td>{_fmt(ja["return"])}</td><td>{nxt}</td></tr>'
    )


# A turn with tools holds its calls and their results inline (docs/tools.md): each gets a colour of its own.
TOOL_SPANS = re.compile(r"(<tool_call>.*?</tool_call>|<tool_response>.*?</tool_response>)", re.DOTALL)


def _marked_up(text: str) -> str:
    """The text escaped, with tool calls and tool results wrapped in spans."""
    out = []
    for i, part in enumerate(TOOL_SPANS.split(text)):
        if i % 2 == 0:
            out.append(html.escape(part))
        else:
            kind = "tool-call" if part.startswith("<tool_call>") else "tool-output"
            out.append(f'<span class="{kind}">{html.escape(part)}</span>')
    return "".join(out)


def tool_calls_in(text: str) -> int:
    return sum(1 for part in TOOL_SPANS.findall(text) if part.startswith("<tool_call>"))


def _text_html(text: str, collapse: bool = True) -> str:
    if not text:
        return '<pre class="empty">(empty)</pre>'
    body = f"<pre>{_marked_up(text)}</pre>"
    if collapse and (len(text) > COLLAPSE_CHARS or text.count("\n") > COLLAPSE_LINES):
        preview = " ".join(text.split())[:80]
        return f"<details><summary>{html.escape(preview)}… ({len(text)} chars)</summary>{body}</details>"
    return body


def _adv_colour(adv: float, scale: float) -> str:
    """White at 0, towards red (negative) or green (positive) with |adv| / the agent's largest |adv|."""
    x = max(-1.0, min(1.0, adv / scale)) if scale > 0 and math.isfinite(adv) else 0.0
    return f"hsl({130 if x > 0 else 0} {65 if x > 0 else 75}% {100 - 38 * abs(x):.0f}%)"


# ------------------------------------------------------------------------------------------ PNG


def render_tree_png(record: dict, path: Path) -> Path:
    """The tree as boxes per node by turn (colour: mean reward) and one edge per joint action."""
    from matplotlib import colormaps
    from matplotlib.collections import LineCollection
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure  # not pyplot: no global backend state, nothing to close

    nodes = {node["id"]: node for node in record["nodes"]}
    shape = _shape(record)
    per_turn = [sum(node["turn"] == t for node in nodes.values()) for t in range(shape["turns"])]
    # Deep cross trees grow as (K^N)^t: draw whole turns while the picture stays readable.
    drawn_turns = 1
    while drawn_turns < len(per_turn) and sum(per_turn[: drawn_turns + 1]) <= MAX_DRAWN_NODES:
        drawn_turns += 1
    drawn = {nid for nid, node in nodes.items() if node["turn"] < drawn_turns}

    y: dict[int, float] = {}  # node id -> centre row
    edge_y: dict[tuple[int, int], float] = {}  # (node, joint) -> row of a labelled edge's end

    def labelled(node: dict) -> bool:
        return len(node["joint_actions"]) <= LABEL_MAX

    def slots(nid: int) -> float:
        """Rows the node's edges need: a drawn child's whole subtree, or one row per labelled edge."""
        node = nodes[nid]
        return sum(span(ja["child"]) if ja["child"] in drawn else float(labelled(node))
                   for ja in node["joint_actions"])

    @functools.cache
    def span(nid: int) -> float:
        # An unlabelled fan keeps one spare row for its summary line above it.
        return max(BOX_ROWS, slots(nid) if labelled(nodes[nid]) else max(slots(nid), FAN_ROWS + 1))

    def place(nid: int, top: float) -> None:
        node, total, own = nodes[nid], span(nid), slots(nid)
        cursor = top + (total - own) / 2  # centre the slots when the box is taller than they are
        for j, ja in enumerate(node["joint_actions"]):
            if ja["child"] in drawn:
                place(ja["child"], cursor)
                edge_y[nid, j] = y[ja["child"]]
                cursor += span(ja["child"])
            elif labelled(node):
                edge_y[nid, j] = cursor + 0.5
                cursor += 1
        y[nid] = top + total / 2

    roots = [nid for nid, node in nodes.items() if node["parent"] is None]
    top = 0.0
    for root in roots:
        place(root, top)
        top += span(root)
    rows = max(top, BOX_ROWS)
    row_in = min(ROW_IN, MAX_HEIGHT_IN / rows)  # only shrinks for trees far beyond the typical sizes
    header_in = 1.25
    width_in = max(9.0, 0.3 + drawn_turns * COL_IN + 0.2)  # at least the header's width
    height_in = header_in + rows * row_in + 0.3

    fig = Figure(figsize=(width_in, height_in), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width_in)
    ax.set_ylim(height_in, 0)  # rows grow downwards
    ax.axis("off")

    means = [_mean_reward(node) for node in nodes.values() if node["id"] in drawn]
    finite = [m for m in means if math.isfinite(m)] or [0.0]
    lo, hi = min(finite), max(finite)
    norm = Normalize(lo, hi) if hi > lo else Normalize(lo - 1, lo + 1)  # one value: the middle colour
    cmap = colormaps["RdYlGn"]

    def at(nid: int) -> tuple[float, float]:
        return 0.3 + nodes[nid]["turn"] * COL_IN, header_in + y[nid] * row_in

    segments: dict[str, list] = {"continue": [], "terminated": [], "leaf": [], "undrawn": []}
    for nid in sorted(drawn):
        node = nodes[nid]
        x0, yc = at(nid)
        box_h = BOX_ROWS * row_in * 0.8
        mean = _mean_reward(node)
        ax.add_patch(_box(x0, yc - box_h / 2, BOX_W_IN, box_h,
                          cmap(0.15 + 0.7 * norm(mean)) if math.isfinite(mean) else "#ccc"))
        ax.text(x0 + BOX_W_IN / 2, yc, f"node {nid}\nmean r {_fmt(mean, '.2f')}", ha="center", va="center",
                fontsize=7, parse_math=False)
        bus = x0 + BOX_W_IN + 0.25
        joints = node["joint_actions"]
        for j, ja in enumerate(joints):
            kind = ("continue" if ja["child"] in drawn else "terminated" if ja["terminated"]
                    else "leaf" if ja["child"] is None else "undrawn")
            if (nid, j) in edge_y:
                end_y = header_in + edge_y[nid, j] * row_in
            else:  # unlabelled fan: spread the ends over FAN_ROWS around the box centre
                end_y = yc + ((j + 0.5) / len(joints) - 0.5) * FAN_ROWS * row_in
            end_x = 0.3 + (node["turn"] + 1) * COL_IN if kind == "continue" else bus + STUB_IN
            if labelled(node):
                segments[kind].append([(x0 + BOX_W_IN, yc), (bus, yc), (bus, end_y), (end_x, end_y)])
                label = f"{'·'.join(map(str, ja['agents']))}  r {_fmt(ja['reward'], '.2f')}"
                if ja["child"] is not None:
                    label += f"  G {_fmt(ja['return'], '.2f')}"
                ax.text(bus + 0.06, end_y - 0.03, label, fontsize=6, va="bottom", parse_math=False,
                        color="#c0392b" if kind == "terminated" else "#333")
            else:
                segments[kind].append([(x0 + BOX_W_IN, yc), (bus, end_y), (end_x, end_y)])
        if not labelled(node):
            rewards = [ja["reward"] for ja in joints]
            stopped = sum(bool(ja["terminated"]) for ja in joints)
            ax.text(bus + 0.06, yc - FAN_ROWS * row_in / 2 - 0.03,
                    f"{len(joints)} joint actions, r {_fmt(min(rewards), '.2f')}..{_fmt(max(rewards), '.2f')}"
                    + (f", {stopped} terminated" if stopped else ""),
                    fontsize=6, va="bottom", parse_math=False)
    styles = {"continue": ("#555", "solid"), "terminated": ("#d62728", "dashed"),
              "leaf": ("#888", "solid"), "undrawn": ("#bbb", "solid")}
    for kind, segs in segments.items():
        if segs:
            colour, style = styles[kind]
            ax.add_collection(LineCollection(segs, colors=colour, linestyles=style, linewidths=0.8, zorder=0))

    left_out = sum(per_turn[drawn_turns:])
    prompt = " ".join(str((record.get("problem") or {}).get("prompt", "")).split())
    header = [
        (f"step {record['step']} · tree {record['tree']} · {shape['nodes']} nodes · {shape['agents']} agents · "
         f"K={shape['K']} · {shape['turns']} turns · {shape['terminated']}/{shape['joint actions']} terminated",
         dict(fontsize=9, fontweight="bold")),
        ((prompt[:120] + "…") if len(prompt) > 120 else prompt, dict(fontsize=8, color="#444")),
        ("box colour: the node's mean reward (red low, green high) · edge label: completion index per agent, "
         "reward r, return G · red dashed: terminated", dict(fontsize=7, color="#666")),
    ]
    if left_out:
        header.append((f"{left_out} nodes of turns {drawn_turns}+ not drawn (light grey edges lead to them); "
                       "the HTML page shows every node", dict(fontsize=7, color="#666")))
    for line, (text, style) in enumerate(header):
        ax.text(0.3, 0.22 + 0.22 * line, text, va="center", parse_math=False, **style)
    for t in range(drawn_turns):
        ax.text(0.3 + t * COL_IN + BOX_W_IN / 2, header_in - 0.12, f"turn {t}", fontsize=8, ha="center",
                color="#444", parse_math=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _box(x: float, y: float, w: float, h: float, colour: Any):
    from matplotlib.patches import FancyBboxPatch

    return FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.06", facecolor=colour,
                          edgecolor="#333", linewidth=0.8)


# ------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m magrpo.viz", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tree = commands.add_parser("tree", help="one rollout tree as HTML + PNG",
                               description="Write one rollout tree of RUN_DIR/rollouts.jsonl as HTML and PNG.")
    tree.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    tree.add_argument("--step", type=int, default=None, help="training step (default: the last one)")
    tree.add_argument("--tree", type=int, default=0, help="tree index within the step's batch (default: 0)")
    tree.add_argument("--out", type=Path, default=None,
                      help="HTML path (default: RUN_DIR/viz/tree_step{S}_tree{I}.html); the PNG goes next to it")
    args = parser.parse_args(argv)
    try:
        record = load_tree(args.run_dir, args.step, args.tree)
    except (FileNotFoundError, LookupError) as err:
        print(f"magrpo.viz: error: {err}", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "viz" / f"tree_step{record['step']}_tree{record['tree']}.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_tree_html(record), encoding="utf-8")
    print(out)
    print(render_tree_png(record, out.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
