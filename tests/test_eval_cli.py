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

import eval.settings as settings_module
import eval.sweep as sweep_module
from eval.cli import main
from eval.data import embedded_text, tokenize
from eval.records import RESULTS, VOLATILE, read_records

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--tokens", "48", "--contexts", "16", "32", "--steps", "2", "--lengths", "420", "--depths", "0.1", "0.9", "--budgets", "--no-progress"]
TASKS = ["--task", "perplexity", "--task", "memory", "--task", "speed", "--task", "passkey"]


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
    args = ["eval", "--model", model, "--text-file", text, "--policy", "full", "--policy", "window:window=16", *TINY, *TASKS, "--out", str(out)]
    assert cli(*args) == 0
    return out, args


def test_sweep_writes_a_record_per_policy_and_task(sweep, tiny):
    out, _ = sweep
    records = read_records(out / RESULTS)
    assert sorted((r["policy"], r["task"], r.get("protocol")) for r in records) == sorted(
        [(p, t, None) for p in ("full", "window:window=16") for t in ("perplexity", "memory", "speed")]
        + [("full", "passkey", "any"), ("window:window=16", "passkey", "streamed"), ("window:window=16", "passkey", "prefill")]
    )
    assert all(r["governed_layers"] == 2 for r in records)
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
    full_memory = next(r for r in records if r["policy"] == "full" and r["task"] == "memory")
    assert window["kept_tokens"] == 16 and window["budget"] == 16 and window["kept_fraction"] == 16 / 47
    assert window["held_bytes"] == 16 / 47 * full_memory["held_bytes"] and full_memory["held_bytes"] <= full_memory["footprint_bytes"]
    passkey = next(r for r in records if r["task"] == "passkey" and r["policy"] == "full")
    assert [(c["depth"], c["seed"]) for c in passkey["cells"]] == [(0.1, 0), (0.9, 0)] and passkey["length"] == 420
    assert passkey["protocols"] == ["streamed", "prefill"] and passkey["protocol_independent"] is True
    assert all(0 <= c["score"] <= 1 for c in passkey["cells"])
    for name in ("summary.md", "summary.csv", "summary.tex", "recall.md", "perplexity.png", "memory.png", "latency.png", "frontier_passkey_streamed.png"):
        assert (out / name).stat().st_size > 0
    assert not list(out.glob("*.lock")) and not (out / ".claims").exists()  # a finished run leaves no lock or claim


def test_chunked_and_token_by_token_traces_sample_the_same_positions(tiny, tmp_path):
    """Full chunks its stream (exact), H2O goes token by token: both traces start at token 1 and
    sample every stride, so the memory plot sets them side by side from the first token."""
    model, text = tiny
    args = ["eval", "--model", model, "--text-file", text, "--policy", "full", "--policy", "h2o:heavy=4,recent=4", *TINY,
            "--tokens", "200", "--task", "memory", "--out", str(tmp_path)]
    assert cli(*args) == 0
    full, h2o = sorted(read_records(tmp_path / RESULTS), key=lambda r: r["policy"])
    assert full["chunk_size"] == 256 and h2o["chunk_size"] == 1
    assert full["footprint_positions"] == h2o["footprint_positions"] == [*range(1, 199, 3), 199]


def test_report_rerenders_identical_tables(sweep):
    out, _ = sweep
    tables = {name: (out / name).read_text() for name in ("summary.md", "summary.csv", "summary.tex", "recall.md", "recall.csv")}
    pictures = sorted(path.name for path in out.glob("*.png"))
    for name in tables:
        (out / name).unlink()
    for path in out.glob("*.png"):
        path.unlink()
    assert cli("report", str(out)) == 0
    assert {name: (out / name).read_text() for name in tables} == tables
    assert sorted(path.name for path in out.glob("*.png")) == pictures


