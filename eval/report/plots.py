"""Plots (PNG) of one table, in the report's one style (:mod:`.style`): each task's curves (a line
per policy run along a shared axis: perplexity by position, memory along the stream, latency by
context) and a frontier per quality measure (quality against budget or kept fraction, one line
per family with the tables' 95% intervals as error bars, unbounded caches as horizontal lines
with their interval as a band; beside it, quality against the KV bytes held). Series that
coincide are drawn once, their names joined by ``=``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..tasks import TASKS, Curves, Measure, Row, Task
from ..tasks.cells import MIB
from .style import Style, fit, title
from .tables import Table

REFERENCE = "reference"
"""The ``gid`` of a line drawn across a whole axes (an unbounded cache's level), not at data points."""


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas, without pyplot's global state or a display
    return figure


def moving_average(values: list[float], window: int = 5) -> list[float]:
    """Centred moving average (the window shrinks at the ends), so spikes of one bin do not dominate."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out


@dataclass
class Series:
    """A line to draw: its labels (several once merged), points, look, and what goes with it."""

    labels: list[str]
    xs: list[float]
    ys: list[float]
    look: dict
    raw: list[float] | None = None
    """The values before smoothing, drawn lightly behind the line."""
    errors: tuple[list[float], list[float]] | None = None
    """Distances from each value down and up to its interval's ends."""
    family: str = ""

    @property
    def label(self) -> str:
        return " = ".join(self.labels)

    def key(self) -> tuple:
        return tuple(self.xs), tuple(round(y, 9) for y in self.ys), self.errors and tuple(map(tuple, self.errors))


def merge(series: Sequence[Series]) -> list[Series]:
    """Series with the same points (and intervals) drawn once, their labels joined."""
    kept: dict[tuple, Series] = {}
    for item in series:
        if item.key() in kept:
            kept[item.key()].labels += item.labels
        else:
            kept[item.key()] = Series(list(item.labels), item.xs, item.ys, item.look, item.raw, item.errors, item.family)
    return list(kept.values())


def _legend(figure, axes_list) -> None:
    """One legend for the figure, below its panels (the labels of every panel, once), in as many
    columns as its labels leave room for."""
    handles: dict[str, object] = {}
    for axes in axes_list:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        room = int(figure.get_figwidth() * 15 / (max(map(len, handles)) + 6))
        figure.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=max(1, min(4, room, len(handles))), fontsize=7, frameon=False)


def _panel_legend(axes) -> None:
    """A panel's own legend, outside it on the right (panels that merge different series)."""
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7, frameon=False)


