"""Tables (Markdown, CSV, LaTeX booktabs) and plots (PNG) from ``results.jsonl`` records alone.

One row per policy run (a spec at a budget or ratio; per setup: model, dataset, device, dtype,
when a file holds several), in the order of the sweep; each task's latest record fills its
columns. Every figure also comes as a ratio against the full cache of the same setup (the row
whose spec is ``full``, else the first ``full:...`` one); memory ratios are taken on the bytes
of the tokens held, the bytes allocated are shown beside them. Recall and QA cells give the
mean and the half-width of a 95% bootstrap interval over the cells (:mod:`eval.stats`).
Figures measured with approximate chunking say so in every output: a ``*`` on the cell, the
task in the CSV's ``approximate`` column, ``(approx.)`` in the legend.

Plots: perplexity by position (log scale, moving average, markers), memory along the stream
(held and allocated), decode latency, and a frontier per quality measure (quality against
budget or kept fraction, one line per family, unbounded caches as horizontal lines; and
quality against the KV bytes held).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import fields as f
from .protocols import PROTOCOLS
from .recall import parse_task
from .records import RECORD
from .stats import RESAMPLES, Interval, bootstrap

MIB = 2**20
SETUP = ("model", "gguf_file", "dataset", "device", "dtype")
APPROXIMATE_NOTE = "approximate: chunked forwards change this policy's result (rerun with --chunk-size 1 for the streaming figure)"
MARK = "*"


COMMON: f.Schema = {
    **{name: f.text for name in ("model", "dataset", "device", "dtype")},
    **{name: f.absent_or(f.optional(f.text)) for name in ("gguf_file", "family")},
    "label": f.absent_or(f.text),
    "policy_index": f.absent_or(f.count),
    "budget": f.absent_or(f.optional(f.count)),
    "bounded": f.absent_or(f.flag),
    "kept_tokens": f.absent_or(f.optional(f.count)),
    "kept_fraction": f.absent_or(f.optional(f.number)),
    "held_bytes": f.absent_or(f.optional(f.count)),
    "ratio": f.absent_or(f.optional(f.number)),
    "approximate": f.absent_or(f.flag),
    "protocol": f.absent_or(f.text),
    "protocols": f.absent_or(f.nonempty(f.text)),
    "built": f.absent_or(f.record_of({"class": f.text, "parameters": f.record_of({})})),
}
"""What the report reads from every record."""
PROMPTED: f.Schema = {}
TASK_FIELDS: dict[str, f.Schema] = {
    "perplexity": {"ppl": f.positive, "tokens": f.count, "curve_positions": f.nonempty(f.number), "curve_ppl": f.nonempty(f.positive)},
    "memory": {
        "held_bytes": f.optional(f.count), "footprint_bytes": f.count, "peak_memory_bytes": f.number,
        "footprint_positions": f.nonempty(f.number), "footprint_trace": f.items(f.number), "held_trace": f.items(f.optional(f.number)),
    },
    "speed": {"contexts": f.nonempty(f.count), **{key: f.items(f.positive) for key in ("prefill_ms", "median_ms", "p90_ms", "tokens_per_s")}},
    "recall": {**PROMPTED, "length": f.count, "cells": f.nonempty(f.record_of({"score": f.number}))},
    "qa": {**PROMPTED, "f1": f.number, "cells": f.nonempty(f.record_of({"exact_match": f.number, "f1": f.number}))},
}
"""What the report reads from the records of each task (recall: every task of the suite)."""
PAIRED = {
    "perplexity": ("curve_positions", "curve_ppl"),
    "memory": ("footprint_positions", "footprint_trace", "held_trace"),
    "speed": ("contexts", "prefill_ms", "median_ms", "p90_ms", "tokens_per_s"),
}


def record_problem(record: dict) -> str | None:
    """Why the report cannot use ``record`` (a field missing or of the wrong type), or ``None``."""
    if f.problem(record, RECORD):
        return f.problem(record, RECORD)
    task = record["task"]
    kind = task if task in TASK_FIELDS else "recall"
    if kind == "recall":
        try:
            parse_task(task)
        except ValueError:
            return f"task {task!r} is not one this report knows"
    found = f.problem(record, {**COMMON, **TASK_FIELDS[kind]}) or f.same_length(record, *PAIRED.get(kind, ()))
    if found is None and kind in ("recall", "qa") and not ({"protocol", "protocols"} & set(record)):
        found = "no 'protocol'"
    return None if found is None else f"{task} record of {record['policy']!r} has {found}"


@dataclass
class Row:
    setup: tuple
    policy: str
    index: int
    name: str = ""
    """The run's label: the spec, and the budget or ratio it was swept at."""
    records: dict[str, dict] = field(default_factory=dict)
    """The latest record of each stream measure (perplexity, memory, speed)."""
    recall: dict[tuple[str, int, str], dict] = field(default_factory=dict)
    """The latest record of each (recall task, length, protocol); a protocol-independent record
    under each protocol it stands for."""
    qa: dict[str, dict] = field(default_factory=dict)
    """The latest QA record of each protocol."""

    def approximate(self, task: str) -> bool:
        if task == "recall" or task.startswith("recall "):
            protocol = task.partition(" ")[2]
            return any(r.get("approximate") for (_, _, p), r in self.recall.items() if not protocol or p == protocol)
        return bool(self.records.get(task, {}).get("approximate"))

    def label(self, task: str | None = None) -> str:
        return (self.name or self.policy) + (" (approx.)" if task is not None and self.approximate(task) else "")

    def any_record(self) -> dict:
        return next(iter([*self.records.values(), *self.recall.values(), *self.qa.values()]), {})

    @property
    def budget(self) -> int | None:
        """The most tokens a governed layer keeps (``None``: unbounded); for a bounded policy whose
        budget is known only once it runs (fractions of the prompt), the tokens it kept."""
        record = self.any_record()
        if record.get("budget") is None and record.get("bounded"):
            return record.get("kept_tokens")
        return record.get("budget")

    @property
    def family(self) -> str:
        return self.any_record().get("family") or self.policy.partition(":")[0]