def test_resume_skips_finished_runs(sweep, capsys, monkeypatch):
    out, args = sweep
    before = (out / RESULTS).read_text().splitlines()
    capsys.readouterr()
    with monkeypatch.context() as patch:  # with nothing left to run, the text is not even loaded
        patch.setattr(sweep_module, "load_text", lambda *_: pytest.fail("a complete sweep loaded its text"))
        assert cli(*args) == 0
    assert (out / RESULTS).read_text().splitlines() == before  # nothing ran again
    assert "ppl" not in capsys.readouterr().err
    (out / RESULTS).write_text("\n".join(before[:-2]) + "\n")  # as if interrupted before the last two runs
    assert cli(*args) == 0
    after = read_records(out / RESULTS)
    lost = [json.loads(line) for line in before[-2:]]
    assert len(after) == len(before)
    assert [(r["policy"], r["task"], r.get("protocol")) for r in after[-2:]] == [(r["policy"], r["task"], r.get("protocol")) for r in lost]


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
    assert f"| h2o:heavy=4,recent=4 | 8 | {ppl} |" in (tmp_path / "chunked" / "summary.md").read_text()
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
        (["--task", "nosuch"], "unknown task 'nosuch'"),
        (["--task", "niah_single:keys=3"], "valid options are value"),
        (["--task", "passkey", "--lengths", "20"], "use at least"),
        (["--depths", "2"], "in [0, 1]"),
        (["--protocol", "sideways"], "invalid choice"),
        (["--ratios", "0"], "must be a fraction in (0, 1]"),
        (["--budgets", "0"], "must be an integer >= 1"),
        (["--task", "qa"], "needs a QA --dataset"),
        (["--attn-implementation", "bogus"], "--attn-implementation 'bogus' is not an attention implementation"),
        (["--device-map", "bogus"], "--device-map 'bogus' is neither a strategy"),
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


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_an_out_that_cannot_be_a_folder_exits_2_before_any_work(tiny, tmp_path, capsys, monkeypatch, where):
    model, text = tiny
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    out = blocker if where == "file" else blocker / "results"
    monkeypatch.setattr(sweep_module, "load_model", lambda *_: pytest.fail("the model was loaded before --out was checked"))
    code = cli("eval", "--model", model, "--text-file", text, "--policy", "full", "--task", "perplexity", *TINY, "--out", str(out))
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"--out {str(out)!r}" in err and len(err.splitlines()) == 1, err
    assert blocker.read_text() == "not a folder"


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
            "--policy", "window:window=8", *TINY, *TASKS, "--device", "cpu"]
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

    assert len(stable(tmp_path / "one")) == 14  # 3 x 3 stream measures, recall once for full, twice per window
    assert stable(tmp_path / "two") == stable(tmp_path / "one")

    def rows(path):  # the report of the process that finished last holds every row, in sweep order
        return [line.split(" | ")[0] for line in (path / "summary.md").read_text().splitlines() if line.startswith("| ")]

    assert rows(tmp_path / "two") == rows(tmp_path / "one") == ["| policy", "| full", "| window:window=16", "| window:window=8"]


def test_two_commands_on_one_out_run_each_run_once(tiny, tmp_path):
    """Two ``eval`` commands started side by side on one ``--out`` split its 6 runs by claims (H2O
    streams token by token: each run lasts long enough for the two to overlap)."""
    model, text = tiny
    policies = ("h2o:heavy=4,recent=4", "h2o:heavy=8,recent=8", "window:window=8")
    args = ["-m", "eval.cli", "eval", "--model", model, "--text-file", text, *(f"--policy={p}" for p in policies), *TINY,
            "--tokens", "300", "--task", "perplexity", "--task", "memory", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    both = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    for process in both:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
    records = read_records(tmp_path / RESULTS)
    assert sorted((r["policy"], r["task"]) for r in records) == sorted((p, t) for p in policies for t in ("perplexity", "memory"))
    assert (tmp_path / "summary.md").exists() and sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []


def test_default_policies_skip_the_unregistered_with_a_note(monkeypatch):
    monkeypatch.setattr(settings_module, "available_policies", lambda: ["full", "window"])
    notes = []
    assert settings_module.default_policies(notes.append) == ["full", "window", "full:storage=int4", "full:storage=int2"]
    assert len(notes) == 3 and all(note.startswith("note: skipping default policy") for note in notes)
    assert set(settings_module.default_policies(lambda note: None)) <= set(settings_module.DEFAULT_POLICIES)


def test_every_default_policy_is_registered_and_builds_at_every_default_budget(tiny):
    """The defaults of the README's command, against what the library registers today."""
    from eval.budgets import expand

    assert settings_module.default_policies(pytest.fail) == list(settings_module.DEFAULT_POLICIES)
    model = AutoModelForCausalLM.from_pretrained(tiny[0])
    runs = expand(list(settings_module.DEFAULT_POLICIES), settings_module.DEFAULT_BUDGETS)
    assert len(runs) == 4 + 3 * len(settings_module.DEFAULT_BUDGETS)  # the full cache in four storages once, each bounded family per budget
    for run in runs:
        assert sweep_module.build_policy(model, run.spec(512), "--policy").get_seq_length() == 0


def test_runs_are_dealt_round_robin_keeping_a_stream_and_a_length_together():
    from eval.budgets import PolicyRun

    settings = sweep_module.Settings(lengths=(100, 200), budgets=())
    runs = [PolicyRun(spec) for spec in ("full", "window:window=8", "h2o:heavy=2,recent=2")]
    jobs = sweep_module.jobs_of(settings, runs, ["perplexity", "memory", "speed", "niah_single", "vt"])
    units = sweep_module._units(jobs)
    described = [[(j.run.policy, j.task, j.length, j.protocol) for j in unit] for unit in units]
    assert described[:4] == [
        [("full", "perplexity", None, None), ("full", "memory", None, None)],
        [("full", "speed", None, None)],
        [("full", "niah_single", 100, "any"), ("full", "vt", 100, "any")],
        [("full", "niah_single", 200, "any"), ("full", "vt", 200, "any")],
    ]
    assert [("window:window=8", "niah_single", 100, "streamed"), ("window:window=8", "vt", 100, "streamed")] in described
    assert len(units) == 4 + 2 * (2 + 2 * 2)  # full: one protocol; the bounded: two per length
    first, second = units[0::2], units[1::2]
    assert {j for unit in first + second for j in unit} == set(jobs)


def test_a_policy_that_governs_no_layer_is_refused(tiny, tmp_path, capsys):
    """A run whose policy decides nothing would report the model's figures as the policy's."""
    from hf_kvpolicies import SlidingWindowCache, register_policy

    class Ungoverned(SlidingWindowCache):
        def __init__(self, model, window: int = 4) -> None:
            super().__init__(model, window=window)
            self.governed = [False] * len(self.layers)

    register_policy("ungoverned-test", Ungoverned, overwrite=True)
    model, text = tiny
    code = cli("eval", "--model", model, "--text-file", text, "--policy", "ungoverned-test", *TINY, "--task", "perplexity", "--out", str(tmp_path))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "governs none of the model's 2 layers" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / RESULTS).exists()


