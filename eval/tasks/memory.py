"""The ``memory`` task: the bytes a cache holds and allocates along the perplexity stream, and the
peak a few decode steps at its end need (see :mod:`eval.memory` for the three figures)."""

from __future__ import annotations

from .. import fields as f
from ..memory import decode_peak
from .base import Column, Curves, Panel, Row
from .cells import MIB, figure, records_of
from .stream_pass import StreamTask, stream_pass

DECODE_STEPS = 8
"""Decode steps at the end of the stream over which the peak memory is measured."""


class Memory(StreamTask):
    name = "memory"
    summary = "memory: KV bytes held and allocated along the stream, peak while decoding at its end"
    fields = {
        "held_bytes": f.optional(f.count), "footprint_bytes": f.count, "peak_memory_bytes": f.number,
        "footprint_positions": f.nonempty(f.number), "footprint_trace": f.items(f.number), "held_trace": f.items(f.optional(f.number)),
    }
    paired = ("footprint_positions", "footprint_trace", "held_trace")

    def run(self, bench, unit, jobs):
        done = stream_pass(bench, unit)
        trace = done.trace
        for job in jobs:
            peak = decode_peak(bench.model, done.cache, done.stream[:, -1:], DECODE_STEPS, since=done.before)
            yield job, {
                **done.figures,
                "footprint_bytes": trace.bytes[-1],
                "footprint_max_bytes": max(trace.bytes),
                "footprint_positions": trace.positions,
                "footprint_trace": trace.bytes,
                "held_trace": trace.held,
                "peak_memory_bytes": peak.growth,
                "peak_memory_source": peak.source,
                "decode_steps": DECODE_STEPS,
            }

    def headline(self, record):
        mark = " (approximate)" if record.get("approximate") else ""
        held = record["held_bytes"]
        held_text = "" if held is None else f"holds {held / MIB:.2f} MiB, "
        return f"KV cache {held_text}allocated {record['footprint_bytes'] / MIB:.2f} MiB, peak +{record['peak_memory_bytes'] / MIB:.1f} MiB{mark}"

    def columns(self, rows):
        if not any(row.record(self.name) for row in rows):
            return []
        sources = records_of(self.name)
        return [
            Column("KV held MiB", self.name, figure(self.name, "held_bytes", MIB), 2, sources),
            Column("KV allocated MiB", self.name, figure(self.name, "footprint_bytes", MIB), 2, sources, ratio=False),
            Column("peak MiB", self.name, figure(self.name, "peak_memory_bytes", MIB), 1, sources),
        ]

    def caption(self, rows):
        if not any(row.record(self.name) for row in rows):
            return []
        return [
            "KV held = keys and values of the tokens kept, KV allocated = every tensor the cache holds "
            "(spare capacity and bookkeeping included); memory ratios are on bytes held"
        ]

    def curves(self, rows):
        if not any(row.record(self.name) for row in rows):
            return []

        def trace(key: str):
            def points(row: Row):
                record = row.record(self.name)
                if record is None or None in record[key]:
                    return None
                return record["footprint_positions"], [value / MIB for value in record[key]]

            return points

        panels = (Panel("KV held (MiB)", trace("held_trace")), Panel("KV allocated (MiB)", trace("footprint_trace")))
        return [Curves("memory", "KV cache along the stream", "tokens", self.name, panels)]


TASK = Memory()