@dataclass(frozen=True)
class Column:
    title: str
    task: str
    value: Callable[[Row], float | None]
    digits: int
    interval: Callable[[Row], Interval | None] | None = None
    """A 95% interval shown after the value (recall: bootstrap over the cells)."""
    ratio: bool = True
    """Whether the cell also shows the ratio to the full cache."""


def setup_label(setup: tuple) -> str:
    model, gguf, dataset, device, dtype = setup
    return f"{model}{'/' + gguf if gguf else ''}, {dataset}, {device} {dtype}"


SWEPT = ("budget", "ratio")
"""Params that vary from row to row of one table: the sweep's budget or ratio."""
DIMENSIONS = {"recall": ("length", "protocol", "protocols"), "qa": ("protocol", "protocols"), "speed": ("contexts",)}
"""Params that a task's table shows as columns of their own (each column one value of them)."""


def kind_of(record: dict) -> str:
    """The task whose columns show a record: its own, or ``recall`` for every task of the suite."""
    return record["task"] if record["task"] in TASK_FIELDS else "recall"


def setting_of(record: dict) -> dict:
    """The params a record's figure depends on that are the same in every row and column of a
    table: its setting (``--tokens``, ``--depths``, ``--seeds``, ``--chunk-size``...)."""
    shown = SWEPT + DIMENSIONS.get(kind_of(record), ())
    return {key: value for key, value in sorted(record["params"].items()) if key not in shown}


@dataclass
class Section:
    """The records of one setup (model, dataset, device, dtype) and one setting per task: what
    one table and one set of plots may hold, so that no figure is set beside one measured
    under other settings."""

    number: int
    setup: tuple
    settings: dict[str, dict]
    """Each task's setting (:func:`setting_of`)."""
    records: list[dict] = field(default_factory=list)

    @property
    def suffix(self) -> str:
        """What the file names of this section's plots end with: nothing for the first."""
        return "" if self.number == 1 else f"-{self.number}"

    def describe(self) -> str:
        """``"perplexity, memory: chunk_size=auto, tokens=64; passkey: ..."``: the settings in words."""
        grouped: dict[str, list[str]] = {}
        for kind, setting in self.settings.items():
            text = ", ".join(f"{key}={_plain(value)}" for key, value in setting.items()) or "no settings"
            grouped.setdefault(text, []).append(kind)
        return "; ".join(f"{', '.join(kinds)}: {text}" for text, kinds in grouped.items())


