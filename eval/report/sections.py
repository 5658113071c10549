"""Records into sections and rows: a section holds one setup (model, dataset, device, dtype) and
one setting per task, so that no table or plot sets a figure beside one measured under other
settings; a row holds one policy run's latest records in a section."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..tasks import Row, task_for

SETUP = ("model", "gguf_file", "dataset", "device", "dtype")
SWEPT = ("budget", "ratio")
"""Params that vary from row to row of one table: the sweep's budget or ratio."""
PROMPTED = ("protocol", "protocols")
"""Params of a prompted task that its table shows as columns (one per protocol)."""


def setup_label(setup: tuple) -> str:
    model, gguf, dataset, device, dtype = setup
    return f"{model}{'/' + gguf if gguf else ''}, {dataset}, {device} {dtype}"


def setting_of(record: dict) -> dict:
    """The params a record's figure depends on that are the same in every row and column of a
    table: its setting (``--tokens``, ``--depths``, ``--seeds``, ``--chunk-size``...)."""
    task = task_for(record["task"])
    shown = SWEPT + task.dimensions + (PROMPTED if task.prompted else ())
    return {key: value for key, value in sorted(record["params"].items()) if key not in shown}


@dataclass
class Section:
    """The records of one setup and one setting per task: what one table and one set of plots
    may hold."""

    number: int
    setup: tuple
    settings: dict[str, dict]
    """Each task's setting (:func:`setting_of`), by the task's name."""
    records: list[dict] = field(default_factory=list)

    @property
    def suffix(self) -> str:
        """What the file names of this section's plots end with: nothing for the first."""
        return "" if self.number == 1 else f"-{self.number}"

    def describe(self) -> str:
        """``"perplexity, memory: chunk_size=auto, tokens=64; recall: ..."``: the settings in words."""
        grouped: dict[str, list[str]] = {}
        for name, setting in self.settings.items():
            text = ", ".join(f"{key}={_plain(value)}" for key, value in setting.items()) or "no settings"
            grouped.setdefault(text, []).append(name)
        return "; ".join(f"{', '.join(names)}: {text}" for text, names in grouped.items())


def _plain(value: object) -> str:
    return "/".join(map(str, value)) if isinstance(value, list) else str(value)


def sections(records: list[dict]) -> list[Section]:
    """The records split by setup and setting, in the order first seen. Within a setup, the
    first setting of each task goes to its first section, the second to the second, and so on: a
    run of the sweep with other ``--tokens`` makes a section of its own, holding just its own
    figures beside the full cache measured with them."""
    found: dict[tuple, dict[str, list[str]]] = {}
    placed = []
    for record in records:
        setup = tuple(record.get(name) for name in SETUP)
        name, setting = task_for(record["task"]).name, setting_of(record)
        known = found.setdefault(setup, {}).setdefault(name, [])
        key = json.dumps(setting, sort_keys=True)
        if key not in known:
            known.append(key)
        placed.append((setup, known.index(key), name, setting, record))
    by_key: dict[tuple, Section] = {}
    for setup, index, name, setting, record in placed:
        section = by_key.setdefault((setup, index), Section(0, setup, {}))
        section.settings.setdefault(name, setting)
        section.records.append(record)
    ordered = sorted(by_key.items(), key=lambda item: (list(found).index(item[0][0]), item[0][1]))
    for number, (_, section) in enumerate(ordered, start=1):
        section.number = number
    return [section for _, section in ordered]


def rows(records: list[dict]) -> list[Row]:
    """Rows in sweep order (the run's index, then its label); later records win. A record sits
    at its task's name and its place along the task's dimensions and protocol; a protocol-
    independent one under each protocol it stands for."""
    by_name: dict[str, Row] = {}
    for record in records:
        name = record.get("label", record["policy"])
        row = by_name.setdefault(name, Row(tuple(record.get(key) for key in SETUP), record["policy"], record.get("policy_index", 0), name))
        task = task_for(record["task"])
        place = tuple(record["params"][dimension] for dimension in task.dimensions)
        protocols = record.get("protocols", [record.get("protocol")]) if task.prompted else [None]
        for protocol in protocols:
            row.records[(record["task"], place + ((protocol,) if task.prompted else ()))] = record
    return sorted(by_name.values(), key=lambda row: (row.index, row.name))
