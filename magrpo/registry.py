"""Name -> object registries. Environments, feedback modes, baselines and loss aggregations
register here by name; `magrpo/` itself never imports a specific environment."""
from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, TypeVar

from .errors import RESUMABLE, limited, qualified_name

T = TypeVar("T")

# The tail of an unknown-name error: how the user's own env / feedback mode / registered rule becomes selectable.
ENV_HINT = ("or your own: plugins=[my_pkg.envs] (a module that registers it with @ENVS.register) "
            "or env.name=my_pkg.envs:MyEnv")
FEEDBACK_HINT = ("or your own: external.mode=my_pkg.feedback:my_function, or plugins=[my_pkg.feedback] "
                 "(a module that registers it with @FEEDBACK.register) and external.mode=ITS_NAME")


def registry_hint(registry: str) -> str:
    """The hint for a name of one of the other registries (BASELINES, CREDITS, LOSS_AGGS, ...)."""
    return f"or your own: plugins=[my_pkg.module] (a module that registers it with @{registry}.register)"


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind  # e.g. "env", used in error messages
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"duplicate {self.kind} {name!r}: {_where(self._items[name])} and {_where(obj)}"
                                 + _twice_hint(self._items[name], obj))
            self._items[name] = obj
            return obj

        return deco

    def replace(self, name: str, obj: T) -> T:
        """Register obj under name even when an older definition holds it (the Python API's classes:
        a notebook cell that defines one runs again)."""
        self._items[name] = obj
        return obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}") from None

    def hook(self, name: str, timeout_s: float = 0, tail: str = RESUMABLE) -> T:
        """The object under name, as the trainer calls it: a plugin's (user code) runs under
        limits.user_code_timeout_s (`timeout_s`; 0: no limit) and a raise or a timeout is one line naming it
        (ending with `tail`); magrpo's own (in-process math) is returned as it is, with no thread per call."""
        obj = self.get(name)
        what = f"{self.kind} {name!r} ({qualified_name(obj)})"
        return obj if builtin(obj) else limited(obj, what, timeout_s, tail)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def builtin(obj: Any) -> bool:
    """Defined in a magrpo module: magrpo's own code, not a plugin's."""
    module = getattr(obj, "__module__", None) or ""
    return module == "magrpo" or module.startswith("magrpo.")


def _where(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _twice_hint(old: object, new: object) -> str:
    """One module imported under two names (a checkout's `envs.x` beside the installed `magrpo.envs.x`)."""
    names = sorted({getattr(old, "__module__", ""), getattr(new, "__module__", "")}, key=len)
    if (
        len(names) == 2
        and names[1] == f"magrpo.{names[0]}"
        and getattr(old, "__qualname__", 1) == getattr(new, "__qualname__", 2)
    ):
        return f" (one module imported twice: import it as {names[1]})"
    return ""
