"""``results.jsonl`` under damage: cut lines, bytes that are not UTF-8, lines that are not records.

The sweep's measurements are replaced by records made up from the jobs (the model is never
loaded), so that a resume can be run once per byte offset of a cut record.
"""

from __future__ import annotations

import json

import pytest

import eval.report.write as report_writer
import eval.sweep as sweep_module
from eval.records import RESULTS, append_record, identity, read_records
from eval.tasks import Bench
from eval.tasks.perplexity import Perplexity

POLICIES = ["full", "window:window=8"]


def made_up(task, bench, unit, jobs):
    """What the perplexity task yields, without a forward: a made-up figure per job."""
    for job in jobs:
        ppl = 10.0 + job.index
        yield job, {"ppl": ppl, "tokens": bench.settings.tokens, "curve_positions": [24, 47], "curve_ppl": [ppl, ppl],
                    "approximate": False, "elapsed_s": 0.0}


@pytest.fixture
def offline(monkeypatch):
    """The sweep with made-up perplexities and no text to load (a tiny model only builds the
    caches); the plots left out."""
    from tiny_models import tiny_llama

    model = tiny_llama()
    monkeypatch.setattr(sweep_module, "_prepare", lambda settings, jobs, device, dtype: Bench(settings, model, None, None, "", []))
    monkeypatch.setattr(Perplexity, "run", made_up)
    monkeypatch.setattr(report_writer, "plots", lambda table, out, style: [])


def resume(out, warnings: list[str]) -> sweep_module.Sweep:
    settings = sweep_module.Settings(tokens=48, budgets=(), out=out, progress=False, text_file=str(out.parent / "ü€.txt"))
    return sweep_module.run_sweep(settings, POLICIES, ["perplexity"], warnings.append)


@pytest.mark.parametrize("encoding", ["ascii", "utf-8"])
def test_a_resume_after_a_cut_at_any_byte_of_the_last_record_keeps_every_record(tmp_path, offline, encoding):
    """The last record cut at every byte offset (written as today's ASCII, or as UTF-8 with its
    "ü€" path in the clear, so that cuts fall inside multi-byte characters): the resume runs the
    cut run again, on a line of its own, every record reads back, and the report is written."""
    whole = tmp_path / "whole"
    assert resume(whole, []).complete
    records = read_records(whole / RESULTS)
    assert len(records) == 2 and "\\u00fc\\u20ac" in (whole / RESULTS).read_text()
    first = json.dumps(records[0], sort_keys=True).encode() + b"\n"
    last = json.dumps(records[1], sort_keys=True, ensure_ascii=encoding == "ascii").encode("utf-8")
    assert len(last) > 200 and (encoding == "ascii") == last.isascii()
    out = tmp_path / "cut"
    for offset in range(len(last) + 1):
        out.mkdir(exist_ok=True)
        (out / RESULTS).write_bytes(first + last[:offset])
        (out / "summary.md").unlink(missing_ok=True)
        warnings: list[str] = []
        sweep = resume(out, warnings)
        assert sweep.complete, offset
        again = read_records(out / RESULTS, warnings.append)
        assert [identity(r) for r in again] == [identity(r) for r in records], offset
        assert [r["ppl"] for r in again] == [10.0, 11.0], offset
        assert "| window:window=8 | 8 | 11.000 (1.10x) |" in (out / "summary.md").read_text(), offset
        assert len(sweep.ran) == (0 if offset == len(last) else 1), offset
        cut = 0 < offset < len(last)  # twice: the sweep's reading for its report, and this one
        assert len(warnings) == 2 * cut and all(f"{RESULTS}, line 2: " in w for w in warnings), (offset, warnings)


def test_an_append_after_a_cut_line_starts_a_line_of_its_own(tmp_path):
    path = tmp_path / RESULTS
    path.write_bytes(b'{"policy": "full", "task": "perplexity", "params": {}}\n{"policy": "win')
    append_record(path, {"policy": "window", "task": "perplexity", "params": {}, "dataset": "file:/ü€.txt"})
    lines = path.read_bytes().split(b"\n")
    assert lines[1] == b'{"policy": "win' and lines[2].isascii() and lines[3] == b""
    warnings: list[str] = []
    assert [r["policy"] for r in read_records(path, warnings.append)] == ["full", "window"]
    assert read_records(path)[1]["dataset"] == "file:/ü€.txt"
    assert warnings == [f"{path}, line 2: not a JSON record (a write cut short?): skipped"]
    assert not list(tmp_path.glob("*.lock"))  # the lock is taken on the results file itself


