"""Tables (Markdown, CSV, LaTeX booktabs) and plots (PNG) from ``results.jsonl`` records alone.

Records are read back and checked (:mod:`.read`), split into sections of one setup and setting
and into rows of one policy run (:mod:`.sections`), tabulated with each task's columns and
ratios to the full cache (:mod:`.tables`), rendered (:mod:`.render`) and plotted (:mod:`.plots`);
:mod:`.write` writes them all.
"""

from .plots import moving_average, plots
from .read import read_results, record_problem
from .render import csv_text, latex, markdown
from .sections import Section, rows, sections
from .tables import Table, summarize, tabulate
from .write import write_report

__all__ = [
    "Section", "Table", "csv_text", "latex", "markdown", "moving_average", "plots", "read_results",
    "record_problem", "rows", "sections", "summarize", "tabulate", "write_report",
]
