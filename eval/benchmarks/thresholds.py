"""Performance thresholds the benchmarks check their figures against, each with its reason.

A benchmark prints one line per check, ``"<figure> (met, <= 1.3)"`` or ``"(MISSED, ...)"``, then
the reason of each threshold it used (:func:`reasons`), so that a reader of the output knows what
a miss means. The thresholds are listed, with their reasons, in ``docs/evaluation.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    """A bound on a figure (``at most``, or ``at least`` with ``floor``) and why it is that bound."""

    limit: float
    reason: str
    floor: bool = False

    def met(self, value: float) -> bool:
        return value >= self.limit if self.floor else value <= self.limit

    def check(self, figure: str, value: float, note: str = "") -> str:
        """``"<figure> (met, <= 1.3)"``: the figure, whether it meets the bound, the bound."""
        bound = f"{'>=' if self.floor else '<='} {self.limit}{note}"
        return f"{figure} ({'met' if self.met(value) else 'MISSED'}, {bound})"


def reasons(named: Iterable[tuple[str, Threshold]]) -> list[str]:
    """One line per threshold: its bound and its reason."""
    return [f"  {name} {'>=' if t.floor else '<='} {t.limit}: {t.reason}" for name, t in named]
