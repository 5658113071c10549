"""``hf-kvpolicies eval`` / ``report`` end to end on a tiny model saved to a folder (``--model PATH``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import eval.sweep as sweep_module
from eval.cli import main
from eval.data import embedded_text, tokenize
from eval.records import RESULTS, VOLATILE, read_records

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--tokens", "48", "--contexts", "16", "32", "--steps", "2", "--passkey-lengths", "260", "--passkey-depths", "0.1", "0.9", "--no-progress"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(model folder, text file)``: what a user without the Hub points the CLI at."""
    folder = tmp_path_factory.mktemp("model")
    save_tiny_model(folder)
    text = tmp_path_factory.mktemp("text") / "text.txt"
    text.write_text(embedded_text()[:6000], encoding="utf-8")
    return str(folder), str(text)


def cli(*args: str) -> int:
    """Exit status of ``hf-kvpolicies ARGS`` run in this process (argparse exits, our errors return)."""
    try:
        return main(list(args))
    except SystemExit as exit:
        return exit.code


@pytest.fixture(scope="module")
def sweep(tiny, tmp_path_factory, one_thread):
    model, text = tiny
    out = tmp_path_factory.mktemp("sweep")
    args = ["eval", "--model", model, "--text-file", text, "--policy", "full", "--policy", "window:window=16", *TINY, "--out", str(out)]
    assert cli(*args) == 0
    return out, args


def test_sweep_writes_a_record_per_policy_and_task(sweep, tiny):
    out, _ = sweep
    records = read_records(out / RESULTS)
    assert sorted((r["policy"], r["task"]) for r in records) == sorted(
        (p, t) for p in ("full", "window:window=16") for t in ("perplexity", "memory", "speed", "passkey")
    )
    for r in records:
        assert r["model"] == tiny[0] and r["dataset"].startswith("file:") and r["device"] == "cpu"
        assert r["dtype"] == "float32" and r["versions"]["transformers"] and "git_revision" in r
    full = next(r for r in records if r["policy"] == "full" and r["task"] == "perplexity")
    assert full["tokens"] == 48 and full["approximate"] is False and full["chunk_size"] == 256
    model = AutoModelForCausalLM.from_pretrained(tiny[0])
    ids = tokenize(AutoTokenizer.from_pretrained(tiny[0]), open(tiny[1]).read(), 48)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    assert full["ppl"] == pytest.approx(math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]))), rel=1e-4)
    window = next(r for r in records if r["policy"] == "window:window=16" and r["task"] == "memory")
    assert window["kept_tokens"] == 16 and window["footprint_bytes"] < next(
        r["footprint_bytes"] for r in records if r["policy"] == "full" and r["task"] == "memory"
    )
    passkey = next(r for r in records if r["task"] == "passkey")
    assert [(c["length"], c["depth"]) for c in passkey["cells"]] == [(260, 0.1), (260, 0.9)]
    for name in ("summary.md", "summary.csv", "summary.tex", "perplexity.png", "memory.png", "latency.png", "passkey.png"):
        assert (out / name).stat().st_size > 0


def test_report_rerenders_identical_tables(sweep):
    out, _ = sweep
    tables = {name: (out / name).read_text() for name in ("summary.md", "summary.csv", "summary.tex")}
    for name in tables:
        (out / name).unlink()
    assert cli("report", str(out)) == 0
    assert {name: (out / name).read_text() for name in tables} == tables


def test_resume_skips_finished_runs(sweep, capsys):
    out, args = sweep
    before = (out / RESULTS).read_text().splitlines()
    capsys.readouterr()
    assert cli(*args) == 0
    assert (out / RESULTS).read_text().splitlines() == before  # nothing ran again
    assert "ppl" not in capsys.readouterr().err
    (out / RESULTS).write_text("\n".join(before[:-2]) + "\n")  # as if interrupted before the last two runs
    assert cli(*args) == 0
    after = read_records(out / RESULTS)
    lost = [json.loads(line) for line in before[-2:]]
    assert len(after) == len(before)
    assert [(r["policy"], r["task"]) for r in after[-2:]] == [(r["policy"], r["task"]) for r in lost]


