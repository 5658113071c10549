"""Tasks are plug-ins: a task registered from outside runs through ``eval`` and ``report`` with its
own option, column and imported records, as ``docs/evaluation.md`` says a new task does."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import save_tiny_model

from eval import fields as f
from eval.cli import main
from eval.data import embedded_text
from eval.records import RESULTS, read_records
from eval.tasks import TASKS, Column, Task, register_task, task_for
from eval.tasks.cells import figure, records_of

pytestmark = pytest.mark.usefixtures("one_thread")


class Kept(Task):
    """Tokens the cache keeps after one forward over the first ``--tokens`` tokens."""

    name = "kept"
    summary = "kept: tokens a cache keeps after one forward over --tokens tokens"
    fields = {"kept_tokens": f.count}

    def add_arguments(self, parser):
        parser.add_argument("--kept-note", default="plain", help="a word recorded with each kept record, e.g. --kept-note warm")

    def params(self, settings, job):
        return {"tokens": settings.tokens, "note": settings.options["kept_note"]}

    def context(self, settings, job):
        return settings.tokens

    def stream_tokens(self, settings):
        return settings.tokens

    def run(self, bench, unit, jobs):
        cache = unit.make()
        with torch.no_grad():
            bench.model(bench.ids[:, : bench.settings.tokens], cache=cache)
        for job in jobs:
            yield job, {"kept_tokens": cache.kept_tokens(), "approximate": False, "elapsed_s": 0.0}

    def headline(self, record):
        return f"kept {record['kept_tokens']} tokens"

    def columns(self, rows):
        if not any(row.record(self.name) for row in rows):
            return []
        return [Column("kept", self.name, figure(self.name, "kept_tokens"), 0, records_of(self.name))]

    def import_records(self, folder):
        path = folder / "kept-elsewhere.json"
        return json.loads(path.read_text()) if path.exists() else []


@pytest.fixture
def kept():
    task = Kept()
    register_task(task)
    yield task
    TASKS.remove(task)


def test_a_registered_task_runs_through_the_sweep_and_the_report(kept, tmp_path, capsys):
    model = save_tiny_model(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(embedded_text()[:4000], encoding="utf-8")
    out = tmp_path / "out"
    args = ["eval", "--model", str(model), "--text-file", str(text), "--policy", "full", "--policy", "window:window=8",
            "--task", "kept", "--kept-note", "warm", "--tokens", "32", "--budgets", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    records = {r["policy"]: r for r in read_records(out / RESULTS)}
    assert {p: (r["kept_tokens"], r["params"]) for p, r in records.items()} == {
        "full": (32, {"tokens": 32, "note": "warm", "budget": None, "ratio": None}),
        "window:window=8": (8, {"tokens": 32, "note": "warm", "budget": None, "ratio": None}),
    }
    assert "kept 8 tokens" in capsys.readouterr().err
    summary = (out / "summary.md").read_text()
    assert "kept: note=warm, tokens=32" in summary
    assert "| full |  | 32 (1.00x) |" in summary and "| window:window=8 | 8 | 8 (0.25x) |" in summary
    foreign = {**records["full"], "label": "elsewhere", "policy": "full:storage=fp8", "kept_tokens": 16}
    (out / "kept-elsewhere.json").write_text(json.dumps([foreign, {**foreign, "kept_tokens": "many"}]))
    assert main(["report", str(out)]) == 0
    assert "| elsewhere |  | 16 (0.50x) |" in (out / "summary.md").read_text()
    assert "kept import from" in capsys.readouterr().err  # the second record, its kept_tokens a string, skipped


def test_every_task_name_finds_its_task_and_unknown_ones_say_what_there_is():
    assert [task_for(name).name for name in ("perplexity", "memory", "speed", "niah_single:value=uuid", "passkey", "qa")] == [
        "perplexity", "memory", "speed", "recall", "recall", "qa"
    ]
    with pytest.raises(ValueError, match="unknown task 'nosuch': choose one of perplexity, memory, speed, niah_single"):
        task_for("nosuch")
