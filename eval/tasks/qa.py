"""The ``qa`` task: long-document QA (a QA ``--dataset``, :mod:`eval.qa`) under each protocol,
every sample alone (lengths differ), scored by exact match and token F1. A dataset whose samples
ask several questions records a cell per question, with its turn, and its table gives the F1 of
each turn beside the mean over every question."""

from __future__ import annotations

import time

from hf_kvpolicies import from_spec

from .. import fields as f
from ..asking import ask
from ..protocols import protocol_named, state_fields
from ..qa import exact_match, is_qa_dataset, make_qa_case, questions_of, token_f1
from ..settings import UsageError
from ..stream import resolve_chunk
from .base import Column, Measure, Row, Task, protocol_fields
from .cells import interval_of, mean_of, protocols_of, turns_of
from .framing import chat_params, framing


class QA(Task):
    name = "qa"
    summary = "qa (needs a QA --dataset): exact match and token F1 of long-document answers"
    prompted = True
    fields = {"f1": f.number, "cells": f.nonempty(f.record_of({"exact_match": f.number, "f1": f.number, "turn": f.absent_or(f.count)}))}

    def check(self, settings):
        if not is_qa_dataset(settings.dataset):
            raise UsageError("--task qa needs a QA --dataset: longbench:SUBSET or a JSONL file of {context, input, answers}")

    def params(self, settings, job):
        return {"samples": settings.qa_samples, "max_tokens": settings.qa_max_tokens, **chat_params(settings)}

    def unit(self, job):
        return ("qa", job.protocol)

    def context(self, settings, job):
        return settings.qa_max_tokens

    def prepare(self, bench, jobs):
        try:
            framing(bench)
        except ValueError as error:
            raise UsageError(str(error)) from error

    def run(self, bench, unit, jobs):
        settings, model = bench.settings, bench.model
        several = any(len(questions_of(sample)) > 1 for sample in bench.samples)
        for job in jobs:
            start = time.perf_counter()
            protocol = protocol_fields(job, settings)
            ran = protocol_named(protocol["protocol_ran"])
            cells, states, approximate = [], [], False
            for index, sample in enumerate(bench.samples):
                case = make_qa_case(bench.tokenizer, sample, index, settings.qa_max_tokens, framing(bench))
                spec = job.run.spec(case.context_ids.shape[1] + case.question_ids.shape[1])  # a ratio is of the (first) prompt
                chunk, inexact = resolve_chunk(from_spec(model, spec), model, settings.chunk_size) if ran.chunked else (1, False)
                approximate |= inexact
                for asked in ask(model, bench.tokenizer, [case], ran, lambda: from_spec(model, spec), framing(bench), chunk, 1):
                    states.append(asked.answers)
                    expected, text = case.turns[asked.turn].expected, asked.text
                    turn = {"turn": asked.turn + 1} if several else {}
                    cells.append({"index": index, **turn, "expected": list(expected), "answer": text,
                                  "exact_match": exact_match(text, expected), "f1": token_f1(text, expected)})
            yield job, {
                **protocol, **state_fields(states), "cells": cells,
                "exact_match": sum(c["exact_match"] for c in cells) / len(cells), "f1": sum(c["f1"] for c in cells) / len(cells),
                "score": sum(c["f1"] for c in cells) / len(cells), "approximate": approximate, "elapsed_s": time.perf_counter() - start,
            }

    def headline(self, record):
        return f"exact match {record['exact_match']:.2f}, F1 {record['f1']:.2f}"

    def columns(self, rows):
        """Exact match and F1 per protocol; where samples ask several questions, the F1 of each
        turn first (the two means are then over every question of every turn)."""
        columns = []
        for protocol in protocols_of(rows, self.accepts):
            for turn in self._turns(rows, protocol):
                cells = self._cells(protocol, "f1", turn)
                columns.append(Column(f"QA F1 {protocol} turn {turn}", self.name, mean_of(cells), 2, self._sources(protocol), interval_of(cells)))
            for key, title in (("exact_match", "QA EM"), ("f1", "QA F1")):
                cells = self._cells(protocol, key)
                columns.append(Column(f"{title} {protocol}", self.name, mean_of(cells), 2, self._sources(protocol), interval_of(cells)))
        return columns

    def measures(self, rows):
        return [
            Measure(f"qa_f1_{protocol}", mean_of(cells), f"QA token F1, {protocol}{over} (higher is better)", lambda row, p=protocol: row.record(self.name, p), interval_of(cells), protocol)
            for protocol in protocols_of(rows, self.accepts)
            for cells, over in [(self._cells(protocol, "f1"), ", mean over turns" if self._turns(rows, protocol) else "")]
        ]

    def _turns(self, rows: list[Row], protocol: str) -> list[int]:
        return turns_of(cell for row in rows if (record := row.record(self.name, protocol)) for cell in record["cells"])

    def _cells(self, protocol: str, key: str, turn: int | None = None):
        def cells(row: Row) -> list[float]:
            record = row.record(self.name, protocol)
            return [] if record is None else [cell[key] for cell in record["cells"] if turn in (None, cell.get("turn"))]

        return cells

    def _sources(self, protocol: str):
        return lambda row: [record] if (record := row.record(self.name, protocol)) is not None else []


TASK = QA()
