"""One look for every figure of a report: a colour and a marker per policy family, the same in
every figure; a line style per budget within a family; hollow markers that shrink in drawing
order, so that lines which coincide stay visible; axes fitted to the data with a margin, log
axes with at least three plain-number ticks; the legend outside the data; a title that says
what was measured, on what, how, and when."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..tasks import Row, Task
from .sections import setup_label
from .tables import Table

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
"""Colours of the families after the full cache's (black), in order of first appearance."""
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
LINESTYLES = ("-", "--", ":", "-.")
MARGIN = 0.06
"""Room left beyond the data on each side of an axis, as a share of its span."""
LOG_SPAN = 3.0
"""A quantity spanning at least this factor is drawn on a log axis; a narrower one on a linear axis."""


@dataclass(frozen=True)
class Look:
    colour: str
    marker: str


class Style:
    """The look of each policy family in every figure of one report."""

    def __init__(self, families: Iterable[str]) -> None:
        self.looks: dict[str, Look] = {}
        for family in dict.fromkeys(families):
            if family == "full":
                self.looks[family] = Look("#000000", "*")
            else:
                n = sum(1 for name in self.looks if name != "full")
                self.looks[family] = Look(PALETTE[n % len(PALETTE)], MARKERS[(n + n // len(PALETTE)) % len(MARKERS)])

    @classmethod
    def of_records(cls, records: Iterable[dict]) -> Style:
        return cls(record.get("family") or record["policy"].partition(":")[0] for record in records)

    def look(self, family: str) -> Look:
        if family not in self.looks:  # a family first seen here: appended, never reassigned
            self.looks.update(Style([*self.looks, family]).looks)
        return self.looks[family]

    def line(self, row: Row, rows: Sequence[Row], order: int) -> dict:
        """Line keywords for ``row``: its family's colour and marker, a line style by its budget's
        rank in the family, a hollow marker and a line that thin out with ``order``."""
        budgets = sorted({other.budget for other in rows if other.family == row.family and other.budget is not None})
        rank = budgets.index(row.budget) if row.budget in budgets else 0
        return {**self.point(row.family, order), "linestyle": LINESTYLES[rank % len(LINESTYLES)], "linewidth": max(0.8, 2.0 - 0.15 * order)}

    def point(self, family: str, order: int) -> dict:
        look = self.look(family)
        return {
            "color": look.colour, "marker": look.marker, "markersize": max(3.5, 9.0 - 0.8 * order),
            "markerfacecolor": "none", "markeredgewidth": 1.3,
        }


def nice_ticks(low: float, high: float, powers_of_two: bool = False) -> list[float] | None:
    """Three to eight round values within ``[low, high]`` for a log axis, or ``None`` when the
    span holds fewer than three (the axis should then be linear)."""
    if low <= 0 or high < low:
        return None
    sequences = [(1,), (1, 2, 5), (1, 2, 3, 5, 7), (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9)]
    candidates = [[2.0**k for k in range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1)]] if powers_of_two else []
    for mantissas in sequences:
        decades = range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
        candidates.append([m * 10.0**k for k in decades for m in mantissas])
    for values in candidates:
        inside = sorted({round(v, 12) for v in values if low * (1 - 1e-9) <= v <= high * (1 + 1e-9)})
        if len(inside) >= 3:
            step = math.ceil(len(inside) / 8)
            return inside[::step]
    return None


def plain(value: float, _position: object = None) -> str:
    """A tick label as a plain number (``0.25``, ``128``, ``20,000``), never a power of ten."""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.6f}".rstrip("0")


def fit(axes, axis: str, values: Iterable[float], log: bool | None = None, ticks: Sequence[float] = ()) -> None:
    """Scale ``axes``' x or y axis to ``values``: log where they span :data:`LOG_SPAN` or more
    (``log=False`` never; ``True`` whenever three round ticks fit), with round plain-number ticks
    (or ``ticks``, the values a reader looks for, such as the budgets swept, where there are
    enough of them); limits with a :data:`MARGIN` so that no point sits on the frame."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    found = [v for v in values if v is not None and math.isfinite(v)]
    if not found:
        return
    low, high = min(found), max(found)
    target = axes.xaxis if axis == "x" else axes.yaxis
    chosen = None
    if log is not False and low > 0 and (log or high / low >= LOG_SPAN):
        chosen = nice_ticks(low, high, powers_of_two=all(v == 2 ** round(math.log2(v)) for v in found if v >= 1))
    wanted = sorted(set(ticks))
    if chosen is not None:
        (axes.set_xscale if axis == "x" else axes.set_yscale)("log")
        span = math.log(high / low) or 1.0
        limits = (low * math.exp(-MARGIN * span), high * math.exp(MARGIN * span))
        target.set_major_locator(FixedLocator(wanted if 3 <= len(wanted) <= 8 else chosen))
        target.set_minor_locator(NullLocator())
        target.set_minor_formatter(NullFormatter())
    else:
        span = high - low or abs(high) or 1.0
        limits = (low - MARGIN * span, high + MARGIN * span)
        if 2 <= len(wanted) <= 8:
            target.set_major_locator(FixedLocator(wanted))
    target.set_major_formatter(FuncFormatter(plain))
    (axes.set_xlim if axis == "x" else axes.set_ylim)(*limits)


def title(table: Table, what: str, plugin: Task, protocol: str | None = None, width: float = 7.0) -> str:
    """``what`` and everything a reader needs to place it: model, text, device and dtype; the
    task's setting and the values of its dimensions (recall lengths); the protocol; the date."""
    setting = dict(table.section.settings.get(plugin.name, {}))
    for index, dimension in enumerate(plugin.dimensions):
        values = sorted({where[index] for row in table.rows for _, where, _ in row.matching(plugin.accepts)})
        if values:
            setting[dimension + "s"] = values
    parts = [what, setup_label(table.section.setup)]
    if setting:
        parts.append(", ".join(f"{key}={'/'.join(map(str, value)) if isinstance(value, list) else value}" for key, value in setting.items()))
    if protocol is not None:
        parts.append(f"protocol {protocol}")
    dates = sorted(record["created"][:10] for record in table.section.records if record.get("created"))
    if dates:
        parts.append(dates[-1] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}")
    return "\n".join(textwrap.wrap("; ".join(parts), width=int(width * 15)))
