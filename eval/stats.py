"""Confidence intervals for the tables: a percentile bootstrap of the mean over cells.

A recall score is a mean over cells (lengths x depths x seeds), each in [0, 1] (a fraction of
expected strings, or exact match); the bootstrap needs no assumption on their distribution and
is seeded, so a table re-rendered from the same records shows the same interval. All cells equal
(all right, all wrong) give a zero-width interval: the spread of the cells measured, not of the
model on cells not measured, which is what more ``--seeds`` buy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

RESAMPLES = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def __str__(self) -> str:
        return f"{self.mean:.2f} ± {self.half_width:.2f}" if self.n > 1 else f"{self.mean:.2f}"


def bootstrap(values: Sequence[float], resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> Interval:
    """The mean of ``values`` and its ``level`` percentile-bootstrap interval."""
    if not values:
        raise ValueError("no values to take an interval of")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, mean, mean, 1)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    low = means[int(tail * resamples)]
    high = means[min(resamples - 1, int((1 - tail) * resamples))]
    return Interval(mean, low, high, n)
