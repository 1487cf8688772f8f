"""The counters every expert reports (logged as expert/* per step), safe to bump from a thread pool."""
from __future__ import annotations

import threading

KEYS = ("calls", "cache_hits", "failures", "retries", "breaker_open", "late", "latency_s_total")


class ExpertStats:
    """calls (requests that reached the expert), cache_hits, failures, retries, breaker_open (prompts
    not sent: the circuit breaker was open), late (queued or in flight at the turn deadline), latency_s_total
    (wall time of the calls; mean = latency_s_total / calls)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def add(self, **amounts: float) -> None:
        with self._lock:
            for key, amount in amounts.items():
                self._counts[key] += amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            # integer counts: summed over processes under torchrun (floats are averaged)
            self._counts = {key: 0.0 if key == "latency_s_total" else 0 for key in KEYS}
