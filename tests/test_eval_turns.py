"""Several questions of one context through ``hf-kvpolicies eval`` and ``report``: per-turn cells in
the records, per-turn columns and the mean over turns in the tables, QA samples with several
questions, and bad input (turns, chat templates) as one line with status 2."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_model

from eval.cli import main
from eval.data import embedded_text
from eval.records import RESULTS, read_records
from eval.report.sections import rows
from eval.tasks import task_for

pytestmark = pytest.mark.usefixtures("one_thread")
MULTITURN = "niah_multiturn:turns=3"
SHARED = ["--protocol", "multiturn", "--protocol", "prefill"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(model folder, text file)``; the model's positions cover a character-level conversation."""
    folder = tmp_path_factory.mktemp("model")
    save_tiny_model(folder, max_position_embeddings=4096)
    text = tmp_path_factory.mktemp("text") / "text.txt"
    text.write_text(embedded_text()[:8000], encoding="utf-8")
    return str(folder), str(text)


def cli(*args: str) -> int:
    try:
        return main(list(args))
    except SystemExit as exit:
        return exit.code


@pytest.fixture(scope="module")
def sweep(tiny, tmp_path_factory, one_thread):
    model, text = tiny
    out = tmp_path_factory.mktemp("turns")
    common = ["--lengths", "800", "--depths", "0.2", "0.7", "--budgets", "--no-progress", "--out", str(out)]
    assert cli("eval", "--model", model, "--text-file", text, "--policy", "window:window=64",
               "--task", MULTITURN, "--task", "passkey", *SHARED, *common) == 0
    return out, read_records(out / RESULTS)


def test_each_question_is_a_cell_with_its_turn_and_one_record_per_run(sweep):
    _, records = sweep
    turned = [r for r in records if r["task"] == MULTITURN]
    assert sorted(r["protocol"] for r in turned) == ["multiturn", "prefill"]  # one record per run, its turns inside
    for record in turned:
        assert [(c["depth"], c["turn"]) for c in record["cells"]] == [(d, t) for d in (0.2, 0.7) for t in (1, 2, 3)]
        assert record["score"] == pytest.approx(sum(c["score"] for c in record["cells"]) / 6)
        assert all(len(c["expected"]) == 1 for c in record["cells"]) and "chat_template" not in record["params"]
    assert all("turn" not in cell for r in records if r["task"] == "passkey" for cell in r["cells"])  # one question: as before
    window = next(r for r in turned if r["protocol"] == "multiturn")
    assert window["kept_tokens"] == 64 and window["kept_fraction"] < 0.1


def test_the_detail_table_gives_each_turn_and_their_mean(sweep):
    out, records = sweep
    table = (out / "recall.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| policy"))
    for protocol in ("prefill", "multiturn"):
        titles = [f"{MULTITURN} @800 {protocol} turn {turn}" for turn in (1, 2, 3)] + [f"{MULTITURN} @800 {protocol} mean"]
        assert f"| {' | '.join(titles)} |" in header, protocol
        assert f"| passkey @800 {protocol} |" in header  # a task of one question keeps its one column
    csv = (out / "recall.csv").read_text().splitlines()
    columns = csv[0].split(",")
    window = next(line.split(",") for line in csv if ",window:window=64," in line)
    turns = [float(window[columns.index(f"{MULTITURN} @800 multiturn turn {turn}")]) for turn in (1, 2, 3)]
    assert float(window[columns.index(f"{MULTITURN} @800 multiturn mean")]) == pytest.approx(sum(turns) / 3, abs=1e-6)
    record = next(r for r in records if r["task"] == MULTITURN and r["protocol"] == "multiturn")
    assert turns == pytest.approx([sum(c["score"] for c in record["cells"] if c["turn"] == t) / 2 for t in (1, 2, 3)], abs=1e-6)


def test_the_frontier_plots_the_mean_over_turns(sweep):
    _, records = sweep
    measures = {m.name: m for m in task_for(MULTITURN).measures(rows(records))}
    assert measures[f"{MULTITURN}_multiturn"].ylabel == f"{MULTITURN} score, multiturn, mean over turns (higher is better)"
    assert measures["passkey_multiturn"].ylabel == "passkey score, multiturn (higher is better)"


def test_a_qa_dataset_with_several_questions_per_document_reports_each_turn(tiny, tmp_path):
    model, _ = tiny
    text = embedded_text()
    samples = [
        {"context": text[i * 900 : (i + 1) * 900], "questions": [{"input": f"What is topic {i}?", "answers": ["x"]}, {"input": "And then?", "answers": ["y", "z"]}]}
        for i in range(2)
    ]
    dataset = tmp_path / "qa.jsonl"
    dataset.write_text("".join(json.dumps(s) + "\n" for s in samples), encoding="utf-8")
    out = tmp_path / "out"
    assert cli("eval", "--model", model, "--dataset", str(dataset), "--task", "qa", "--policy", "window:window=64", "--protocol", "multiturn",
               "--qa-max-tokens", "400", "--budgets", "--no-progress", "--out", str(out)) == 0
    [record] = read_records(out / RESULTS)
    assert [(c["index"], c["turn"], c["expected"]) for c in record["cells"]] == [(0, 1, ["x"]), (0, 2, ["y", "z"]), (1, 1, ["x"]), (1, 2, ["y", "z"])]
    header = next(line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| policy"))
    assert "| QA F1 multiturn turn 1 | QA F1 multiturn turn 2 | QA EM multiturn | QA F1 multiturn |" in header


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "niah_multiturn:turns=0"], "turns=0 must be an integer >= 1"),
        (["--task", "niah_multiturn:turns=30", "--lengths", "800"], "turns=30 needs 30 needles with 98 tokens of text each, more than a 800-token prompt holds: ask for turns="),
        (["--task", MULTITURN, "--lengths", "800", "--chat-template"], "the tokenizer has no chat template: evaluate without --chat-template"),
    ],
)
def test_bad_turns_and_a_missing_chat_template_exit_2_with_one_line(tiny, tmp_path, capsys, args, message):
    model, text = tiny
    code = cli("eval", "--model", model, "--text-file", text, "--policy", "full", "--protocol", "multiturn", "--no-progress", "--out", str(tmp_path), *args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / RESULTS).exists()
