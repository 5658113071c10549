"""The report of a results folder: tables and plots, a table and a set of plots per section."""

from __future__ import annotations

import os
from pathlib import Path

from .plots import plots
from .render import csv_text, latex, markdown
from .sections import sections
from .style import Style
from .tables import details, tabulate


def _write(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)  # a reader never sees half a table


def write_report(out: Path, records: list[dict]) -> str:
    """Write ``summary.{md,csv,tex}``, ``recall.{md,csv}`` (each recall task, length and protocol)
    and the plots into ``out``, a table and a set of plots per section (:func:`sections`); return
    the Markdown summary."""
    parts = sections(records)
    tables = [tabulate(section) for section in parts]
    detailed = [table for table in (tabulate(section, details) for section in parts) if table.columns]
    style = Style.of_records(records)  # one colour and marker per family in every figure of the report
    pictures = [plots(table, out, style) for table in tables]
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
    if detailed:
        _write(out / "recall.md", "\n".join(markdown(table) for table in detailed))
        _write(out / "recall.csv", csv_text(*detailed))
    return text