def test_chunked_h2o_is_labelled_approximate_everywhere(tiny, tmp_path):
    model, text = tiny
    common = ["eval", "--model", model, "--text-file", text, "--policy", "h2o:heavy=4,recent=4", "--task", "perplexity"]
    assert cli(*common, *TINY, "--out", str(tmp_path / "exact")) == 0
    assert cli(*common, *TINY, "--chunk-size", "8", "--out", str(tmp_path / "chunked")) == 0
    [exact] = read_records(tmp_path / "exact" / RESULTS)
    [chunked] = read_records(tmp_path / "chunked" / RESULTS)
    assert (exact["chunk_size"], exact["approximate"]) == (1, False)
    assert (chunked["chunk_size"], chunked["approximate"]) == (8, True)
    ppl = f"{chunked['ppl']:.3f}*"
    assert f"| h2o:heavy=4,recent=4 | {ppl} |" in (tmp_path / "chunked" / "summary.md").read_text()
    assert "*" not in (tmp_path / "exact" / "summary.md").read_text().replace("_", "")
    assert '"h2o:heavy=4,recent=4",perplexity,' in (tmp_path / "chunked" / "summary.csv").read_text()
    assert ppl in (tmp_path / "chunked" / "summary.tex").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "nosuch"], "unknown policy 'nosuch'"),
        (["--policy", "window:size=3"], "no parameter 'size'"),
        (["--policy", "window:window=0"], "window must be an integer >= 1"),
        (["--policy", "full", "--policy", "full"], "given twice"),
        (["--dataset", "nosuch"], "--text-file PATH"),
        (["--tokens", "0"], "--tokens: must be an integer >= 2, got 0"),
        (["--tokens", "many"], "--tokens: must be an integer"),
        (["--text-file", "/no/such/file.txt"], "does not exist"),
        (["--task", "nosuch"], "invalid choice"),
        (["--passkey-lengths", "20"], "use at least"),
        (["--passkey-depths", "2"], "in [0, 1]"),
        (["--tokens", "100000"], "lower --tokens"),
    ],
)
def test_bad_input_exits_2_with_one_line(tiny, tmp_path, capsys, args, message):
    model, text = tiny
    base = ["eval", "--model", model, *(["--text-file", text] if "--dataset" not in args and "--text-file" not in args else [])]
    code = cli(*base, "--no-progress", "--out", str(tmp_path), *args)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / RESULTS).exists()


def test_a_missing_model_and_an_empty_report_exit_2(tmp_path, capsys):
    assert cli("eval", "--model", str(tmp_path / "nothing"), "--no-progress", "--out", str(tmp_path)) == 2
    assert "cannot load model" in capsys.readouterr().err
    assert cli("report", str(tmp_path)) == 2
    assert "no records" in capsys.readouterr().err


def test_console_script_names_text_file_when_the_hub_is_unreachable(tmp_path):
    """The installed command, offline: status 2 and one line naming --text-file, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [str(Path(sys.executable).parent / "hf-kvpolicies"), "eval", "--dataset", "wikitext2", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert "wikitext2" in done.stderr and "--text-file PATH" in done.stderr


def test_two_processes_write_the_records_of_one(tiny, tmp_path):
    """``accelerate launch`` with 2 CPU processes splits the runs; the records match one process's."""
    model, text = tiny
    args = ["eval", "--model", model, "--text-file", text, "--policy", "full", "--policy", "window:window=16",
            "--policy", "window:window=8", *TINY, "--device", "cpu"]
    assert cli(*args, "--out", str(tmp_path / "one")) == 0  # one thread here, as in the launched processes
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29731"]
    two = subprocess.run([*launch, "-m", "eval.cli", *args, "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]

    def stable(path):
        records = read_records(path / RESULTS)
        return sorted(
            (json.dumps({k: v for k, v in r.items() if k not in VOLATILE}, sort_keys=True) for r in records)
        )

    assert len(stable(tmp_path / "one")) == 12
    assert stable(tmp_path / "two") == stable(tmp_path / "one")

    def rows(path):  # the report of the process that finished last holds every row, in sweep order
        return [line.split(" | ")[0] for line in (path / "summary.md").read_text().splitlines() if line.startswith("| ")]

    assert rows(tmp_path / "two") == rows(tmp_path / "one") == ["| policy", "| full", "| window:window=16", "| window:window=8"]


def test_default_policies_skip_the_unregistered_with_a_note(monkeypatch):
    monkeypatch.setattr(sweep_module, "available_policies", lambda: ["full", "window"])
    notes = []
    assert sweep_module.default_policies(notes.append) == ["full", "window:window=256"]
    assert len(notes) == 3 and all(note.startswith("note: skipping default policy") for note in notes)
    assert set(sweep_module.default_policies(lambda note: None)) <= set(sweep_module.DEFAULT_POLICIES)


def test_every_default_policy_is_registered_and_builds(tiny):
    """The defaults of the README's command, against what the library registers today."""
    assert sweep_module.default_policies(pytest.fail) == list(sweep_module.DEFAULT_POLICIES)
    model = AutoModelForCausalLM.from_pretrained(tiny[0])
    for spec in sweep_module.DEFAULT_POLICIES:
        assert sweep_module._build(model, spec).get_seq_length() == 0


def test_runs_are_dealt_round_robin_keeping_a_stream_together():
    jobs = [sweep_module.Job(p, t, i) for i, p in enumerate("abc") for t in sweep_module.TASKS]
    units = sweep_module._units(jobs)
    assert [[(j.policy, j.task) for j in unit] for unit in units[:3]] == [
        [("a", "perplexity"), ("a", "memory")], [("a", "speed")], [("a", "passkey")]
    ]
    first, second = units[0::2], units[1::2]
    assert {j for unit in first + second for j in unit} == set(jobs)
    assert len(first) == 5 and len(second) == 4


def test_cuda_is_refused_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(sweep_module.UsageError, match="--device cpu"):
        sweep_module.resolve_device("cuda")
    assert sweep_module.resolve_device("auto").type == "cpu"
    assert sweep_module.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert sweep_module.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
