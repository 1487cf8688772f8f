"""Metric kinds: how an env's, a feedback mode's, a backend's or the trainer's own number merges over
torchrun processes (rank 0 logs one value per key). Mark a number with its kind where it is made:

    return {"env/sandbox_runs": Counter(self.runs), "perf/runs_per_s": Gauge(rate)}

Counter: each process counts its own work, the run's value is the sum. Gauge: a rate, a mean or a
fact every process shares, averaged over the processes that report it (an unmarked number is a
Gauge). Maximum: the largest value of any process (peak memory). The kinds are floats, so code that
reads a metric needs nothing special; in one process every kind logs its own value.
"""
from __future__ import annotations

from typing import Mapping, Sequence


class Counter(float):
    """Summed over processes."""


class Gauge(float):
    """Averaged over the processes that report it (the default for unmarked numbers)."""


class Maximum(float):
    """The largest value over processes."""


def _merge(values: list[float]) -> float:
    kinds = {type(v) for v in values}
    if kinds == {Counter}:
        return float(sum(values))
    if kinds == {Maximum}:
        return float(max(values))
    if Counter in kinds or Maximum in kinds:  # a producer marks a key differently on different ranks
        raise TypeError(f"one metric with mixed kinds over processes: {sorted(k.__name__ for k in kinds)}")
    return sum(float(v) for v in values) / len(values)


def reduce_over_ranks(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Every rank's metric dict merged by each value's kind; keys in first-seen order."""
    keys = list(dict.fromkeys(k for d in per_rank for k in d))
    return {key: _merge([d[key] for d in per_rank if key in d]) for key in keys}
