"""The report's figures and tables, asserted on the figure objects and the files: one look per
family held across figures, readable log axes, intervals drawn, nothing on the frame, legends off
the data, coinciding series drawn once; CSV without empty columns, LaTeX that pdfLaTeX compiles."""

from __future__ import annotations

import csv
import io
import math
import shutil
import subprocess

import pytest

from eval.report import sections, tabulate, write_report
from eval.report.plots import REFERENCE, figures, moving_average
from eval.report.style import Style

MIB = 2**20
SETUP = {"model": "m", "gguf_file": None, "dataset": "d", "device": "cpu", "dtype": "float32", "created": "2026-12-06T10:00:00+00:00"}
POSITIONS = list(range(1, 128, 16)) + [127]
RUNS = [  # label, policy, family, budget, perplexity, KV held MiB, passkey cell scores
    ("full", "full", "full", None, 10.0, 8.0, [1, 1, 0, 1]),
    ("fp8", "fp8", "fp8", None, 10.0, 4.0, [1, 1, 0, 1]),
    ("window @32", "window", "window", 32, 40.0, 1.0, [0, 0, 0, 1]),
    ("window @64", "window", "window", 64, 20.0, 2.0, [0, 1, 0, 1]),
    ("sink @32", "sink", "sink", 32, 12.0, 1.0, [0, 0, 0, 1]),
    ("sink @64", "sink", "sink", 64, 11.0, 2.0, [0, 1, 0, 1]),
    ("h2o @32", "h2o", "h2o", 32, 15.0, 1.0, [0, 0, 1, 1]),
    ("h2o @64", "h2o", "h2o", 64, 13.0, 2.0, [1, 0, 1, 1]),
]


def run_records() -> list[dict]:
    """A sweep of four families and two budgets: the window and the sinks hold the same bytes and
    score the same needles, full and fp8 score alike."""
    records = []
    for index, (label, policy, family, budget, ppl, held, scores) in enumerate(RUNS):
        common = {**SETUP, "policy": policy, "label": label, "family": family, "policy_index": index, "budget": budget,
                  "bounded": budget is not None, "approximate": False, "held_bytes": int(held * MIB), "kept_fraction": 1.0 if budget is None else budget / 127}
        stream = {"tokens": 128, "chunk_size": "auto", "budget": budget, "ratio": None}
        curve = [ppl * (1 + 0.5 * math.sin(i + index)) for i in range(len(POSITIONS))]
        records.append({**common, "task": "perplexity", "params": stream, "ppl": ppl, "tokens": 128, "curve_positions": POSITIONS, "curve_ppl": curve})
        trace = [min(p, budget or p) * held * MIB / (budget or 127) for p in POSITIONS]
        records.append({**common, "task": "memory", "params": stream, "footprint_bytes": int(1.2 * held * MIB), "peak_memory_bytes": 1.0,
                        "footprint_positions": POSITIONS, "footprint_trace": [1.2 * t for t in trace], "held_trace": trace})
        cells = [{"depth": d, "seed": 0, "score": float(s)} for d, s in zip((0.1, 0.4, 0.6, 0.9), scores)]
        protocols = ["streamed", "prefill"] if policy == "full" else ["prefill"]
        recall = {"length": 256, "depths": [0.1, 0.4, 0.6, 0.9], "seeds": [0], "chunk_size": "auto", "budget": budget, "ratio": None,
                  "protocol": "any" if policy == "full" else "prefill"}
        records.append({**common, "task": "passkey", "params": recall, "length": 256, "cells": cells, "protocol": recall["protocol"], "protocols": protocols})
    return records


@pytest.fixture(scope="module")
def drawn():
    records = run_records()
    [section] = sections(records)
    table = tabulate(section)
    found = figures(table, Style.of_records(records))
    for figure in found.values():
        figure.canvas.draw()
    return table, found


def handles(figure) -> dict[str, object]:
    """Every legend entry of a figure: label -> its line (an error bar's data line)."""
    found = {}
    for axes in figure.axes:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            found[label] = handle.lines[0] if hasattr(handle, "lines") else handle
    return found


def family_of(label: str) -> str:
    return label.split(" = ")[0].split(" @")[0].split(" (")[0].partition(":")[0]


def data_lines(axes):
    return [line for line in axes.get_lines() if line.get_gid() != REFERENCE and len(line.get_xdata())]


def test_the_figures_of_a_run(drawn):
    _, found = drawn
    assert sorted(found) == ["frontier_passkey_prefill", "frontier_passkey_streamed", "frontier_ppl_ratio",
                             "frontier_recall_mean_prefill", "frontier_recall_mean_streamed", "memory", "perplexity"]


def test_each_family_has_one_colour_and_marker_the_same_in_every_figure(drawn):
    _, found = drawn
    looks: dict[str, tuple] = {}
    for name, figure in found.items():
        mine: dict[str, set] = {}
        for label, line in handles(figure).items():
            if line.get_marker() not in ("None", "", None):
                mine.setdefault(family_of(label), set()).add((line.get_color(), line.get_marker()))
        assert all(len(pairs) == 1 for pairs in mine.values()), (name, mine)
        pairs = {family: next(iter(pair)) for family, pair in mine.items()}
        assert len(set(pairs.values())) == len(pairs), (name, pairs)  # no two families look alike
        for family, pair in pairs.items():
            assert looks.setdefault(family, pair) == pair, (name, family)  # as in every other figure
    assert set(looks) == {"full", "fp8", "window", "sink", "h2o"}


