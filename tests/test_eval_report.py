"""Records (write, resume, read) and the tables and plots rendered from them alone."""

from __future__ import annotations

import csv
import io

import pytest

from eval.records import append_record, environment, identity, read_records
from eval.report import csv_text, latex, markdown, sections, summarize, write_report

SETUP = {"model": "m", "gguf_file": None, "dataset": "d", "device": "cpu", "dtype": "float32"}


def record(policy: str, task: str, index: int, **figures) -> dict:
    return {**SETUP, "policy": policy, "task": task, "policy_index": index, "params": {}, "approximate": False, **figures}


def sweep_records() -> list[dict]:
    records = []
    for index, (policy, ppl, kv, acc, approx) in enumerate(
        [("full", 10.0, 8 * 2**20, 1.0, False), ("window:window=256", 15.0, 2**20, 0.5, False), ("h2o:heavy=2,recent=2", 12.5, 2**20, 0.75, True)]
    ):
        records.append(record(policy, "perplexity", index, ppl=ppl, tokens=100, approximate=approx, curve_positions=[50, 99], curve_ppl=[ppl, ppl], held_bytes=kv))
        records.append(record(policy, "memory", index, held_bytes=kv, footprint_bytes=2 * kv, peak_memory_bytes=2 * kv, footprint_positions=[1, 99], footprint_trace=[2 * kv, 2 * kv], held_trace=[kv, kv]))
        records.append(record(policy, "speed", index, contexts=[64, 128], prefill_ms=[5.0, 10.0], median_ms=[2.0, 4.0 / (index + 1)], p90_ms=[3.0, 5.0], tokens_per_s=[500.0, 250.0 * (index + 1)]))
        for length in (64, 128):
            cells = [{"depth": d, "seed": 0, "score": float(acc >= 0.5 + d)} for d in (0.0, 0.5)]
            protocols = ["streamed", "prefill"] if policy == "full" else ["prefill"]
            records.append(record(policy, "passkey", index, cells=cells, length=length, protocols=protocols, held_bytes=kv, params={"length": length}))
    return records


def test_records_round_trip_and_a_cut_last_line_is_skipped(tmp_path):
    path = tmp_path / "results.jsonl"
    first, second = record("full", "perplexity", 0, ppl=3.0), record("full", "memory", 0, footprint_bytes=7)
    append_record(path, first)
    append_record(path, second)
    with open(path, "a") as handle:
        handle.write('{"policy": "window", "ta')  # a write interrupted half way
    assert read_records(path) == [first, second]
    assert read_records(tmp_path / "missing.jsonl") == []


def test_identity_is_what_was_measured_not_the_figures():
    a = record("full", "perplexity", 0, ppl=3.0, params={"tokens": 100})
    assert identity(a) == identity({**a, "ppl": 4.0, "elapsed_s": 9.0, "policy_index": 3})
    assert identity(a) != identity({**a, "params": {"tokens": 200}})
    assert identity(a) != identity({**a, "policy": "window"})
    assert identity(a) != identity({**a, "device": "cuda"})


def test_environment_names_the_libraries():
    env = environment()
    assert {"torch", "transformers", "hf-kvpolicies", "python"} <= set(env["versions"])
    assert env["versions"]["torch"]


