"""Tables of one section: a row per policy run, the columns its tasks give, each figure with its
ratio to the full cache of the same section, and a caption that names the setting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..stats import RESAMPLES, Interval
from ..tasks import TASKS, Column, Row
from ..tasks.cells import baseline
from .sections import SETUP, Section, rows, sections, setup_label

Columns = Callable[[list[Row]], list[Column]]


def columns(table_rows: list[Row]) -> list[Column]:
    """The summary's columns: the budget, then each task's (only tasks measured give theirs)."""
    budget = [Column("budget", "budget", lambda row: row.budget, 0, ratio=False)] if any(row.budget is not None for row in table_rows) else []
    return budget + [column for task in TASKS for column in task.columns(table_rows)]


def details(table_rows: list[Row]) -> list[Column]:
    """The detail table's columns (recall: each task, length and protocol)."""
    return [column for task in TASKS for column in task.details(table_rows)]


@dataclass
class Table:
    """Values and ratios, ready to render in any format."""

    columns: list[Column]
    rows: list[Row]
    values: list[list[float | None]]
    ratios: list[list[float | None]]
    caption: str
    intervals: list[list[Interval | None]]
    section: Section


def tabulate(section: Section, choose: Columns = columns) -> Table:
    """The table of one section's records."""
    table_rows = rows(section.records)
    cols = choose(table_rows)
    values = [[column.value(row) for column in cols] for row in table_rows]
    intervals = [[column.interval(row) if column.interval else None for column in cols] for row in table_rows]
    base = baseline(table_rows)
    base_values = values[table_rows.index(base)] if base is not None else [None] * len(cols)
    ratios = [
        [_ratio(value, reference) if column.ratio else None for value, reference, column in zip(row_values, base_values, cols)]
        for row_values in values
    ]
    return Table(cols, table_rows, values, ratios, _caption(section, table_rows, base is not None, cols), intervals, section)


def summarize(records: list[dict], choose: Columns = columns) -> Table:
    """The table of records of one section (:func:`sections`); ``ValueError`` for records of
    several, which no table may set side by side."""
    parts = sections(records)
    if len(parts) > 1:
        described = " | ".join(f"{setup_label(part.setup)}: {part.describe()}" for part in parts)
        raise ValueError(f"the records hold {len(parts)} settings ({described}): tabulate each of sections(records)")
    return tabulate(parts[0] if parts else Section(1, (None,) * len(SETUP), {}), choose)


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def _caption(section: Section, table_rows: list[Row], has_base: bool, cols: list[Column]) -> str:
    parts = [setup_label(section.setup), section.describe()] if section.settings else []
    parts += [text for task in TASKS for text in task.caption(table_rows)]
    if any(column.interval for column in cols):
        parts.append(f"± = half-width of the 95% percentile-bootstrap interval over the cells ({RESAMPLES} resamples)")
    parts.append("(x) = ratio to the full cache" if has_base else "no full cache in the sweep, so no ratios")
    return "; ".join(parts)