def test_every_log_axis_has_three_labelled_ticks_within_the_data(drawn):
    _, found = drawn
    logs = 0
    for name, figure in found.items():
        for axes in figure.axes:
            levels = [y for line in axes.get_lines() if line.get_gid() == REFERENCE for y in line.get_ydata()]
            for axis, values in (("x", [x for line in data_lines(axes) for x in line.get_xdata()]),
                                 ("y", [y for line in data_lines(axes) for y in line.get_ydata()] + levels)):
                target = axes.xaxis if axis == "x" else axes.yaxis
                if target.get_scale() != "log" or not values:
                    continue
                logs += 1
                low, high = min(values), max(values)
                labelled = [tick for tick, text in zip(target.get_majorticklocs(), target.get_majorticklabels())
                            if text.get_text() and low <= tick <= high]
                assert len(labelled) >= 3, (name, axis, low, high, labelled)
                assert all(("e+" not in text.get_text() and "^" not in text.get_text()) for text in target.get_majorticklabels())
    assert logs >= 4  # perplexity and its ratio to full, and the frontiers' bytes


def test_no_point_sits_on_the_frame(drawn):
    _, found = drawn
    for name, figure in found.items():
        for axes in figure.axes:
            (x0, x1), (y0, y1) = axes.get_xlim(), axes.get_ylim()
            for line in data_lines(axes):
                for x, y in zip(line.get_xdata(), line.get_ydata()):
                    assert x0 < x < x1 and y0 < y < y1, (name, line.get_label(), x, y, (x0, x1), (y0, y1))


def test_frontier_points_carry_the_tables_intervals(drawn):
    table, found = drawn
    column = [c.title for c in table.columns].index("recall prefill")
    intervals = {row.label(): cells[column] for row, cells in zip(table.rows, table.intervals)}
    figure = found["frontier_recall_mean_prefill"]
    for axes in figure.axes:
        bars = [container for container in axes.containers if container.has_yerr]
        assert bars and all(len(container.lines[2][0].get_segments()) == len(container.lines[0].get_xdata()) for container in bars)
    budget_side = figure.axes[0]
    window = next(c for c in budget_side.containers if c.get_label().startswith("window"))
    [low, high] = window.lines[2][0].get_segments()[-1][:, 1]  # the window at 64
    assert (low, high) == pytest.approx((intervals["window @64"].low, intervals["window @64"].high))


def test_coinciding_series_are_drawn_once_with_their_names_together(drawn):
    _, found = drawn
    assert "window = sink" in handles(found["frontier_recall_mean_prefill"])  # same scores at every budget
    assert "full = fp8" in handles(found["frontier_recall_mean_prefill"])  # one level for both
    memory = handles(found["memory"])
    assert "window @32 = sink @32 = h2o @32" in memory and "window @64 = sink @64 = h2o @64" in memory
    assert [axes.get_ylabel() for axes in found["memory"].axes] == ["KV held (MiB)", "KV allocated (MiB)"]


def test_legends_lie_outside_the_data(drawn):
    _, found = drawn
    for name, figure in found.items():
        renderer = figure.canvas.get_renderer()
        legends = [*figure.legends, *(axes.get_legend() for axes in figure.axes if axes.get_legend())]
        assert legends, name
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for axes in figure.axes:
                for line in data_lines(axes):
                    assert not box.overlaps(line.get_window_extent(renderer)), (name, line.get_label())


def test_titles_say_what_on_what_how_and_when(drawn):
    _, found = drawn
    for name, figure in found.items():
        text = figure.get_suptitle().replace("\n", " ")
        assert "m, d, cpu float32" in text and "2026-12-06" in text, (name, text)
    assert "tokens=128" in found["perplexity"].get_suptitle()
    recall = found["frontier_recall_mean_prefill"].get_suptitle().replace("\n", " ")
    assert "lengths=256" in recall and "protocol prefill" in recall and "seeds=0" in recall


def test_perplexity_curves_keep_their_moving_average_and_show_the_raw_values_lightly(drawn):
    _, found = drawn
    axes = found["perplexity"].axes[0]
    record = run_records()[0]  # the full cache's perplexity
    smooth = next(line for line in axes.get_lines() if line.get_label() == "full")
    assert list(smooth.get_ydata()) == pytest.approx(moving_average(record["curve_ppl"]))
    raw = [line for line in axes.get_lines() if list(line.get_ydata()) == pytest.approx(record["curve_ppl"])]
    assert raw and all(line.get_alpha() is not None and line.get_alpha() < 0.5 for line in raw)
    assert found["perplexity"].axes[1].get_ylabel().startswith("perplexity / the full cache's")


def test_tables_have_no_empty_column_and_latex_is_plain_ascii_that_compiles(tmp_path):
    write_report(tmp_path, run_records())
    rows = list(csv.DictReader(io.StringIO((tmp_path / "summary.csv").read_text())))
    assert rows and all(any(row[name] for row in rows) for name in rows[0]), [n for n in rows[0] if not any(r[n] for r in rows)]
    assert "budget vs full" not in rows[0] and "KV allocated MiB vs full" not in rows[0] and "approximate" not in rows[0]
    tex = (tmp_path / "summary.tex").read_text()
    assert tex.isascii() and r"$\pm$" in tex and r"$\times$" in tex
    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex is not installed: the LaTeX was checked for ASCII only")
    (tmp_path / "doc.tex").write_text("\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n\\input{summary.tex}\n\\end{document}\n")
    done = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
