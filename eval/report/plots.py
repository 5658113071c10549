"""Plots (PNG) of one table: each task's curves (perplexity by position, memory along the stream,
latency by context) and a frontier per quality measure (quality against budget or kept fraction,
one line per family, unbounded caches as horizontal lines; and quality against the KV bytes held).
"""

from __future__ import annotations

from pathlib import Path

from ..tasks import TASKS, Curves, Measure, Row
from ..tasks.cells import MIB, baseline
from .tables import Table


def _figure(width: float = 7.0, height: float = 4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas, without pyplot's global state or a display
    return figure


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
LINESTYLES = ("-", "--", "-.", ":")


def _style(i: int) -> dict:
    """Marker and line style as well as colour, so that lines survive grayscale printing."""
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[i % len(LINESTYLES)], "markersize": 5 + i % 3}


def moving_average(values: list[float], window: int = 5) -> list[float]:
    """Centred moving average (the window shrinks at the ends), so spikes of one bin do not dominate."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out


def _curves_plot(table: Table, curves: Curves, path: Path) -> bool:
    """One panel per :class:`Panel`, one line per row that has points."""
    figure = _figure(7.0, 3.0 + 1.6 * len(curves.panels))
    drawn = False
    for number, panel in enumerate(curves.panels, start=1):
        axes = figure.add_subplot(len(curves.panels), 1, number)
        for i, row in enumerate(table.rows):
            points = panel.points(row)
            if points is None:
                continue
            xs, ys = points
            ys = moving_average(ys, panel.smooth) if panel.smooth > 1 else ys
            axes.plot(xs, ys, label=row.label(curves.task), markevery=max(1, len(xs) // 8), **_style(i))
            drawn = True
        if panel.log:
            axes.set_yscale("log")
        if curves.log_x:
            axes.set_xscale("log")
        axes.set_xlabel(curves.xlabel)
        axes.set_ylabel(panel.ylabel + (f", moving average of {panel.smooth}" if panel.smooth > 1 else ""))
        axes.grid(alpha=0.3, which="both")
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    if drawn:
        figure.savefig(path)
    return drawn


def _frontier_plot(table: Table, measure: Measure, path: Path) -> bool:
    """Quality against budget (or kept fraction) with one line per family and the unbounded caches
    as horizontal lines, and quality against the KV bytes held, side by side."""
    points = [(row, measure.value(row)) for row in table.rows]
    points = [(row, value) for row, value in points if value is not None]
    if not points:
        return False
    by_fraction = any(row.any_record().get("ratio") is not None for row, _ in points)
    figure = _figure(11.0, 4.2)
    left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    families = list(dict.fromkeys(row.family for row, _ in points if row.budget is not None))
    for i, family in enumerate(families):
        members = [(row, value) for row, value in points if row.budget is not None and row.family == family]
        xs = [_frontier_x(row, measure, by_fraction) for row, _ in members]
        line = sorted((x, value) for x, (_, value) in zip(xs, members) if x is not None)
        if line:
            left.plot([x for x, _ in line], [v for _, v in line], label=family, **_style(i))
        held = sorted((_held_mib(measure, row), value) for row, value in members if _held_mib(measure, row) is not None)
        if held:
            right.plot([x for x, _ in held], [v for _, v in held], label=family, **_style(i))
    for j, (row, value) in enumerate((row, value) for row, value in points if row.budget is None):
        is_full = row is baseline(table.rows)
        left.axhline(value, color="black" if is_full else "gray", linestyle="-" if is_full else LINESTYLES[1 + j % 3], linewidth=1.2, label=row.label())
        held = _held_mib(measure, row)
        if held is not None:
            right.plot([held], [value], linestyle="none", color="black" if is_full else "gray", marker="*" if is_full else "x", markersize=9, label=row.label())
    left.set_xlabel("kept fraction of the context (measured)" if by_fraction else "budget (tokens kept per layer)")
    left.set_xscale("log", base=2)
    right.set_xlabel("KV held per sequence (MiB, log scale)")
    right.set_xscale("log")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for axis in (left.xaxis, right.xaxis):  # plain numbers (64, 128; 2.8 MiB), not powers
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    for axes in (left, right):
        axes.set_ylabel(measure.ylabel)
        axes.grid(alpha=0.3, which="both")
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    figure.savefig(path)
    return True


def _frontier_x(row: Row, measure: Measure, by_fraction: bool) -> float | None:
    if not by_fraction:
        return row.budget
    record = measure.bytes_record(row)
    return None if record is None else record.get("kept_fraction")


def _held_mib(measure: Measure, row: Row) -> float | None:
    record = measure.bytes_record(row)
    held = None if record is None else record.get("held_bytes")
    return None if held is None else held / MIB


def plots(table: Table, out: Path) -> list[Path]:
    """The plots of one table, named ``NAME{suffix}.png`` after its section (:attr:`Section.suffix`)."""
    made = []
    path = lambda name: out / f"{name}{table.section.suffix}.png"  # noqa: E731
    for task in TASKS:
        for curves in task.curves(table.rows):
            if _curves_plot(table, curves, path(curves.name)):
                made.append(path(curves.name))
        for measure in task.measures(table.rows):
            if _frontier_plot(table, measure, path(f"frontier_{measure.name}")):
                made.append(path(f"frontier_{measure.name}"))
    return made
