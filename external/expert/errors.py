"""The one error type of the expert layer."""
from __future__ import annotations

from magrpo.errors import ConfigError


class ExpertError(ConfigError):
    """A setup problem with the expert (missing package, bad key, unreachable server).

    A ConfigError so the CLI prints it as one line `config error: <key>: <message>` naming the
    setting to fix; per-request failures during training never raise it (they return None).
    """
