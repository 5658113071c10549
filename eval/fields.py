"""Checks of a record's fields: what the report reads must have the type it reads.

A record that fails one is skipped with a warning that names the field, so that a damaged or
hand-edited ``results.jsonl`` costs its bad lines, never the report (and never a traceback).
A check is a function that returns what is wrong with a value, or ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Check = Callable[[object], "str | None"]
Schema = dict[str, Check]


def _shown(value: object) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def number(value: object) -> str | None:
    """A finite int or float (not a boolean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"is {_shown(value)}, not a finite number"
    return None


def positive(value: object) -> str | None:
    """A finite number above zero (a perplexity, a time: plotted on log scales)."""
    problem = number(value)
    return problem or (None if value > 0 else f"is {_shown(value)}, not above zero")


def count(value: object) -> str | None:
    """An integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"is {_shown(value)}, not a count"
    return None


def text(value: object) -> str | None:
    return None if isinstance(value, str) else f"is {_shown(value)}, not a string"


def flag(value: object) -> str | None:
    return None if isinstance(value, bool) else f"is {_shown(value)}, not true or false"


def optional(check: Check) -> Check:
    """``None`` or what ``check`` accepts."""
    return lambda value: None if value is None else check(value)


def absent_or(check: Check) -> Check:
    """A field that older records may lack: checked only where present (see :func:`problem`)."""

    def checked(value: object) -> str | None:
        return check(value)

    checked.absent_ok = True  # type: ignore[attr-defined]
    return checked


def items(check: Check) -> Check:
    """A list whose every item passes ``check``."""

    def checked(value: object) -> str | None:
        if not isinstance(value, list):
            return f"is {_shown(value)}, not a list"
        for index, item in enumerate(value):
            problem = check(item)
            if problem:
                return f"item {index} {problem}"
        return None

    return checked


def nonempty(check: Check) -> Check:
    """A list that :func:`items` accepts and that holds at least one item."""
    inner = items(check)
    return lambda value: inner(value) or (None if value else "is empty")


def record_of(schema: Schema) -> Check:
    """A JSON object whose fields pass ``schema`` (a cell of a recall or QA record)."""

    def checked(value: object) -> str | None:
        if not isinstance(value, dict):
            return f"is {_shown(value)}, not an object"
        found = problem(value, schema)
        return None if found is None else f"has {found}"

    return checked


def problem(record: dict, schema: Schema) -> str | None:
    """The first field of ``record`` that ``schema`` refuses, said in words, or ``None``."""
    for name, check in schema.items():
        if name not in record:
            if getattr(check, "absent_ok", False):
                continue
            return f"no {name!r}"
        found = check(record[name])
        if found:
            return f"{name!r} that {found}"
    return None


def same_length(record: dict, *names: str) -> str | None:
    """Lists that go together (positions and values of a curve) must have one length."""
    lengths = {name: len(record[name]) for name in names if isinstance(record.get(name), list)}
    if len(set(lengths.values())) > 1:
        return " and ".join(f"{len(record[name])} {name!r}" for name in lengths) + ", which do not pair up"
    return None
