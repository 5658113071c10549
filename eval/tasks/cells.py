"""What tasks build their columns and measures from: a record's figure, the mean and interval of a
row's cells, the turns its cells were asked in, the protocols a table's rows were answered under,
and the full cache's row."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..protocols import PROTOCOLS
from ..stats import Interval, bootstrap
from .base import Row

MIB = 2**20
Cells = Callable[[Row], list[float]]


def figure(task: str, key: str, scale: float = 1.0, at: int | None = None) -> Callable[[Row], float | None]:
    """A row's ``key`` of its ``task`` record, divided by ``scale``; of a list, the item at context
    ``at`` (speed)."""

    def value(row: Row) -> float | None:
        record = row.record(task)
        if record is None:
            return None
        found = record[key]
        if at is not None:
            contexts = record["contexts"]
            if at not in contexts:
                return None
            found = found[contexts.index(at)]
        return None if found is None else found / scale

    return value


def records_of(task: str) -> Callable[[Row], list[dict]]:
    """A row's record of ``task``, as a column's sources."""
    return lambda row: [record] if (record := row.record(task)) is not None else []


def mean_of(cells: Cells) -> Callable[[Row], float | None]:
    def mean(row: Row) -> float | None:
        values = cells(row)
        return sum(values) / len(values) if values else None

    return mean


def interval_of(cells: Cells) -> Callable[[Row], Interval | None]:
    def interval(row: Row) -> Interval | None:
        values = cells(row)
        return bootstrap(values) if values else None

    return interval


def turns_of(cells: Iterable[dict]) -> list[int]:
    """The turns that cells of a task asking several questions were asked in (none for others)."""
    return sorted({cell["turn"] for cell in cells if "turn" in cell})


def protocols_of(rows: list[Row], accepts: Callable[[str], bool]) -> list[str]:
    """The protocols the records of a task were answered under, in :data:`PROTOCOLS` order."""
    found = {where[-1] for row in rows for _, where, _ in row.matching(accepts)}
    return [name for name in PROTOCOLS if name in found]


def baseline(rows: list[Row]) -> Row | None:
    """The full cache's row: the one whose spec is ``full``, else the first ``full:...`` one."""
    exact = [row for row in rows if row.policy == "full"]
    named = [row for row in rows if row.policy.partition(":")[0] == "full"]
    return (exact or named or [None])[0]
