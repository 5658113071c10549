"""Tables (Markdown, CSV, LaTeX booktabs) and plots (PNG) from ``results.jsonl`` records alone.

One row per policy (per setup: model, dataset, device, dtype, when a file holds several), in
the order of the sweep; each task's latest record fills its columns. Every figure also comes
as a ratio against the full cache of the same setup (the row whose spec is ``full``, else the
first ``full:...`` one). Figures measured with approximate chunking say so in every output:
a ``*`` on the cell, the task in the CSV's ``approximate`` column, ``(approx.)`` in the legend.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20
SETUP = ("model", "gguf_file", "dataset", "device", "dtype")
APPROXIMATE_NOTE = "approximate: chunked forwards change this policy's result (rerun with --chunk-size 1 for the streaming figure)"
MARK = "*"


@dataclass
class Row:
    setup: tuple
    policy: str
    index: int
    records: dict[str, dict] = field(default_factory=dict)

    def approximate(self, task: str) -> bool:
        return bool(self.records.get(task, {}).get("approximate"))

    def label(self, with_setup: bool = False, task: str | None = None) -> str:
        text = self.policy + (" (approx.)" if task is not None and self.approximate(task) else "")
        return f"{setup_label(self.setup)} | {text}" if with_setup else text


@dataclass(frozen=True)
class Column:
    title: str
    task: str
    value: Callable[[Row], float | None]
    digits: int


def setup_label(setup: tuple) -> str:
    model, gguf, dataset, device, dtype = setup
    return f"{model}{'/' + gguf if gguf else ''}, {dataset}, {device} {dtype}"


def rows(records: list[dict]) -> list[Row]:
    """Rows in sweep order (setup first seen, then the policy's index); later records win."""
    by_key: dict[tuple, Row] = {}
    setups: list[tuple] = []
    for record in records:
        setup = tuple(record.get(name) for name in SETUP)
        if setup not in setups:
            setups.append(setup)
        key = (setup, record["policy"])
        row = by_key.setdefault(key, Row(setup, record["policy"], record.get("policy_index", 0)))
        row.records[record["task"]] = record
    return sorted(by_key.values(), key=lambda row: (setups.index(row.setup), row.index, row.policy))


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
        return figure / scale

    return value


def columns(table_rows: list[Row]) -> list[Column]:
    """The columns the records support: only tasks that were measured get theirs."""
    tasks = {task for row in table_rows for task in row.records}
    chosen = []
    if "perplexity" in tasks:
        chosen.append(Column("PPL", "perplexity", _get("perplexity", "ppl"), 3))
    if "memory" in tasks:
        chosen.append(Column("KV cache MiB", "memory", _get("memory", "footprint_bytes", MIB), 2))
        chosen.append(Column("peak MiB", "memory", _get("memory", "peak_memory_bytes", MIB), 1))
    if "speed" in tasks:
        contexts = sorted({c for row in table_rows if "speed" in row.records for c in row.records["speed"]["contexts"]})
        largest = contexts[-1]
        chosen.append(Column(f"prefill ms @{largest}", "speed", _get("speed", "prefill_ms", at=largest), 1))
        for context in contexts:
            chosen.append(Column(f"decode ms @{context}", "speed", _get("speed", "median_ms", at=context), 2))
        chosen.append(Column(f"p90 ms @{largest}", "speed", _get("speed", "p90_ms", at=largest), 2))
        chosen.append(Column(f"tok/s @{largest}", "speed", _get("speed", "tokens_per_s", at=largest), 1))
    if "passkey" in tasks:
        chosen.append(Column("passkey acc", "passkey", _get("passkey", "accuracy"), 2))
    return chosen


@dataclass
class Table:
    """Values and ratios, ready to render in any format."""

    columns: list[Column]
    rows: list[Row]
    values: list[list[float | None]]
    ratios: list[list[float | None]]
    with_setup: bool
    caption: str


def summarize(records: list[dict]) -> Table:
    table_rows = rows(records)
    cols = columns(table_rows)
    values = [[column.value(row) for column in cols] for row in table_rows]
    ratios = []
    for row, row_values in zip(table_rows, values):
        base = baseline([other for other in table_rows if other.setup == row.setup])
        base_values = values[table_rows.index(base)] if base is not None else [None] * len(cols)
        ratios.append([_ratio(value, reference) for value, reference in zip(row_values, base_values)])
    setups = list(dict.fromkeys(row.setup for row in table_rows))
    has_base = any(baseline([row for row in table_rows if row.setup == setup]) for setup in setups)
    return Table(cols, table_rows, values, ratios, len(setups) > 1, _caption(table_rows, setups, has_base))


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def _caption(table_rows: list[Row], setups: list[tuple], has_base: bool) -> str:
    parts = [setup_label(setup) for setup in setups] if len(setups) == 1 else []
    first = table_rows[0].records if table_rows else {}
    if "perplexity" in first:
        parts.append(f"{first['perplexity']['tokens']} tokens of streaming perplexity")
    if "passkey" in first:
        params = first["passkey"]["params"]
        parts.append(f"passkey lengths {params['lengths']} x depths {params['depths']}")
    parts.append("(x) = ratio to the full cache" if has_base else "no full cache in the sweep, so no ratios")
    return "; ".join(parts)


def _cell(value: float | None, ratio: float | None, digits: int, times: str, approximate: bool) -> str:
    if value is None:
        return ""
    text = f"{value:.{digits}f}" + (MARK if approximate else "")
    return f"{text} ({ratio:.2f}{times})" if ratio is not None else text


def _cells(table: Table, index: int, times: str) -> list[str]:
    row = table.rows[index]
    return [
        _cell(value, ratio, column.digits, times, row.approximate(column.task))
        for value, ratio, column in zip(table.values[index], table.ratios[index], table.columns)
    ]


def _any_approximate(table: Table) -> bool:
    return any(row.approximate(task) for row in table.rows for task in row.records)


def markdown(table: Table) -> str:
    header = ["policy", *[column.title for column in table.columns]]
    lines = [f"_{table.caption}_", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for index, row in enumerate(table.rows):
        lines.append("| " + " | ".join([row.label(table.with_setup), *_cells(table, index, "x")]) + " |")
    if _any_approximate(table):
        lines += ["", f"{MARK} {APPROXIMATE_NOTE}"]
    return "\n".join(lines) + "\n"


def csv_text(table: Table) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    header = ["model", "dataset", "device", "dtype", "policy", "approximate"]
    for column in table.columns:
        header += [column.title, f"{column.title} vs full"]
    writer.writerow(header)
    for row, values, ratios in zip(table.rows, table.values, table.ratios):
        model, gguf, dataset, device, dtype = row.setup
        approximate = ";".join(sorted(task for task in row.records if row.approximate(task)))
        line = [model + (f"/{gguf}" if gguf else ""), dataset, device, dtype, row.policy, approximate]
        for value, ratio in zip(values, ratios):
            line += ["" if value is None else repr(round(value, 6)), "" if ratio is None else repr(round(ratio, 6))]
        writer.writerow(line)
    return buffer.getvalue()


_LATEX = {"\\": r"\textbackslash{}", "_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#", "$": r"\$", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _tex(text: str) -> str:
    return "".join(_LATEX.get(char, char) for char in text)


def latex(table: Table) -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``), with the caption as a comment."""
    lines = [f"% {table.caption}", r"\begin{tabular}{l" + "r" * len(table.columns) + "}", r"\toprule"]
    lines.append(" & ".join(["Policy", *[_tex(column.title) for column in table.columns]]) + r" \\")
    lines.append(r"\midrule")
    for index, row in enumerate(table.rows):
        name = r"\texttt{" + _tex(row.policy) + "}"
        if table.with_setup:
            name = _tex(setup_label(row.setup)) + ": " + name
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


def _line_plot(table: Table, task: str, x: str, y: str, scale: float, xlabel: str, ylabel: str, path: Path) -> bool:
    plotted = [row for row in table.rows if task in row.records]
    if not plotted:
        return False
    figure = _figure()
    axes = figure.add_subplot()
    for row in plotted:
        record = row.records[task]
        marker = "o" if len(record[x]) <= 24 else None  # a chunked stream has one point per chunk
        axes.plot(record[x], [value / scale for value in record[y]], label=row.label(table.with_setup, task), marker=marker, markersize=4)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path)
    return True


def _passkey_plot(table: Table, path: Path) -> bool:
    plotted = [row for row in table.rows if "passkey" in row.records]
    if not plotted:
        return False
    figure = _figure(2.6 * len(plotted) + 1.2, 3.2)
    image = None
    for i, row in enumerate(plotted):
        cells = row.records["passkey"]["cells"]
        lengths = sorted({cell["length"] for cell in cells})
        depths = sorted({cell["depth"] for cell in cells})
        grid = [[_mean([c["correct"] for c in cells if c["length"] == n and c["depth"] == d]) for n in lengths] for d in depths]
        axes = figure.add_subplot(1, len(plotted), i + 1)
        image = axes.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        for di, values in enumerate(grid):
            for li, value in enumerate(values):
                axes.text(li, di, f"{value:.0%}", ha="center", va="center", fontsize=8)
        axes.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        axes.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        axes.set_xlabel("context (tokens)")
        if i == 0:
            axes.set_ylabel("needle depth")
        axes.set_title(row.label(table.with_setup, "passkey"), fontsize=8)
    figure.colorbar(image, ax=figure.axes, label="accuracy")
    figure.savefig(path)
    return True


def _mean(values: list[bool]) -> float:
    return sum(values) / len(values) if values else float("nan")


def plots(table: Table, out: Path) -> list[Path]:
    made = []
    specs = [
        ("perplexity.png", "perplexity", "curve_positions", "curve_ppl", 1, "tokens", "perplexity (per bin)"),
        ("memory.png", "memory", "footprint_positions", "footprint_trace", MIB, "tokens", "KV cache (MiB)"),
        ("latency.png", "speed", "contexts", "median_ms", 1, "context (tokens)", "decode ms/token (median)"),
    ]
    for name, task, x, y, scale, xlabel, ylabel in specs:
        if _line_plot(table, task, x, y, scale, xlabel, ylabel, out / name):
            made.append(out / name)
    if _passkey_plot(table, out / "passkey.png"):
        made.append(out / "passkey.png")
    return made


def _write(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)  # a reader never sees half a table


def write_report(out: Path, records: list[dict]) -> str:
    """Write ``summary.{md,csv,tex}`` and the plots into ``out``; return the Markdown table."""
    table = summarize(records)
    text = markdown(table)
    _write(out / "summary.md", text)
    _write(out / "summary.csv", csv_text(table))
    _write(out / "summary.tex", latex(table))
    plots(table, out)
    return text