def test_tables_carry_values_and_ratios_to_the_full_cache():
    table = summarize(sweep_records())
    assert [row.policy for row in table.rows] == ["full", "window:window=256", "h2o:heavy=2,recent=2"]
    text = markdown(table)
    assert "| window:window=256 | 15.000 (1.50x) | 1.00 (0.12x) | 2.00 | 2.0 (0.12x) |" in text  # no ratio on bytes allocated
    assert "| h2o:heavy=2,recent=2 | 12.500* (1.25x) | 1.00 (0.12x) |" in text  # only its PPL is approximate
    assert "\n* approximate: chunked forwards" in text
    assert "decode ms @64" in text and "decode ms @128" in text
    assert "| recall streamed | recall prefill |" in text
    full = next(line for line in text.splitlines() if line.startswith("| full |"))
    assert full.endswith("| 1.00 ± 0.00 (1.00x) | 1.00 ± 0.00 (1.00x) |")  # full stands for both protocols
    assert "| 0.50 ± 0.50 (0.50x) |" in text  # window: half the cells, the bootstrap's 95% over 4 of them
    assert "KV held = keys and values of the tokens kept" in text
    rows = list(csv.DictReader(io.StringIO(csv_text(table))))
    assert [row["policy"] for row in rows] == ["full", "window:window=256", "h2o:heavy=2,recent=2"]
    assert float(rows[1]["PPL"]) == 15.0 and float(rows[1]["PPL vs full"]) == 1.5
    assert float(rows[2]["tok/s @128"]) == 750.0 and float(rows[2]["tok/s @128 vs full"]) == 3.0
    assert [row["approximate"] for row in rows] == ["", "", "perplexity"]
    tex = latex(table)
    assert tex.count(r"\toprule") == 1 and r"\midrule" in tex and r"\bottomrule" in tex
    assert r"\texttt{window:window=256} & 15.000 (1.50$\times$)" in tex
    assert r"\texttt{h2o:heavy=2,recent=2} & 12.500* (1.25$\times$)" in tex and "% * approximate" in tex
    assert r"\_" not in tex.split(r"\toprule")[0]  # the caption comment is plain
    assert all(line.endswith(r"\\") for line in tex.splitlines() if " & " in line)


def test_plot_legends_label_approximate_figures():
    h2o = summarize(sweep_records()).rows[2]
    assert h2o.label(task="perplexity") == "h2o:heavy=2,recent=2 (approx.)"
    assert h2o.label(task="memory") == "h2o:heavy=2,recent=2"


def test_latex_escapes_spec_characters():
    records = [record("sink:sink_tokens=4,window=252", "perplexity", 0, ppl=5.0, tokens=9)]
    assert r"\texttt{sink:sink\_tokens=4,window=252}" in latex(summarize(records))


def test_no_full_cache_means_no_ratios():
    records = [r for r in sweep_records() if r["policy"] != "full"]
    text = markdown(summarize(records))
    assert "| window:window=256 | 15.000 |" in text and "x)" not in text


def test_later_record_of_a_run_wins_and_rows_keep_sweep_order():
    records = sweep_records()
    shuffled = records[4:] + records[:4] + [record("full", "perplexity", 0, ppl=11.0, tokens=100)]
    table = summarize(shuffled)
    assert [row.policy for row in table.rows][0] == "full"
    assert table.values[0][0] == 11.0


def test_write_report_makes_tables_and_plots(tmp_path):
    text = write_report(tmp_path, sweep_records())
    assert (tmp_path / "summary.md").read_text() == text
    made = sorted(path.name for path in tmp_path.glob("*.png"))
    assert made == sorted([
        "perplexity.png", "memory.png", "latency.png", "frontier_ppl_ratio.png",
        "frontier_recall_mean_streamed.png", "frontier_passkey_streamed.png", "frontier_recall_mean_prefill.png", "frontier_passkey_prefill.png",
    ])
    assert (tmp_path / "frontier_ppl_ratio.png").read_bytes()[:4] == b"\x89PNG"
    assert "passkey @64 prefill" in (tmp_path / "recall.md").read_text()