def _markevery(xs: Sequence[float]) -> int:
    return max(1, len(xs) // 8)


def curves_figure(table: Table, curves: Curves, task: Task, style: Style):
    """One panel per :class:`Panel` of ``curves``, a line per row that has points; ``None`` if no row has."""
    figure = _figure(9.0, 1.0 + 2.6 * len(curves.panels))
    panels, drawn = [], False
    for number, panel in enumerate(curves.panels, start=1):
        axes = figure.add_subplot(len(curves.panels), 1, number, sharex=panels[0] if panels else None)
        panels.append(axes)
        series = []
        for order, row in enumerate(table.rows):
            points = panel.points(row)
            if points is None:
                continue
            xs, ys = list(points[0]), list(points[1])
            smooth = moving_average(ys, panel.smooth) if panel.smooth > 1 else ys
            series.append(Series([row.label(curves.task)], xs, smooth, style.line(row, table.rows, order), ys if panel.smooth > 1 else None))
        xs_all, ys_all = [], []
        for item in merge(series):
            if item.raw is not None:
                axes.plot(item.xs, item.raw, color=item.look["color"], linewidth=0.6, alpha=0.3, zorder=1)
                ys_all += item.raw
            axes.plot(item.xs, item.ys, label=item.label, markevery=_markevery(item.xs), zorder=2, **item.look)
            xs_all += item.xs
            ys_all += item.ys
        drawn |= bool(series)
        fit(axes, "x", xs_all, log=None if curves.log_x else False)
        fit(axes, "y", ys_all, log=None if panel.log else False)
        axes.set_ylabel(panel.ylabel + (f"\n(moving average of {panel.smooth}; raw values light)" if panel.smooth > 1 else ""), fontsize=8)
        axes.grid(alpha=0.3, which="major")
    panels[-1].set_xlabel(curves.xlabel)
    if not drawn:
        return None
    figure.suptitle(title(table, curves.title, task, width=9.0), fontsize=8)
    for axes in panels:
        _panel_legend(axes)
    return figure


def frontier_figure(table: Table, measure: Measure, task: Task, style: Style):
    """Quality against budget or kept fraction (left) and against the KV bytes held (right);
    ``None`` when no row has the measure."""
    points = [(row, value) for row in table.rows if (value := measure.value(row)) is not None]
    if not points:
        return None
    by_fraction = any(row.any_record().get("ratio") is not None for row, _ in points)
    bounded = [(row, value) for row, value in points if row.budget is not None]
    unbounded = [(row, value) for row, value in points if row.budget is None]
    sides = [side for side, wanted in (("budget", bool(bounded)), ("bytes", any(_held_mib(measure, row) for row, _ in points))) if wanted]
    if not sides:
        return None
    figure = _figure(5.0 * len(sides), 5.0)
    panels = []
    for number, side in enumerate(sides, start=1):
        axes = figure.add_subplot(1, len(sides), number, sharey=panels[0] if panels else None)
        panels.append(axes)
        if side == "budget":
            _budget_side(axes, measure, bounded, unbounded, by_fraction, style)
            axes.set_xlabel("kept fraction of the context (measured)" if by_fraction else "budget (tokens kept per layer)")
        else:
            _bytes_side(axes, measure, points, style)
            axes.set_xlabel("KV held per sequence (MiB)")
        axes.grid(alpha=0.3, which="major")
    values = [value for _, value in points] + [end for row, _ in points for end in _ends(measure, row)]
    fit(panels[0], "y", values)
    panels[0].set_ylabel(measure.ylabel)
    figure.suptitle(title(table, measure.ylabel.partition(" (")[0], task, measure.protocol, width=5.0 * len(sides)), fontsize=8)
    _legend(figure, panels)
    return figure


def _ends(measure: Measure, row: Row) -> list[float]:
    interval = measure.interval(row) if measure.interval else None
    return [] if interval is None else [interval.low, interval.high]


def _errors(measure: Measure, rows: Sequence[Row], values: Sequence[float]) -> tuple[list[float], list[float]] | None:
    """Distances from each value down and up to its 95% interval's ends (``None``: no intervals)."""
    intervals = [measure.interval(row) if measure.interval else None for row in rows]
    if all(interval is None for interval in intervals):
        return None
    low = [value - interval.low if interval else 0.0 for value, interval in zip(values, intervals)]
    high = [interval.high - value if interval else 0.0 for value, interval in zip(values, intervals)]
    return low, high


def _family_series(measure: Measure, members: list[tuple[Row, float]], x_of, style: Style) -> list[Series]:
    """A series per family: its rows' points in x order, with their intervals."""
    series = []
    for order, family in enumerate(dict.fromkeys(row.family for row, _ in members)):
        found = sorted((x_of(row), row, value) for row, value in members if row.family == family and x_of(row) is not None)
        if found:
            rows = [row for _, row, _ in found]
            values = [value for _, _, value in found]
            series.append(Series([family], [x for x, _, _ in found], values, style.point(family, order), errors=_errors(measure, rows, values), family=family))
    return series


DODGE = 0.012
"""How far apart the families' points at one x are set, as a share of the x span (or of its log)."""


def _draw(axes, series: list[Series]) -> list[float]:
    """Each family's line with its error bars, the families set a little apart along x (so that
    bars at one budget do not hide each other); return the x values drawn."""
    xs = [x for item in series for x in item.xs]
    if not xs:
        return []
    low, high = min(xs), max(xs)
    log = low > 0 and high / low >= 3
    span = (math.log(high / low) if log else high - low) or (1.0 if log else abs(high) or 1.0)
    drawn = []
    for number, item in enumerate(series):
        shift = DODGE * span * (number - (len(series) - 1) / 2)
        at = [x * math.exp(shift) if log else x + shift for x in item.xs]
        look = {**item.look, "linestyle": "-", "linewidth": 1.4}
        if item.errors is not None:
            axes.errorbar(at, item.ys, yerr=item.errors, label=item.label, capsize=2.5, elinewidth=0.9, **look)
        else:
            axes.plot(at, item.ys, label=item.label, **look)
        drawn += at
    return drawn


def _budget_side(axes, measure: Measure, bounded, unbounded, by_fraction: bool, style: Style) -> None:
    def x_of(row: Row) -> float | None:
        if not by_fraction:
            return row.budget
        record = measure.bytes_record(row)
        return None if record is None else record.get("kept_fraction")

    xs = _draw(axes, merge(_family_series(measure, bounded, x_of, style)))
    levels: dict[float, list[Row]] = {}
    for row, value in unbounded:
        levels.setdefault(round(value, 9), []).append(row)
    for order, (value, rows) in enumerate(levels.items()):  # an unbounded cache's level across the panel
        look = style.look(rows[0].family)
        label = " = ".join(row.label() for row in rows)
        axes.axhline(value, color=look.colour, linestyle=("-", "--", ":", "-.")[order % 4], linewidth=1.2, label=label, gid=REFERENCE)
        ends = _ends(measure, rows[0])
        if ends and ends[1] > ends[0]:
            axes.axhspan(*ends, color=look.colour, alpha=0.08, linewidth=0)
    fit(axes, "x", xs, ticks=() if by_fraction else sorted({x_of(row) for row, _ in bounded}))


def _bytes_side(axes, measure: Measure, points, style: Style) -> None:
    held = [(row, value) for row, value in points if _held_mib(measure, row) is not None]
    families = [(row, value) for row, value in held if row.budget is not None]
    xs = _draw(axes, merge(_family_series(measure, families, lambda row: _held_mib(measure, row), style)))
    for order, (row, value) in enumerate((row, value) for row, value in held if row.budget is None):
        x = _held_mib(measure, row)
        look = {**style.point(row.family, order), "markersize": 10.0 - 1.5 * order, "linestyle": "none"}
        errors = _errors(measure, [row], [value])
        axes.errorbar([x], [value], yerr=errors, label=row.label(), capsize=2.5, **look)
        xs.append(x)
    fit(axes, "x", xs)


def _held_mib(measure: Measure, row: Row) -> float | None:
    record = measure.bytes_record(row)
    held = None if record is None else record.get("held_bytes")
    return None if held is None else held / MIB


def figures(table: Table, style: Style) -> dict[str, object]:
    """Every figure of one table by the name of its file (without the section's suffix)."""
    found = {}
    for task in TASKS:
        for curves in task.curves(table.rows):
            if (figure := curves_figure(table, curves, task, style)) is not None:
                found[curves.name] = figure
        for measure in task.measures(table.rows):
            if (figure := frontier_figure(table, measure, task, style)) is not None:
                found[f"frontier_{measure.name}"] = figure
    return found


def plots(table: Table, out: Path, style: Style | None = None) -> list[Path]:
    """Save the figures of one table as ``NAME{suffix}.png`` (:attr:`Section.suffix`), in the
    style of the whole report (by default, of this table's records alone)."""
    made = []
    for name, figure in figures(table, style or Style.of_records(table.section.records)).items():
        path = out / f"{name}{table.section.suffix}.png"
        figure.savefig(path)
        made.append(path)
    return made