def test_report_skips_each_damaged_line_with_one_warning_and_reports_the_rest(tmp_path, capsys):
    from eval.cli import main
    from test_eval_report import sweep_records

    good = sweep_records()
    full = next(r for r in good if r["policy"] == "full" and r["task"] == "perplexity")
    damaged = [
        (b"[1, 2]", "a JSON list, not a record"),
        (b'"a string"', "a JSON str, not a record"),
        (json.dumps({k: v for k, v in full.items() if k != "task"}).encode(), "no 'task'"),
        (json.dumps({k: v for k, v in full.items() if k != "policy"}).encode(), "no 'policy'"),
        (json.dumps({**full, "ppl": None}).encode(), "'ppl' that is null, not a finite number"),
        (json.dumps({**full, "ppl": "9.5"}).encode(), "'ppl' that is '9.5', not a finite number"),
        (json.dumps({**full, "ppl": float("nan")}).encode(), "'ppl' that is nan, not a finite number"),
        (json.dumps({**full, "params": "tokens=100"}).encode(), "'params' that is 'tokens=100', not an object"),
        (json.dumps({k: v for k, v in full.items() if k != "curve_ppl"}).encode(), "no 'curve_ppl'"),
        (b'{"policy": "full", "task": "perplexity", "dataset": "\xff\xfe"}', "not UTF-8"),
    ]
    lines = [json.dumps(r).encode() for r in good[:5]] + [line for line, _ in damaged] + [json.dumps(r).encode() for r in good[5:]]
    (tmp_path / RESULTS).write_bytes(b"\n".join(lines) + b"\n")
    assert main(["report", str(tmp_path)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == len(damaged), err
    for number, ((_, reason), line) in enumerate(zip(damaged, err), start=6):
        assert line.startswith(f"hf-kvpolicies report: warning: {tmp_path / RESULTS}, line {number}: ") and reason in line, line
        assert line.endswith(": skipped")
    text = (tmp_path / "summary.md").read_text()
    assert "| full | 10.000 (1.00x) |" in text and "| window:window=256 | 15.000 (1.50x) |" in text


FUZZ = [None, "x", float("nan"), float("inf"), -1, [], {}, True, [None], [{}]]


def test_no_value_of_any_field_makes_the_report_raise():
    """Each field of a record of every task replaced by each value of ``FUZZ``: the record is
    refused with a reason, or the tables render (the report reads no field it has not checked)."""
    from test_eval_report import sweep_records

    from eval.report import csv_text, latex, markdown, sections, tabulate
    from eval.report import record_problem as problem

    good = sweep_records()
    samples = {r["task"]: i for i, r in enumerate(good) if r["policy"] == "window:window=256"}
    refused = rendered = 0
    for index in samples.values():
        for field in good[index]:
            for value in FUZZ:
                records = [*good[:index], {**good[index], field: value}, *good[index + 1 :]]
                if any(problem(r) for r in records):
                    refused += 1
                    continue
                for section in sections(records):
                    table = tabulate(section)
                    markdown(table), csv_text(table), latex(table)
                rendered += 1
    assert refused > 100 and rendered > 20


def test_a_process_passes_by_a_unit_another_process_holds_and_the_last_one_reports(tmp_path, offline, monkeypatch):
    """While this process measures the full cache (its claim held), a second sweep on the same
    ``--out`` starts: it leaves the full cache alone and does the window; the first then finds the
    window done, and, finishing last, writes the report. Every run once, no claim left behind."""
    nested: list[sweep_module.Sweep] = []

    def measure(task, bench, unit, jobs):
        if unit.run.policy == "full" and not nested:
            nested.append(resume(tmp_path / "out", []))  # the second process, started meanwhile
        yield from made_up(task, bench, unit, jobs)

    monkeypatch.setattr(Perplexity, "run", measure)
    first = resume(tmp_path / "out", [])
    [second] = nested
    assert [job.run.policy for job in second.ran] == ["window:window=8"] and not second.complete
    assert [job.run.policy for job in first.ran] == ["full"] and first.complete
    records = read_records(tmp_path / "out" / RESULTS)
    assert sorted(r["policy"] for r in records) == ["full", "window:window=8"]
    assert (tmp_path / "out" / "summary.md").exists() and not (tmp_path / "out" / ".claims").exists()


def test_the_claim_a_killed_process_left_behind_does_not_block_a_resume(tmp_path, offline, monkeypatch):
    from eval import claims

    keys: list[str] = []
    real = sweep_module.claimed
    monkeypatch.setattr(sweep_module, "claimed", lambda out, key: keys.append(key) or real(out, key))
    assert resume(tmp_path / "whole", []).complete and len(keys) == 2
    out = tmp_path / "killed"
    for key in keys:  # a killed process's claim: its file stays, its lock went with the process
        claims.claim_path(out, key).parent.mkdir(parents=True, exist_ok=True)
        claims.claim_path(out, key).write_text("host pid 1 since 2026-01-01T00:00:00+00:00\n")
    sweep = resume(out, [])
    assert sweep.complete and len(sweep.ran) == 2 and len(read_records(out / RESULTS)) == 2
    assert not (out / ".claims").exists()
