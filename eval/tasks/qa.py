"""The ``qa`` task: long-document QA (a QA ``--dataset``, :mod:`eval.qa`) under each protocol,
every sample alone (lengths differ), scored by exact match and token F1."""

from __future__ import annotations

import time

from hf_kvpolicies import from_spec

from .. import fields as f
from ..protocols import protocol_named, split, state_fields
from ..qa import exact_match, is_qa_dataset, make_qa_case, token_f1
from ..settings import UsageError
from ..stream import resolve_chunk
from .base import Column, Measure, Row, Task, protocol_fields
from .cells import interval_of, mean_of, protocols_of


class QA(Task):
    name = "qa"
    summary = "qa (needs a QA --dataset): exact match and token F1 of long-document answers"
    prompted = True
    fields = {"f1": f.number, "cells": f.nonempty(f.record_of({"exact_match": f.number, "f1": f.number}))}

    def check(self, settings):
        if not is_qa_dataset(settings.dataset):
            raise UsageError("--task qa needs a QA --dataset: longbench:SUBSET or a JSONL file of {context, input, answers}")

    def params(self, settings, job):
        return {"samples": settings.qa_samples, "max_tokens": settings.qa_max_tokens}

    def unit(self, job):
        return ("qa", job.protocol)

    def context(self, settings, job):
        return settings.qa_max_tokens

    def run(self, bench, unit, jobs):
        settings, model = bench.settings, bench.model
        for job in jobs:
            start = time.perf_counter()
            protocol = protocol_fields(job, settings)
            ran = protocol_named(protocol["protocol_ran"])
            cells, states, approximate = [], [], False
            for index, sample in enumerate(bench.samples):
                case = make_qa_case(bench.tokenizer, sample, index, settings.qa_max_tokens)
                context, question = split([case], ran.name)
                spec = job.run.spec(context.shape[1] + question.shape[1])  # a ratio is of this prompt
                chunk, inexact = resolve_chunk(from_spec(model, spec), model, settings.chunk_size) if ran.chunked else (1, False)
                approximate |= inexact
                [out] = ran.answer(model, bench.tokenizer, context, [question], lambda: from_spec(model, spec), case.answer_tokens, chunk)
                states.append(out)
                text = out.texts[0]
                cells.append({"index": index, "expected": list(case.expected), "answer": text,
                              "exact_match": exact_match(text, case.expected), "f1": token_f1(text, case.expected)})
            yield job, {
                **protocol, **state_fields(states), "cells": cells,
                "exact_match": sum(c["exact_match"] for c in cells) / len(cells), "f1": sum(c["f1"] for c in cells) / len(cells),
                "score": sum(c["f1"] for c in cells) / len(cells), "approximate": approximate, "elapsed_s": time.perf_counter() - start,
            }

    def headline(self, record):
        return f"exact match {record['exact_match']:.2f}, F1 {record['f1']:.2f}"

    def columns(self, rows):
        return [
            Column(f"{title} {protocol}", self.name, mean_of(cells), 2, self._sources(protocol), interval_of(cells))
            for protocol in protocols_of(rows, self.accepts)
            for key, title in (("exact_match", "QA EM"), ("f1", "QA F1"))
            for cells in [self._cells(protocol, key)]
        ]

    def measures(self, rows):
        return [
            Measure(f"qa_f1_{protocol}", mean_of(cells), f"QA token F1, {protocol} (higher is better)", lambda row, p=protocol: row.record(self.name, p), interval_of(cells), protocol)
            for protocol in protocols_of(rows, self.accepts)
            for cells in [self._cells(protocol, "f1")]
        ]

    def _cells(self, protocol: str, key: str):
        def cells(row: Row) -> list[float]:
            record = row.record(self.name, protocol)
            return [] if record is None else [cell[key] for cell in record["cells"]]

        return cells

    def _sources(self, protocol: str):
        return lambda row: [record] if (record := row.record(self.name, protocol)) is not None else []


TASK = QA()