def _plain(value: object) -> str:
    return "/".join(map(str, value)) if isinstance(value, list) else str(value)


def sections(records: list[dict]) -> list[Section]:
    """The records split by setup and setting, in the order first seen. Within a setup, the
    first setting of each task goes to its first section, the second to the second, and so on: a
    run of the sweep with other ``--tokens`` makes a section of its own, holding just its own
    figures beside the full cache measured with them."""
    found: dict[tuple, dict[str, list[str]]] = {}
    placed: list[tuple[tuple, int, str, dict, dict]] = []
    for record in records:
        setup = tuple(record.get(name) for name in SETUP)
        kind, setting = kind_of(record), setting_of(record)
        known = found.setdefault(setup, {}).setdefault(kind, [])
        key = json.dumps(setting, sort_keys=True)
        if key not in known:
            known.append(key)
        placed.append((setup, known.index(key), kind, setting, record))
    by_key: dict[tuple, Section] = {}
    for setup, index, kind, setting, record in placed:
        section = by_key.setdefault((setup, index), Section(0, setup, {}))
        section.settings.setdefault(kind, setting)
        section.records.append(record)
    ordered = sorted(by_key.items(), key=lambda item: (list(found).index(item[0][0]), item[0][1]))
    for number, (_, section) in enumerate(ordered, start=1):
        section.number = number
    return [section for _, section in ordered]


def rows(records: list[dict]) -> list[Row]:
    """Rows in sweep order (setup first seen, then the run's index); later records win."""
    by_key: dict[tuple, Row] = {}
    setups: list[tuple] = []
    for record in records:
        setup = tuple(record.get(name) for name in SETUP)
        if setup not in setups:
            setups.append(setup)
        name = record.get("label", record["policy"])
        row = by_key.setdefault((setup, name), Row(setup, record["policy"], record.get("policy_index", 0), name))
        task = record["task"]
        if task == "qa":
            for protocol in record.get("protocols", [record.get("protocol")]):
                row.qa[protocol] = record
        elif "length" in record.get("params", {}):
            for protocol in record.get("protocols", [record.get("protocol")]):
                row.recall[(task, record["length"], protocol)] = record
        else:
            row.records[task] = record
    return sorted(by_key.values(), key=lambda row: (setups.index(row.setup), row.index, row.name))


def protocols_of(table_rows: list[Row]) -> list[str]:
    found = {p for row in table_rows for (_, _, p) in row.recall} | {p for row in table_rows for p in row.qa}
    return [p for p in PROTOCOLS if p in found]


def recall_cells(row: Row, protocol: str, task: str | None = None, length: int | None = None) -> list[float]:
    """The scores of every recall cell of a row under a protocol (of one task and length if given)."""
    return [
        cell["score"]
        for (t, n, p), record in row.recall.items()
        if p == protocol and task in (None, t) and length in (None, n)
        for cell in record["cells"]
    ]


def suite_cells(table_rows: list[Row], protocol: str, task: str | None = None) -> Callable[[Row], list[float]]:
    """:func:`recall_cells` over several tasks or lengths, for the rows that have every (task,
    length) that some row of the table has under ``protocol``; none for the others, so that no
    mean over other cells is set beside theirs."""

    def keys(row: Row) -> set[tuple[str, int]]:
        return {(t, n) for (t, n, p) in row.recall if p == protocol and task in (None, t)}

    wanted = set().union(*map(keys, table_rows))
    return lambda row: recall_cells(row, protocol, task) if keys(row) == wanted else []


def _interval(cells: Callable[[Row], list[float]]) -> Callable[[Row], Interval | None]:
    def interval(row: Row) -> Interval | None:
        values = cells(row)
        return bootstrap(values) if values else None

    return interval


