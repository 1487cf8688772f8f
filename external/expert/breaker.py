"""A circuit breaker for the expert endpoint, so a dead or hung server stops costing time every turn.

Closed: requests go. After `threshold` consecutive failed requests it opens: for `cooldown_s`
seconds nothing is sent (callers fall back at once). When the cool-down is over, one caller gets
to probe; the others still fall back until the probe ends. A success closes the breaker, a failure
opens it for another cool-down. `threshold` 0 disables it. Thread-safe; the clock is injectable.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

CLOSED, OPEN, PROBE = "closed", "open", "probe"


class Breaker:
    def __init__(self, threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic):
        self.threshold, self.cooldown_s, self.clock = threshold, cooldown_s, clock
        self._lock = threading.Lock()
        self.failures = 0  # consecutive
        self.open_until: float | None = None  # None: closed
        self._probing = False

    def allow(self) -> str:
        """CLOSED (send), OPEN (do not send) or PROBE (send: this caller is the one probe)."""
        with self._lock:
            if self.open_until is None:
                return CLOSED
            if self._probing or self.clock() < self.open_until:
                return OPEN
            self._probing = True
            return PROBE

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self.open_until is not None

    def record(self, ok: bool) -> bool:
        """Count one request's outcome; True when this failure opened a closed breaker."""
        with self._lock:
            if ok:
                self.failures, self.open_until, self._probing = 0, None, False
                return False
            self.failures += 1
            was_closed = self.open_until is None
            if self.threshold and (self._probing or self.failures >= self.threshold):
                self.open_until, self._probing = self.clock() + self.cooldown_s, False
                return was_closed
            return False
