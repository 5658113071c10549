"""The ``speed`` task: prefill time and decode latency at each of ``--contexts`` (:mod:`eval.speed`)."""

from __future__ import annotations

import time

from .. import fields as f
from ..speed import speed_profile
from .base import Column, Curves, Panel, Row, Task
from .cells import figure, records_of

TIMINGS = ("prefill_ms", "median_ms", "p90_ms", "tokens_per_s")


class Speed(Task):
    name = "speed"
    summary = "speed: prefill time and decode ms/token at each of --contexts"
    fields = {"contexts": f.nonempty(f.count), **{key: f.items(f.positive) for key in TIMINGS}}
    paired = ("contexts", *TIMINGS)

    def params(self, settings, job):
        return {"contexts": list(settings.contexts), "steps": settings.steps}

    def context(self, settings, job):
        return max(settings.contexts)

    def stream_tokens(self, settings):
        return max(settings.contexts) + 1  # the context and the first token decoded

    def run(self, bench, unit, jobs):
        settings = bench.settings
        for job in jobs:
            start = time.perf_counter()
            figures = speed_profile(bench.model, unit.make, bench.ids, settings.contexts, steps=settings.steps, progress=settings.progress, desc=unit.desc)
            yield job, {**figures, "steps": settings.steps, "approximate": False, "elapsed_s": time.perf_counter() - start}

    def headline(self, record):
        return ", ".join(f"{ms:.1f} ms/token @{context}" for context, ms in zip(record["contexts"], record["median_ms"]))

    def columns(self, rows):
        timed = [row.record(self.name) for row in rows if row.record(self.name)]
        if not timed:
            return []
        contexts = sorted({context for record in timed for context in record["contexts"]})
        largest, sources = contexts[-1], records_of(self.name)
        return [
            Column(f"prefill ms @{largest}", self.name, figure(self.name, "prefill_ms", at=largest), 1, sources),
            *(Column(f"decode ms @{context}", self.name, figure(self.name, "median_ms", at=context), 2, sources) for context in contexts),
            Column(f"p90 ms @{largest}", self.name, figure(self.name, "p90_ms", at=largest), 2, sources),
            Column(f"tok/s @{largest}", self.name, figure(self.name, "tokens_per_s", at=largest), 1, sources),
        ]

    def curves(self, rows):
        if not any(row.record(self.name) for row in rows):
            return []

        def points(row: Row):
            record = row.record(self.name)
            return None if record is None else (record["contexts"], record["median_ms"])

        panel = Panel("decode ms/token (median)", points)
        return [Curves("latency", "decode latency by context", "context (tokens)", self.name, (panel,))]


TASK = Speed()
