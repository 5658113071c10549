"""The recall suite as a task (``niah_single``, ``passkey``... with options as ``TASK:key=value``):
every (depth, seed) cell of each task at each ``--lengths`` under each protocol, prompts of equal
length answered in shared batches (the cases themselves come from :mod:`eval.recall`). A task
whose cases ask several questions (``niah_multiturn``) records a cell per question, with its turn;
its detail columns give each turn and the mean over turns."""

from __future__ import annotations

import time

from .. import fields as f
from ..asking import ask
from ..data import DataError, tokenize
from ..protocols import protocol_named, state_fields
from ..recall import TASKS as RECALL_TASKS
from ..recall import make_case, parse_task, score_answer
from ..settings import UsageError
from ..stream import resolve_chunk
from .base import Column, Measure, Row, Task, protocol_fields
from .cells import interval_of, mean_of, protocols_of, turns_of
from .framing import chat_params, framing

BATCH = 16
"""Most recall prompts fed together (rows of equal length share every forward)."""


class Recall(Task):
    name = "recall"
    summary = f"a recall task ({', '.join(RECALL_TASKS)}; options as TASK:key=value, e.g. niah_single:value=uuid)"
    dimensions = ("length",)
    prompted = True
    fields = {"length": f.count, "cells": f.nonempty(f.record_of({"score": f.number, "turn": f.absent_or(f.count)}))}

    def names(self):
        return RECALL_TASKS

    def accepts(self, name):
        return name.partition(":")[0].strip() in RECALL_TASKS

    def check_name(self, name):
        parse_task(name)

    def places(self, settings, name):
        return [{"length": length} for length in settings.lengths]

    def params(self, settings, job):
        return {"length": job.length, "depths": list(settings.depths), "seeds": list(settings.seeds), "chunk_size": settings.chunk_size or "auto", **chat_params(settings)}

    def unit(self, job):
        return ("recall", job.length, job.protocol)  # every recall task at one length: prompts of one length batch together

    def context(self, settings, job):
        return job.length

    def prepare(self, bench, jobs):
        try:
            framing(bench)
        except ValueError as error:
            raise UsageError(str(error)) from error
        for job in jobs:  # every cell: how many needles fit depends on the keys a seed draws
            try:
                for depth, seed in _places(bench.settings, job.task):
                    _case(bench, job.task, job.length, depth, seed)
            except ValueError as error:
                raise UsageError(f"--task {job.task} at --lengths {job.length}: {error}") from error

    def run(self, bench, unit, jobs):
        """Every (depth, seed) cell of the recall tasks of ``jobs`` (one length, one protocol);
        prompts of equal lengths share forwards (at most :data:`BATCH` rows)."""
        settings, model = bench.settings, bench.model
        start = time.perf_counter()
        protocol = protocol_fields(jobs[0], settings)
        ran = protocol_named(protocol["protocol_ran"])
        cases = []
        for job in jobs:
            cases += [(job, _case(bench, job.task, job.length, depth, seed)) for depth, seed in _places(settings, job.task)]
        chunk, approximate = resolve_chunk(unit.make(), model, settings.chunk_size) if ran.chunked else (1, False)
        cells: dict = {job: [] for job in jobs}
        states: dict = {job: [] for job in jobs}
        for asked in ask(model, bench.tokenizer, [case for _, case in cases], ran, unit.make, framing(bench), chunk, BATCH):
            job, case = cases[asked.case]
            expected = case.turns[asked.turn].expected
            turn = {"turn": asked.turn + 1} if len(case.turns) > 1 else {}
            states[job].append(asked.answers)
            cells[job].append({
                "depth": None if case.task == "cwe" else case.depth, "seed": case.seed, **turn,
                "expected": list(expected), "answer": asked.text, "score": score_answer(asked.text, expected),
            })
        elapsed = (time.perf_counter() - start) / len(jobs)  # the batches are shared: each task its share
        for job in jobs:
            yield job, {
                **protocol, **state_fields(states[job]), "length": job.length, "cells": cells[job],
                "score": sum(cell["score"] for cell in cells[job]) / len(cells[job]),
                "chunk_size": chunk, "approximate": approximate, "elapsed_s": elapsed,
            }

    def headline(self, record):
        mark = " (approximate)" if record.get("approximate") else ""
        return f"score {record['score']:.2f}{mark}"

    # --- report ------------------------------------------------------------------------------
    def columns(self, rows):
        return [
            Column(f"recall {protocol}", f"recall {protocol}", mean_of(cells), 2, self._sources(protocol), interval_of(cells))
            for protocol in protocols_of(rows, self.accepts)
            for cells in [self.suite_cells(rows, protocol)]
        ]

    def details(self, rows):
        """A column per task, length and protocol; for a task that asks several questions, a
        column per turn before it, which is then the mean over turns."""
        order = list(protocols_of(rows, self.accepts))
        keys = sorted({(task, *where) for row in rows for task, where, _ in row.matching(self.accepts)}, key=lambda k: (order.index(k[2]), k[1], k[0]))
        columns = []
        for task, length, protocol in keys:
            title, sources = f"{task} @{length} {protocol}", self._sources(protocol)
            turns = turns_of(cell for row in rows for record in [row.record(task, length, protocol)] if record for cell in record["cells"])
            for turn in turns:
                cells = lambda row, t=task, n=length, p=protocol, k=turn: self.cells(row, p, t, n, k)  # noqa: E731
                columns.append(Column(f"{title} turn {turn}", f"recall {protocol}", mean_of(cells), 2, sources, interval_of(cells)))
            cells = lambda row, t=task, n=length, p=protocol: self.cells(row, p, t, n)  # noqa: E731
            columns.append(Column(title + (" mean" if turns else ""), f"recall {protocol}", mean_of(cells), 2, sources, interval_of(cells)))
        return columns

    def measures(self, rows):
        found = []
        for protocol in protocols_of(rows, self.accepts):
            first = self._first(protocol)
            found.append(Measure(
                f"recall_mean_{protocol}", mean_of(self.suite_cells(rows, protocol)),
                f"recall suite mean, {protocol} (higher is better)", first, interval_of(self.suite_cells(rows, protocol)), protocol,
            ))
            for task in sorted({task for row in rows for task, (_, p), _ in row.matching(self.accepts) if p == protocol}):
                cells = self.suite_cells(rows, protocol, task)
                turned = turns_of(cell for row in rows for name, (_, p), record in row.matching(self.accepts) if (name, p) == (task, protocol) for cell in record["cells"])
                what = f"{task} score, {protocol}" + (", mean over turns" if turned else "")
                found.append(Measure(f"{task}_{protocol}", mean_of(cells), f"{what} (higher is better)", self._first(protocol, task), interval_of(cells), protocol))
        return found

    def caption(self, rows):
        keys = {(task, length) for row in rows for task, (length, _), _ in row.matching(self.accepts)}
        if not keys:
            return []
        tasks, lengths = sorted({t for t, _ in keys}), sorted({n for _, n in keys})
        return [f"recall = RULER string-match score, mean over the cells of {', '.join(tasks)} at {lengths} tokens"]

    def cells(self, row: Row, protocol: str, task: str | None = None, length: int | None = None, turn: int | None = None) -> list[float]:
        """The scores of every recall cell of a row under a protocol (of one task, length and turn
        if given)."""
        return [
            cell["score"]
            for name, (n, p), record in row.matching(self.accepts)
            if p == protocol and task in (None, name) and length in (None, n)
            for cell in record["cells"]
            if turn in (None, cell.get("turn"))
        ]

    def suite_cells(self, rows: list[Row], protocol: str, task: str | None = None):
        """:meth:`cells` over several tasks or lengths, for the rows that have every (task, length)
        that some row of the table has under ``protocol``; none for the others, so that no mean
        over other cells is set beside theirs."""

        def keys(row: Row) -> set:
            return {(name, n) for name, (n, p), _ in row.matching(self.accepts) if p == protocol and task in (None, name)}

        wanted = set().union(*map(keys, rows))
        return lambda row: self.cells(row, protocol, task) if keys(row) == wanted else []

    def _sources(self, protocol: str):
        return lambda row: [record for _, (_, p), record in row.matching(self.accepts) if p == protocol]

    def _first(self, protocol: str, task: str | None = None):
        return lambda row: next((record for name, (_, p), record in row.matching(self.accepts) if p == protocol and task in (None, name)), None)


def _places(settings, task: str) -> list[tuple[float, int]]:
    """The (depth, seed) of every cell of ``task`` (one depth for ``cwe``: a list of words has none)."""
    depths = settings.depths if parse_task(task)[0] != "cwe" else settings.depths[:1]
    return [(depth, seed) for depth in depths for seed in settings.seeds]


def _case(bench, task: str, length: int, depth: float, seed: int):
    """A recall case, made once per process."""
    name, options = parse_task(task)
    haystack = bench.cached("recall haystack", lambda: _haystack(bench))
    made = lambda: make_case(bench.tokenizer, haystack, name, length, depth, seed, framing(bench), **options)  # noqa: E731
    return bench.cached(("recall case", task, length, depth, seed), made)


def _haystack(bench):
    """The recall suite's haystack: enough of the text for seeds to start at different places."""
    try:
        return tokenize(bench.tokenizer, bench.text, max(4 * max(bench.settings.lengths), 20_000), start=False)
    except DataError:
        return tokenize(bench.tokenizer, bench.text, start=False)


TASK = Recall()