def _mean_of(cells: Callable[[Row], list[float]]) -> Callable[[Row], float | None]:
    def mean(row: Row) -> float | None:
        values = cells(row)
        return sum(values) / len(values) if values else None

    return mean


def baseline(candidates: list[Row]) -> Row | None:
    exact = [row for row in candidates if row.policy == "full"]
    named = [row for row in candidates if row.policy.partition(":")[0] == "full"]
    return (exact or named or [None])[0]


def _get(task: str, key: str, scale: float = 1.0, at: int | None = None) -> Callable[[Row], float | None]:
    def value(row: Row) -> float | None:
        record = row.records.get(task)
        if record is None:
            return None
        figure = record[key]
        if at is not None:
            contexts = record["contexts"]
            if at not in contexts:
                return None
            figure = figure[contexts.index(at)]
        return None if figure is None else figure / scale

    return value


def columns(table_rows: list[Row]) -> list[Column]:
    """The columns the records support: only tasks that were measured get theirs."""
    tasks = {task for row in table_rows for task in row.records}
    chosen = []
    if any(row.budget is not None for row in table_rows):
        chosen.append(Column("budget", "budget", lambda row: row.budget, 0, ratio=False))
    if "perplexity" in tasks:
        chosen.append(Column("PPL", "perplexity", _get("perplexity", "ppl"), 3))
    if "memory" in tasks:
        chosen.append(Column("KV held MiB", "memory", _get("memory", "held_bytes", MIB), 2))
        chosen.append(Column("KV allocated MiB", "memory", _get("memory", "footprint_bytes", MIB), 2, ratio=False))
        chosen.append(Column("peak MiB", "memory", _get("memory", "peak_memory_bytes", MIB), 1))
    if "speed" in tasks:
        contexts = sorted({c for row in table_rows if "speed" in row.records for c in row.records["speed"]["contexts"]})
        largest = contexts[-1]
        chosen.append(Column(f"prefill ms @{largest}", "speed", _get("speed", "prefill_ms", at=largest), 1))
        for context in contexts:
            chosen.append(Column(f"decode ms @{context}", "speed", _get("speed", "median_ms", at=context), 2))
        chosen.append(Column(f"p90 ms @{largest}", "speed", _get("speed", "p90_ms", at=largest), 2))
        chosen.append(Column(f"tok/s @{largest}", "speed", _get("speed", "tokens_per_s", at=largest), 1))
    for protocol in protocols_of(table_rows):
        if any(p == protocol for row in table_rows for (_, _, p) in row.recall):
            cells = suite_cells(table_rows, protocol)
            chosen.append(Column(f"recall {protocol}", f"recall {protocol}", _mean_of(cells), 2, _interval(cells)))
        if any(protocol in row.qa for row in table_rows):
            for key, title in (("exact_match", "QA EM"), ("f1", "QA F1")):
                cells = lambda row, protocol=protocol, key=key: [c[key] for c in row.qa[protocol]["cells"]] if protocol in row.qa else []  # noqa: E731
                chosen.append(Column(f"{title} {protocol}", "qa", _mean_of(cells), 2, _interval(cells)))
    return chosen


def recall_columns(table_rows: list[Row]) -> list[Column]:
    """One column per recall task, length and protocol (the detail behind the suite's mean)."""
    keys = sorted({key for row in table_rows for key in row.recall}, key=lambda k: (PROTOCOLS.index(k[2]) if k[2] in PROTOCOLS else 9, k[1], k[0]))
    chosen = []
    for task, length, protocol in keys:
        cells = lambda row, t=task, n=length, p=protocol: recall_cells(row, p, t, n)  # noqa: E731
        chosen.append(Column(f"{task} @{length} {protocol}", f"recall {protocol}", _mean_of(cells), 2, _interval(cells)))
    return chosen


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


def summarize(records: list[dict], choose: Callable[[list[Row]], list[Column]] = columns) -> Table:
    """The table of records of one section (:func:`sections`); ``ValueError`` for records of
    several, which no table may set side by side."""
    parts = sections(records)
    if len(parts) > 1:
        raise ValueError(f"the records hold {len(parts)} settings ({' | '.join(f'{setup_label(part.setup)}: {part.describe()}' for part in parts)}): tabulate each of sections(records)")
    return tabulate(parts[0] if parts else Section(1, (None,) * len(SETUP), {}), choose)


