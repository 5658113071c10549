"""Reading a results folder back: the records of ``results.jsonl`` and those tasks import from
other harnesses' files, each checked for every field the report reads (:mod:`eval.fields`)."""

from __future__ import annotations

from pathlib import Path

from .. import fields as f
from ..records import RECORD, RESULTS, Warn, read_records
from ..tasks import TASKS, task_for

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
    "created": f.absent_or(f.text),
}
"""What the report reads from every record, whatever its task."""


def _place(value: object) -> str | None:
    """A param a table keys records by (a recall length, a protocol): a number or a string."""
    return f.text(value) and f.number(value)


def record_problem(record: dict) -> str | None:
    """Why the report cannot use ``record`` (not a record of a known task, a field missing or of
    the wrong type), or ``None``."""
    found = f.problem(record, RECORD)
    if found:
        return found
    name = record["task"]
    try:
        task = task_for(name)
        task.check_name(name)
    except ValueError:
        return f"task {name!r} is not one this report knows"
    found = (
        f.problem(record, {**COMMON, **task.fields})
        or f.same_length(record, *task.paired)
        or f.problem(record["params"], {dimension: _place for dimension in task.dimensions})
    )
    if found is None and task.prompted and not ({"protocol", "protocols"} & set(record)):
        found = "no 'protocol'"
    return None if found is None else f"{name} record of {record['policy']!r} has {found}"


def read_results(folder: Path, warn: Warn | None = None) -> list[dict]:
    """The usable records of a results folder: ``results.jsonl``'s, then those each task imports
    (:meth:`Task.import_records`); ``warn`` is told of each one skipped and why."""
    records = read_records(folder / RESULTS, warn, record_problem)
    for task in TASKS:
        for record in task.import_records(folder):
            problem = record_problem(record) if isinstance(record, dict) else "not a record"
            if problem is None:
                records.append(record)
            elif warn is not None:
                warn(f"{task.name} import from {folder}: {problem}: skipped")
    return records