def test_a_budget_sweep_records_budgets_and_kept_fractions(tiny, tmp_path):
    model, text = tiny
    args = ["eval", "--model", model, "--text-file", text, "--policy", "full", "--policy", "window", "--policy", "window:window=5",
            *TINY[:-2], "--task", "perplexity", "--no-progress"]
    assert cli(*args, "--budgets", "8", "16", "--out", str(tmp_path / "b")) == 0
    records = {r["label"]: r for r in read_records(tmp_path / "b" / RESULTS)}
    assert sorted(records) == ["full", "window @16", "window @8", "window:window=5"]
    assert [(records[k]["spec"], records[k]["budget"], records[k]["kept_fraction"]) for k in ("window @8", "window @16", "window:window=5")] == [
        ("window:window=8", 8, 8 / 47), ("window:window=16", 16, 16 / 47), ("window:window=5", 5, 5 / 47)
    ]
    assert records["full"]["budget"] is None and records["full"]["kept_fraction"] == 1.0
    assert records["window @8"]["built"] == {"class": "SlidingWindowCache", "parameters": {"window": 8}}
    assert records["full"]["built"] == {"class": "FullCache", "parameters": {}}
    assert "- `window @16`: SlidingWindowCache(window=16)" in (tmp_path / "b" / "summary.md").read_text()
    assert (tmp_path / "b" / "frontier_ppl_ratio.png").stat().st_size > 0
    assert cli(*args, "--ratios", "0.25", "--out", str(tmp_path / "r")) == 0
    ratio = next(r for r in read_records(tmp_path / "r" / RESULTS) if r["label"] == "window @0.25x")
    assert ratio["spec"] == "window:window=12" and ratio["ratio"] == 0.25  # a quarter of the 48-token stream


def test_records_say_what_each_budget_built(tiny, tmp_path):
    """A budget maps onto keywords the library chooses (SnapKV's window, KNorm's recent): each
    record shows the class and the keywords it was built with, whatever they are."""
    from hf_kvpolicies.specs import parse_spec, policy_constructor

    model, text = tiny
    args = ["eval", "--model", model, "--text-file", text, "--policy", "snapkv", "--policy", "knorm", *TINY[:-2],
            "--task", "perplexity", "--budgets", "12", "--no-progress", "--out", str(tmp_path)]
    assert cli(*args) == 0
    records = {r["label"]: r for r in read_records(tmp_path / RESULTS)}
    for name, cls in (("snapkv", "SnapKVCache"), ("knorm", "KNormCache")):
        built = records[f"{name} @12"]["built"]
        assert built == {"class": cls, "parameters": policy_constructor(name).budget_parameters(12)}
        assert built["parameters"] == parse_spec(records[f"{name} @12"]["spec"])[1] and built["parameters"]["budget"] == 12
        keywords = ", ".join(f"{k}={v}" for k, v in built["parameters"].items())
        assert f"- `{name} @12`: {cls}({keywords})" in (tmp_path / "summary.md").read_text()