def test_mixed_setups_get_a_table_each(tmp_path):
    records = sweep_records() + [{**r, "device": "cuda"} for r in sweep_records()]
    parts = sections(records)
    assert [(part.number, part.setup[3], len(part.records)) for part in parts] == [(1, "cpu", 15), (2, "cuda", 15)]
    with pytest.raises(ValueError, match="hold 2 settings .*m, d, cpu float32.*m, d, cuda float32"):
        summarize(records)
    text = write_report(tmp_path, records)
    assert text.count("| full |") == 2 and "## Setting 2 of 2" in text and "_m, d, cuda float32; " in text
    devices = [row["device"] for row in csv.DictReader(io.StringIO((tmp_path / "summary.csv").read_text()))]
    assert devices == ["cpu"] * 3 + ["cuda"] * 3
    assert (tmp_path / "perplexity.png").exists() and (tmp_path / "perplexity-2.png").exists()


def test_figures_of_other_settings_are_never_set_side_by_side(tmp_path):
    """Full and a window over 64 tokens, then full again over 2,000 into the same results: two
    tables, each captioned with its own tokens, the window's ratio taken on the 64-token full cache."""
    def stream(policy, index, tokens, ppl):
        params = {"tokens": tokens, "chunk_size": "auto", "budget": None, "ratio": None}
        return record(policy, "perplexity", index, ppl=ppl, tokens=tokens, params=params, curve_positions=[tokens], curve_ppl=[ppl])

    records = [stream("full", 0, 64, 10.0), stream("window:window=16", 1, 64, 20.0), stream("full", 0, 2000, 8.0)]
    text = write_report(tmp_path, records)
    first, second = text.split("## Setting 2 of 2")
    assert "chunk_size=auto, tokens=64" in first and "| full | 10.000 (1.00x) |" in first and "| window:window=16 | 20.000 (2.00x) |" in first
    assert "chunk_size=auto, tokens=2000" in second and "| full | 8.000 (1.00x) |" in second and "window" not in second
    assert "Plots: perplexity.png" in first and "Plots: perplexity-2.png" in second
    rows = list(csv.DictReader(io.StringIO((tmp_path / "summary.csv").read_text())))
    assert [(row["setting"], row["policy"], row["PPL vs full"]) for row in rows] == [("1", "full", "1.0"), ("1", "window:window=16", "2.0"), ("2", "full", "1.0")]
    assert latex_tables(tmp_path) == 2


def latex_tables(out) -> int:
    return (out / "summary.tex").read_text().count(r"\begin{tabular}")


def test_a_recall_mean_is_left_out_for_a_row_that_lacks_some_of_the_tables_cells():
    records = [r for r in sweep_records() if not (r["policy"] == "full" and r["task"] == "passkey" and r["length"] == 128)]
    table = summarize(records)
    column = [c.title for c in table.columns].index("recall prefill")
    assert [values[column] is None for values in table.values] == [True, False, False]  # full lacks passkey @128


@pytest.mark.parametrize("task", ["perplexity", "memory", "speed", "passkey"])
def test_one_task_alone_renders(task, tmp_path):
    records = [r for r in sweep_records() if r["task"] == task]
    write_report(tmp_path, records)
    assert (tmp_path / "summary.md").read_text().count("\n|") == 5  # header, rule, 3 policies


def test_bootstrap_intervals_on_known_cases():
    from eval.stats import bootstrap

    assert bootstrap([1.0] * 10) == bootstrap([1.0] * 10) and (bootstrap([1.0] * 10).low, bootstrap([1.0] * 10).high) == (1.0, 1.0)
    coin = bootstrap([0.0, 1.0] * 50)  # a fair coin, 100 cells: the binomial half-width is 1.96 * 0.05 = 0.098
    assert coin.mean == 0.5 and 0.085 < coin.half_width < 0.11 and coin.low < 0.5 < coin.high
    assert str(bootstrap([0.25])) == "0.25" and bootstrap([0.25]).half_width == 0
    with pytest.raises(ValueError):
        bootstrap([])


def test_moving_average_smooths_a_spike_and_keeps_a_constant():
    from eval.report import moving_average

    assert moving_average([2.0] * 6) == [2.0] * 6
    assert moving_average([0, 0, 10, 0, 0], window=5) == [10 / 3, 2.5, 2.0, 2.5, 10 / 3]