def tabulate(section: Section, choose: Callable[[list[Row]], list[Column]] = columns) -> Table:
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


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def _caption(section: Section, table_rows: list[Row], has_base: bool, cols: list[Column]) -> str:
    parts = [setup_label(section.setup), section.describe()] if section.settings else []
    if any(column.title == "KV held MiB" for column in cols):
        parts.append("KV held = keys and values of the tokens kept, KV allocated = every tensor the cache holds (spare capacity and bookkeeping included); memory ratios are on bytes held")
    recall = [row.recall for row in table_rows if row.recall]
    if recall:
        lengths = sorted({n for keys in recall for (_, n, _) in keys})
        tasks = sorted({t for keys in recall for (t, _, _) in keys})
        parts.append(f"recall = RULER string-match score, mean over the cells of {', '.join(tasks)} at {lengths} tokens")
    if any(column.interval for column in cols):
        parts.append(f"± = half-width of the 95% percentile-bootstrap interval over the cells ({RESAMPLES} resamples)")
    parts.append("(x) = ratio to the full cache" if has_base else "no full cache in the sweep, so no ratios")
    return "; ".join(parts)


def _cell(value: float | None, ratio: float | None, digits: int, times: str, approximate: bool, interval: Interval | None = None) -> str:
    if value is None:
        return ""
    text = f"{value:.{digits}f}"
    if interval is not None and interval.n > 1:
        text += f" ± {interval.half_width:.{digits}f}"
    text += MARK if approximate else ""
    return f"{text} ({ratio:.2f}{times})" if ratio is not None else text


def _cells(table: Table, index: int, times: str) -> list[str]:
    row = table.rows[index]
    return [
        _cell(value, ratio, column.digits, times, row.approximate(column.task), interval)
        for value, ratio, column, interval in zip(table.values[index], table.ratios[index], table.columns, table.intervals[index])
    ]


def _any_approximate(table: Table) -> bool:
    return any(row.approximate(column.task) for row in table.rows for column in table.columns)


