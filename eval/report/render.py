"""Tables rendered: Markdown, CSV (every section's rows, each with its setting) and LaTeX booktabs.

Recall and QA cells give the mean and the half-width of a 95% bootstrap interval over the cells
(:mod:`eval.stats`). Figures measured with approximate chunking say so in every output: a ``*``
on the cell, the task in the CSV's ``approximate`` column.
"""

from __future__ import annotations

import csv
import io
import unicodedata
from dataclasses import dataclass

from ..stats import Interval
from ..tasks import Row
from .tables import Table

APPROXIMATE_NOTE = "approximate: chunked forwards change this policy's result (rerun with --chunk-size 1 for the streaming figure)"
MARK = "*"


@dataclass(frozen=True)
class Marks:
    """How a format writes the signs of a cell: plus-minus and times."""

    plus_minus: str
    times: str


MARKDOWN = Marks("±", "x")
LATEX = Marks(r"$\pm$", r"$\times$")


def _cell(value: float | None, ratio: float | None, digits: int, marks: Marks, approximate: bool, interval: Interval | None = None) -> str:
    if value is None:
        return ""
    text = f"{value:.{digits}f}"
    if interval is not None and interval.n > 1:
        text += f" {marks.plus_minus} {interval.half_width:.{digits}f}"
    text += MARK if approximate else ""
    return f"{text} ({ratio:.2f}{marks.times})" if ratio is not None else text


def _cells(table: Table, index: int, marks: Marks) -> list[str]:
    row = table.rows[index]
    return [
        _cell(value, ratio, column.digits, marks, column.approximate(row), interval)
        for value, ratio, column, interval in zip(table.values[index], table.ratios[index], table.columns, table.intervals[index])
    ]


def _any_approximate(table: Table) -> bool:
    return any(column.approximate(row) for row in table.rows for column in table.columns)


def markdown(table: Table) -> str:
    header = ["policy", *[column.title for column in table.columns]]
    lines = [f"_{table.caption}_", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for index, row in enumerate(table.rows):
        lines.append("| " + " | ".join([row.label(), *_cells(table, index, MARKDOWN)]) + " |")
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
            header += [name for name in (column.title, f"{column.title} vs full")[: 1 + column.ratio] if name not in header]
            if column.interval:
                header += [name for name in (f"{column.title} ci95 low", f"{column.title} ci95 high") if name not in header]
        for row, values, ratios, intervals in zip(table.rows, table.values, table.ratios, table.intervals):
            model, gguf, dataset, device, dtype = row.setup
            line = {
                "setting": table.section.number, "settings": table.section.describe(), "model": model + (f"/{gguf}" if gguf else ""),
                "dataset": dataset, "device": device, "dtype": dtype, "policy": row.label(),
                "approximate": ";".join(sorted({column.task for column in table.columns if column.approximate(row)})),
            }
            for value, ratio, interval, column in zip(values, ratios, intervals, table.columns):
                line[column.title] = _number(value)
                if column.ratio:
                    line[f"{column.title} vs full"] = _number(ratio)
                if column.interval:
                    line[f"{column.title} ci95 low"] = _number(interval.low if interval else None)
                    line[f"{column.title} ci95 high"] = _number(interval.high if interval else None)
            lines.append(line)
    header = [name for name in header if any(line.get(name) not in (None, "") for line in lines)]  # no column empty in every row
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, header, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(lines)
    return buffer.getvalue()


def _number(value: float | None) -> str:
    return "" if value is None else repr(round(value, 6))


_LATEX = {"\\": r"\textbackslash{}", "_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#", "$": r"\$", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _ascii(text: str) -> str:
    """``text`` in ASCII: accents dropped (``ü`` -> ``u``), ``±`` spelt ``+/-``, anything else ``?``."""
    folded = unicodedata.normalize("NFKD", text.replace("±", "+/-"))
    return "".join(char for char in folded if not unicodedata.combining(char)).encode("ascii", "replace").decode()


def _tex(text: str) -> str:
    return "".join(_LATEX.get(char, char) for char in _ascii(text))


def latex(table: Table) -> str:
    """A booktabs ``tabular`` in plain ASCII (compiles with pdfLaTeX and ``\\usepackage{booktabs}``
    alone), with the caption as a comment."""
    lines = [f"% {_ascii(table.caption)}", r"\begin{tabular}{l" + "r" * len(table.columns) + "}", r"\toprule"]
    lines.append(" & ".join(["Policy", *[_tex(column.title) for column in table.columns]]) + r" \\")
    lines.append(r"\midrule")
    for index, row in enumerate(table.rows):
        name = r"\texttt{" + _tex(row.label()) + "}"
        lines.append(" & ".join([name, *_cells(table, index, LATEX)]) + r" \\")
    lines.append(r"\bottomrule")
    lines.append(r"\end{tabular}")
    if _any_approximate(table):
        lines.append(f"% {MARK} " + APPROXIMATE_NOTE)
    return "\n".join(lines) + "\n"
