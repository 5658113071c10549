"""The ``lm_eval:TASK`` records: lm-evaluation-harness tasks run by the hf-kvpolicies model
(``hf-kvpolicies lm-eval``), read from lm-eval's results files by the report
(:mod:`eval.lm_eval.results`), a column and a frontier plot per task, metric and protocol."""

from __future__ import annotations

import re

from .. import fields as f
from ..lm_eval.results import PREFIX, read_lm_eval_results
from ..settings import UsageError
from .base import Column, Measure, Row, Task
from .cells import protocols_of


def _metrics(value: object) -> str | None:
    """A non-empty object of finite numbers (a task's metrics as lm-eval reports them)."""
    if not isinstance(value, dict) or not value:
        return f"is {value!r:.40}, not an object of metrics"
    return next((f"{key!r} that {problem}" for key, item in value.items() if (problem := f.number(item))), None)


class LmEval(Task):
    name = "lm_eval"
    summary = "lm_eval:TASK (read by report from lm-eval's results; run them with hf-kvpolicies lm-eval --model hf-kvpolicies)"
    dimensions = ("num_fewshot",)
    prompted = True
    fields = {"metrics": _metrics, "higher_is_better": f.absent_or(f.record_of({}))}

    def names(self):
        return (f"{PREFIX}TASK",)

    def accepts(self, name):
        return name.startswith(PREFIX) and len(name) > len(PREFIX)

    def check(self, settings):
        raise UsageError(
            "lm_eval:TASK records come from lm-evaluation-harness, not from eval: run "
            "`hf-kvpolicies lm-eval --model hf-kvpolicies --output_path DIR ...`, then `hf-kvpolicies report DIR`"
        )

    def import_records(self, folder):
        return read_lm_eval_results(folder)

    def columns(self, rows):
        return [
            Column(f"{task} {_metric_label(metric)}{_shots(shots)} {protocol}", self.name, value, 4, sources)
            for task, metric, shots, protocol in self._keys(rows)
            for value, sources in [(self._value(task, metric, shots, protocol), self._sources(task, shots, protocol))]
        ]

    def measures(self, rows):
        found = []
        for task, metric, shots, protocol in self._keys(rows):
            first = self._record(task, shots, protocol)
            better = next((record.get("higher_is_better", {}).get(metric.partition(",")[0]) for row in rows if (record := first(row))), True)
            found.append(Measure(
                re.sub(r"[^A-Za-z0-9_.-]+", "-", f"lm_eval_{task}_{_metric_label(metric)}{_shots(shots)}_{protocol}"),
                self._value(task, metric, shots, protocol),
                f"{task} {_metric_label(metric)}{_shots(shots)} (lm-eval), {protocol} ({'higher' if better is not False else 'lower'} is better)",
                first,
            ))
        return found

    def caption(self, rows):
        if not any(row.matching(self.accepts) for row in rows):
            return []
        return ["lm-eval columns: each task's metrics as lm-evaluation-harness reports them, under each protocol"]

    def _keys(self, rows: list[Row]) -> list[tuple[str, str, int, str]]:
        """``(task, metric, shots, protocol)`` of every figure the rows hold, by protocol, then task."""
        order = protocols_of(rows, self.accepts)
        keys = {
            (name.removeprefix(PREFIX), metric, shots, protocol)
            for row in rows
            for name, (shots, protocol), record in row.matching(self.accepts)
            for metric in record["metrics"]
        }
        return sorted(keys, key=lambda key: (order.index(key[3]), key[0], key[2], key[1]))

    def _record(self, task: str, shots: int, protocol: str):
        return lambda row: row.record(PREFIX + task, shots, protocol)

    def _value(self, task: str, metric: str, shots: int, protocol: str):
        record = self._record(task, shots, protocol)
        return lambda row: None if (found := record(row)) is None else found["metrics"].get(metric)

    def _sources(self, task: str, shots: int, protocol: str):
        record = self._record(task, shots, protocol)
        return lambda row: [found] if (found := record(row)) is not None else []


def _metric_label(metric: str) -> str:
    """``acc,none`` as ``acc``; ``exact_match,strict-match`` as ``exact_match/strict-match``."""
    name, _, kind = metric.partition(",")
    return name if kind in ("", "none") else f"{name}/{kind}"


def _shots(shots: int) -> str:
    return f" {shots}-shot" if shots else ""


TASK = LmEval()