def markdown(table: Table) -> str:
    header = ["policy", *[column.title for column in table.columns]]
    lines = [f"_{table.caption}_", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for index, row in enumerate(table.rows):
        lines.append("| " + " | ".join([row.label(), *_cells(table, index, "x")]) + " |")
    if _any_approximate(table):
        lines += ["", f"{MARK} {APPROXIMATE_NOTE}"]
    built = [f"- `{row.label()}`: {text}" for row in table.rows if (text := built_as(row))]
    if built:
        lines += ["", "Built as (class and the keywords its spec resolved to):", *built]
    return "\n".join(lines) + "\n"


def built_as(row: Row) -> str | None:
    """``"SnapKVCache(budget=32, window=8)"``: what a row's records say its cache was built as."""
    built = row.any_record().get("built")
    if built is None:
        return None
    keywords = ", ".join(f"{key}={value}" for key, value in built["parameters"].items())
    return f"{built['class']}({keywords})"


def csv_text(*tables: Table) -> str:
    """One CSV of the rows of every table, each row with its setting (the section's number and
    its settings in words) and its ratios to the full cache of its own table."""
    header = ["setting", "settings", "model", "dataset", "device", "dtype", "policy", "approximate"]
    lines = []
    for table in tables:
        for column in table.columns:
            header += [name for name in (column.title, f"{column.title} vs full") if name not in header]
            if column.interval:
                header += [name for name in (f"{column.title} ci95 low", f"{column.title} ci95 high") if name not in header]
        for row, values, ratios, intervals in zip(table.rows, table.values, table.ratios, table.intervals):
            model, gguf, dataset, device, dtype = row.setup
            approximate = ";".join(sorted({column.task for column in table.columns if row.approximate(column.task)}))
            line = {
                "setting": table.section.number, "settings": table.section.describe(), "model": model + (f"/{gguf}" if gguf else ""),
                "dataset": dataset, "device": device, "dtype": dtype, "policy": row.label(), "approximate": approximate,
            }
            for value, ratio, interval, column in zip(values, ratios, intervals, table.columns):
                line[column.title], line[f"{column.title} vs full"] = _number(value), _number(ratio)
                if column.interval:
                    line[f"{column.title} ci95 low"] = _number(interval.low if interval else None)
                    line[f"{column.title} ci95 high"] = _number(interval.high if interval else None)
            lines.append(line)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(lines)
    return buffer.getvalue()


def _number(value: float | None) -> str:
    return "" if value is None else repr(round(value, 6))


_LATEX = {"\\": r"\textbackslash{}", "_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#", "$": r"\$", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _tex(text: str) -> str:
    return "".join(_LATEX.get(char, char) for char in text)


def latex(table: Table) -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``), with the caption as a comment."""
    lines = [f"% {table.caption}", r"\begin{tabular}{l" + "r" * len(table.columns) + "}", r"\toprule"]
    lines.append(" & ".join(["Policy", *[_tex(column.title) for column in table.columns]]) + r" \\")
    lines.append(r"\midrule")
    for index, row in enumerate(table.rows):
        name = r"\texttt{" + _tex(row.label()) + "}"
        lines.append(" & ".join([name, *_cells(table, index, r"$\times$")]) + r" \\")
    lines.append(r"\bottomrule")
    lines.append(r"\end{tabular}")
    if _any_approximate(table):
        lines.append(f"% {MARK} " + APPROXIMATE_NOTE)
    return "\n".join(lines) + "\n"


# --- plots ------------------------------------------------------------------------------
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


def _perplexity_plot(table: Table, path: Path) -> bool:
    plotted = [row for row in table.rows if "perplexity" in row.records]
    if not plotted:
        return False
    figure = _figure()
    axes = figure.add_subplot()
    for i, row in enumerate(plotted):
        record = row.records["perplexity"]
        smooth = moving_average(record["curve_ppl"])
        axes.plot(record["curve_positions"], smooth, label=row.label("perplexity"), markevery=max(1, len(smooth) // 8), **_style(i))
    axes.set_yscale("log")
    axes.set_xlabel("tokens")
    axes.set_ylabel("perplexity per bin, moving average of 5 (log scale)")
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=7)
    figure.savefig(path)
    return True


def _trace_plot(table: Table, task: str, x: str, series: list[tuple[str, str]], scale: float, xlabel: str, ylabel: str, path: Path) -> bool:
    """One line per row and series (e.g. bytes held solid, allocated dotted), markers per row."""
    plotted = [row for row in table.rows if task in row.records]
    if not plotted:
        return False
    figure = _figure()
    axes = figure.add_subplot()
    for i, row in enumerate(plotted):
        record = row.records[task]
        style = _style(i)
        for j, (key, name) in enumerate(series):
            if record.get(key) is None or None in record[key]:
                continue
            style = {**style, "linestyle": LINESTYLES[j]}
            label = row.label(task) + (f" ({name})" if name else "")
            axes.plot(record[x], [value / scale for value in record[key]], label=label, markevery=max(1, len(record[x]) // 8), **style)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.savefig(path)
    return True


@dataclass(frozen=True)
class Measure:
    """A quality measure of the frontier plots: its name, its value for a row, its axis label."""

    name: str
    value: Callable[[Row], float | None]
    ylabel: str
    bytes_task: Callable[[Row], dict | None]
    """The record whose ``held_bytes`` is that measure's memory."""


def measures(table_rows: list[Row]) -> list[Measure]:
    """Every quality measure the records hold: the perplexity ratio to full, each recall task and
    the suite's mean under each protocol, QA F1 under each protocol."""
    found = []
    if any("perplexity" in row.records for row in table_rows):
        def ppl_ratio(row: Row) -> float | None:
            base = baseline(table_rows)
            if "perplexity" not in row.records or base is None or "perplexity" not in base.records:
                return None
            return row.records["perplexity"]["ppl"] / base.records["perplexity"]["ppl"]

        found.append(Measure("ppl_ratio", ppl_ratio, "perplexity / full cache's (lower is better)", lambda row: row.records.get("perplexity")))
    for protocol in protocols_of(table_rows):
        keys = sorted({(t, n) for row in table_rows for (t, n, p) in row.recall if p == protocol})
        if keys:
            found.append(Measure(
                f"recall_mean_{protocol}", _mean_of(suite_cells(table_rows, protocol)),
                f"recall suite mean, {protocol} (higher is better)",
                lambda row, p=protocol: next((r for (_, _, q), r in row.recall.items() if q == p), None),
            ))
        for task in sorted({t for t, _ in keys}):
            found.append(Measure(
                f"{task}_{protocol}", _mean_of(suite_cells(table_rows, protocol, task)),
                f"{task} score, {protocol} (higher is better)",
                lambda row, t=task, p=protocol: next((r for (u, _, q), r in row.recall.items() if q == p and u == t), None),
            ))
        if any(protocol in row.qa for row in table_rows):
            found.append(Measure(
                f"qa_f1_{protocol}", lambda row, p=protocol: row.qa[p]["f1"] if p in row.qa else None,
                f"QA token F1, {protocol} (higher is better)", lambda row, p=protocol: row.qa.get(p),
            ))
    return found


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
        label = family
        if line:
            left.plot([x for x, _ in line], [v for _, v in line], label=label, **_style(i))
        held = sorted((_held_mib(measure, row), value) for row, value in members if _held_mib(measure, row) is not None)
        if held:
            right.plot([x for x, _ in held], [v for _, v in held], label=label, **_style(i))
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
    record = measure.bytes_task(row)
    return None if record is None else record.get("kept_fraction")


def _held_mib(measure: Measure, row: Row) -> float | None:
    record = measure.bytes_task(row)
    held = None if record is None else record.get("held_bytes")
    return None if held is None else held / MIB


def plots(table: Table, out: Path) -> list[Path]:
    """The plots of one table, named ``NAME{suffix}.png`` after its section (:attr:`Section.suffix`)."""
    made = []
    path = lambda name: out / f"{name}{table.section.suffix}.png"  # noqa: E731
    if _perplexity_plot(table, path("perplexity")):
        made.append(path("perplexity"))
    memory = [("held_trace", "held"), ("footprint_trace", "allocated")]
    if _trace_plot(table, "memory", "footprint_positions", memory, MIB, "tokens", "KV cache (MiB): held solid, allocated dashed", path("memory")):
        made.append(path("memory"))
    if _trace_plot(table, "speed", "contexts", [("median_ms", "")], 1, "context (tokens)", "decode ms/token (median)", path("latency")):
        made.append(path("latency"))
    for measure in measures(table.rows):
        if _frontier_plot(table, measure, path(f"frontier_{measure.name}")):
            made.append(path(f"frontier_{measure.name}"))
    return made


def _write(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)  # a reader never sees half a table


def write_report(out: Path, records: list[dict]) -> str:
    """Write ``summary.{md,csv,tex}``, ``recall.{md,csv}`` (per task, length and protocol) and the
    plots into ``out``, a table and a set of plots per section (:func:`sections`); return the
    Markdown summary."""
    parts = sections(records)
    tables = [tabulate(section) for section in parts]
    details = [tabulate(section, recall_columns) for section in parts]
    pictures = [plots(table, out) for table in tables]
    texts = [markdown(table) for table in tables]
    if len(parts) > 1:
        texts = [
            f"## Setting {section.number} of {len(parts)}\n\n{text}\nPlots: {', '.join(path.name for path in made) or 'none'}\n"
            for section, text, made in zip(parts, texts, pictures)
        ]
    text = "\n".join(texts)
    _write(out / "summary.md", text)
    _write(out / "summary.csv", csv_text(*tables))
    _write(out / "summary.tex", "\n".join(latex(table) for table in tables))
    detailed = [table for table in details if table.columns]
    if detailed:
        _write(out / "recall.md", "\n".join(markdown(table) for table in detailed))
        _write(out / "recall.csv", csv_text(*detailed))
    return text