def test_a_second_sweep_with_other_tokens_gets_a_table_of_its_own(tiny, tmp_path):
    model, text = tiny
    common = ["eval", "--model", model, "--text-file", text, *TINY, "--task", "perplexity", "--out", str(tmp_path)]
    assert cli(*common, "--policy", "full", "--policy", "window:window=16") == 0
    assert cli(*common, "--policy", "full", "--tokens", "200") == 0
    records = read_records(tmp_path / RESULTS)
    ppl = {(r["policy"], r["tokens"]): r["ppl"] for r in records}
    first, second = (tmp_path / "summary.md").read_text().split("## Setting 2 of 2")
    assert "tokens=48" in first and "tokens=200" not in first and "tokens=200" in second and "window" not in second
    ratio = ppl["window:window=16", 48] / ppl["full", 48]
    assert f"| window:window=16 | 16 | {ppl['window:window=16', 48]:.3f} ({ratio:.2f}x) |" in first
    assert f"| full | {ppl['full', 200]:.3f} (1.00x) |" in second
    assert (tmp_path / "perplexity.png").exists() and (tmp_path / "perplexity-2.png").exists()


def test_last_token_kept_is_a_protocol_of_eval(tiny, tmp_path):
    model, text = tiny
    args = ["eval", "--model", model, "--text-file", text, "--policy", "full", "--policy", "window:window=16", *TINY,
            "--task", "passkey", "--protocol", "last-token-kept", "--protocol", "prefill", "--out", str(tmp_path)]
    assert cli(*args) == 0
    records = read_records(tmp_path / RESULTS)
    assert sorted((r["policy"], r["protocol"], r["protocol_ran"], tuple(r["protocols"])) for r in records) == [
        ("full", "any", "prefill", ("last-token-kept", "prefill")),
        ("window:window=16", "last-token-kept", "last-token-kept", ("last-token-kept",)),
        ("window:window=16", "prefill", "prefill", ("prefill",)),
    ]
    kept = next(r for r in records if r["protocol"] == "last-token-kept")
    assert kept["kept_tokens"] == 16 and kept["kept_fraction"] == 16 / 419  # all but the last of the 420 prompt tokens fed
    assert "| recall prefill | recall last-token-kept |" in (tmp_path / "summary.md").read_text()


def test_qa_from_a_local_jsonl_runs_under_every_protocol(tiny, tmp_path):
    model, _ = tiny
    rows = [{"context": embedded_text()[i * 400 : i * 400 + 380], "input": f"What is item {i}?", "answers": [f"item {i}", "x"]} for i in range(3)]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    out = tmp_path / "out"
    args = ["eval", "--model", model, "--dataset", str(data), "--policy", "full", "--policy", "window:window=16", "--task", "qa",
            "--protocol", "streamed", "--protocol", "prefill", "--protocol", "context", "--qa-max-tokens", "300", "--budgets", "--no-progress"]
    assert cli(*args, "--out", str(out)) == 0
    records = read_records(out / RESULTS)
    assert sorted((r["policy"], r["protocol"]) for r in records) == [
        ("full", "any"), ("window:window=16", "context"), ("window:window=16", "prefill"), ("window:window=16", "streamed")
    ]
    for record in records:
        assert record["dataset"].startswith("file:") and len(record["cells"]) == 3
        assert record["f1"] == sum(c["f1"] for c in record["cells"]) / 3 and 0 <= record["exact_match"] <= record["f1"] + 1e-9
    assert "QA F1 context" in (out / "summary.md").read_text()
    assert not any(record["approximate"] for record in records)


def test_chunked_qa_of_a_policy_that_chunks_change_is_labelled_approximate(tiny, tmp_path):
    model, _ = tiny
    rows = [{"context": embedded_text()[:380], "input": "What is item 0?", "answers": ["item 0"]}]
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")
    args = ["eval", "--model", model, "--dataset", str(data), "--policy", "h2o:heavy=4,recent=4", "--task", "qa", "--protocol", "streamed",
            "--qa-max-tokens", "300", "--budgets", "--no-progress"]
    assert cli(*args, "--chunk-size", "8", "--out", str(tmp_path / "chunked")) == 0
    assert cli(*args, "--out", str(tmp_path / "exact")) == 0
    [chunked], [exact] = read_records(tmp_path / "chunked" / RESULTS), read_records(tmp_path / "exact" / RESULTS)
    assert chunked["approximate"] is True and exact["approximate"] is False
    assert '"h2o:heavy=4,recent=4",qa' in (tmp_path / "chunked" / "summary.csv").read_text()


def test_cuda_is_refused_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(sweep_module.UsageError, match="--device cpu"):
        sweep_module.resolve_device("cuda")
    assert sweep_module.resolve_device("auto").type == "cpu"
    assert sweep_module.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert sweep_module.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
