"""The ``perplexity`` task: streaming perplexity over ``--tokens`` tokens, and its curve by position."""

from __future__ import annotations

from .. import fields as f
from ..perplexity import curve, perplexity
from .base import Column, Curves, Measure, Panel, Row
from .cells import baseline, figure, records_of
from .stream_pass import StreamTask, stream_pass


class Perplexity(StreamTask):
    name = "perplexity"
    summary = "perplexity: streaming perplexity over --tokens tokens (one pass shared with memory)"
    fields = {"ppl": f.positive, "tokens": f.count, "curve_positions": f.nonempty(f.number), "curve_ppl": f.nonempty(f.positive)}
    paired = ("curve_positions", "curve_ppl")

    def run(self, bench, unit, jobs):
        done = stream_pass(bench, unit)
        positions, values = curve(done.nll)
        for job in jobs:
            yield job, {**done.figures, "ppl": perplexity(done.nll), "curve_positions": positions, "curve_ppl": values}

    def headline(self, record):
        mark = " (approximate)" if record.get("approximate") else ""
        return f"ppl {record['ppl']:.3f} over {record['tokens']} tokens{mark}"

    def columns(self, rows):
        if not any(row.record(self.name) for row in rows):
            return []
        return [Column("PPL", self.name, figure(self.name, "ppl"), 3, records_of(self.name))]

    def measures(self, rows):
        if not any(row.record(self.name) for row in rows):
            return []
        base = baseline(rows)
        reference = base.record(self.name) if base is not None else None

        def ratio(row: Row) -> float | None:
            record = row.record(self.name)
            return None if record is None or reference is None else record["ppl"] / reference["ppl"]

        return [Measure("ppl_ratio", ratio, "perplexity / full cache's (lower is better)", lambda row: row.record(self.name))]

    def curves(self, rows):
        if not any(row.record(self.name) for row in rows):
            return []

        base = baseline(rows)
        reference = base.record(self.name) if base is not None else None

        def points(row: Row):
            record = row.record(self.name)
            return None if record is None else (record["curve_positions"], record["curve_ppl"])

        def ratios(row: Row):
            record = row.record(self.name)
            if record is None or reference is None or record["curve_positions"] != reference["curve_positions"]:
                return None
            return record["curve_positions"], [mine / full for mine, full in zip(record["curve_ppl"], reference["curve_ppl"])]

        panels = (Panel("perplexity per bin", points, log=True, smooth=5),)
        if reference is not None:  # the policies' differences, which a shared band of perplexities hides
            panels += (Panel("perplexity / the full cache's, bin by bin", ratios, log=True, smooth=5),)
        return [Curves("perplexity", "streaming perplexity by position", "tokens", self.name, panels)]


TASK = Perplexity()

