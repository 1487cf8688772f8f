"""magrpo's error family, and how errors reach the user.

Every error magrpo raises on purpose is a `MagrpoError`: the CLI prints it as one line and exits
with 2 (`ConfigError`: bad input, fix a setting) or 1 (anything else: training could not go on).
Errors raised by user code (an env's methods, a feedback function, a plugin's hook) become one line that names the
function, with the full traceback kept in the run dir (`error.log`) rather than on the console.
Text from outside (a program's or tool's output, an exception's message, a server's or an expert's
reply, the model's own JSON) passes `valid_text` before it reaches a tokenizer or a file.
This module imports nothing from magrpo: every other module may import it."""
from __future__ import annotations

import re
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

ERROR_LOG = "error.log"
# A lone surrogate (U+D800-U+DFFF), as `chr(0xD800)` or the JSON escape \ud800 gives: a Python string may
# hold one, UTF-8 cannot (a tokenizer raises TypeError on it, a UTF-8 file write UnicodeEncodeError)
SURROGATE = re.compile("[\ud800-\udfff]")


class MagrpoError(Exception):
    """Base of every error magrpo raises on purpose; its message is one line for the user."""

    exit_code = 1


class ConfigError(MagrpoError, ValueError):
    """A bad setting: rendered as one line `config error: <key>: <message>`, exit code 2."""

    exit_code = 2

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class TrainingError(MagrpoError, RuntimeError):
    """Training cannot go on (NaN/inf steps in a row, out of memory twice); the last checkpoint is intact."""


class Stopped(MagrpoError):
    """A stop signal ended the run after a clean checkpoint. It exits 128 + the signal's number, as a
    shell reports a process that signal ended: a scheduler must not read an unfinished run as done."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum


class EnvError(MagrpoError, RuntimeError):
    """An env method raised (the message names the method)."""


class RewardError(MagrpoError, RuntimeError):
    """The env raised or returned a non-finite reward for a joint action."""


class FeedbackError(MagrpoError, TypeError):
    """A feedback function broke its contract or raised."""


class TimedOut(MagrpoError, TimeoutError):
    """User code (a feedback function or mode, an env method, a plugin's hook) ran past limits.user_code_timeout_s."""


class PluginError(MagrpoError, RuntimeError):
    """A plugin's registered hook (a baseline, credit rule, loss aggregation, ...) raised (the message names it)."""


class SyncError(MagrpoError, RuntimeError):
    """The engine would generate (or generated) with adapter weights other than the trainer's."""


class FetchError(MagrpoError, RuntimeError):
    """A model could not be fetched or converted (the message says how to get it otherwise)."""


def qualified_name(fn: Any) -> str:
    """`module.Class.method` or `module.function`: where to look in the user's code."""
    fn = getattr(fn, "__func__", fn)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


def describe(error: BaseException) -> str:
    """`Type: first line of the message`, never more than one line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def valid_text(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD, as a UTF-8 decoder shows a bad byte."""
    return SURROGATE.sub("\ufffd", text)


@contextmanager
def user_code(error: Callable[[Exception], Exception], keep: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Run user code: any exception becomes error(exception), raised from it (the traceback stays for
    error.log). A ConfigError (bad input the code found) and the `keep` types pass unchanged."""
    try:
        yield
    except (ConfigError, *keep):
        raise
    except Exception as e:
        raise error(e) from e


def within(timeout_s: float, late: Callable[[], Exception], fn: Callable[..., Any], /, *args: Any,
           **kwargs: Any) -> Any:
    """fn(*args, **kwargs) given at most `timeout_s` seconds (0: no limit). Past it, `late()` is raised and fn is left
    to itself in a daemon thread: neither the run's end nor the interpreter's exit waits for code that hangs."""
    if not timeout_s:
        return fn(*args, **kwargs)
    done, out = threading.Event(), {}

    def target() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (handed to the caller's thread, raised there)
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name=f"magrpo-user-code-{qualified_name(fn)}", daemon=True).start()
    if not done.wait(timeout_s):
        raise late()
    if "error" in out:
        raise out["error"]
    return out["value"]


RESUMABLE = "the run dir is resumable from its last checkpoint with resume=auto"
BEFORE_RUN = "nothing was trained or written"  # the tail for user code that start-up calls, before any run dir


def timed_out(what: str, when: str, timeout_s: float, tail: str = RESUMABLE) -> TimedOut:
    """The one-line error for user code (`what` names it) that ran past limits.user_code_timeout_s; `when`
    (" at turn 1", or "") says where the run was."""
    return TimedOut(f"{what} did not return within limits.user_code_timeout_s={timeout_s:g} s{when}; make it faster "
                    f"or raise the limit (0 = none); {tail}")


def limited(fn: Callable[..., Any], what: str, timeout_s: float, tail: str = RESUMABLE) -> Callable[..., Any]:
    """fn as the trainer calls a plugin's hook: given at most timeout_s seconds (0: no limit), a raise or a
    timeout one line naming `what` (its registry, name and qualified name)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with user_code(lambda e: PluginError(f"{what} raised: {describe(e)}"), keep=(TimedOut,)):
            return within(timeout_s, lambda: timed_out(what, "", timeout_s, tail), fn, *args, **kwargs)

    return call


def log_traceback(run_dir: Path, error: BaseException) -> Path | None:
    """Append the error's full traceback to RUN_DIR/error.log; returns that path (None when it
    cannot be written: the error itself must still reach the user)."""
    path = Path(run_dir) / ERROR_LOG
    text = f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n" + "".join(traceback.format_exception(error))
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError:  # a full disk: no empty error.log pointing nowhere
        if path.is_file() and path.stat().st_size == 0:
            path.unlink(missing_ok=True)
        return None
    return path
