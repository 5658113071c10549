"""The lm-evaluation-harness backend: the ``hf-kvpolicies`` model scores and generates through the
policy (equal to lm-eval's ``hf`` model with a full cache, to a naive reference with a window),
the exported recall tasks score as the harness does, lm-eval's results read into the report, and
bad model arguments are one line."""

from __future__ import annotations

import json
import logging
import sys
from functools import partialmethod
from pathlib import Path

import pytest
import torch
from helpers import streaming_reference
from tiny_models import save_tiny_model

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval extra: pip install 'hf-kvpolicies[lm-eval]'")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import hf_kvpolicies.lm_eval  # noqa: E402,F401  (registers the model)
from eval.cli import main  # noqa: E402
from eval.lm_eval.arguments import ModelArgumentError, check_arguments  # noqa: E402
from eval.lm_eval.held import HeldLog  # noqa: E402
from eval.lm_eval.model import PolicyLM  # noqa: E402
from eval.protocols import answer, first_line  # noqa: E402
from eval.records import RESULTS, read_records  # noqa: E402
from eval.report import read_results  # noqa: E402
from eval.stream import resolve_chunk  # noqa: E402
from eval.sweep import policy_fields  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXTS = ["The quick brown fox", "Hello there, general", "abc", "Hello there, admiral"]
CHOICES = [" jumps", " sits down", "!"]
DOCUMENTS = ["Some document text that is long enough to matter. " * 3, "short one"]
PROMPTS = ["Once upon a time", "The answer is", "x"]


def requests(kind: str, arguments: list[tuple], task: str = "toy") -> list[Instance]:
    return [Instance(kind, {}, args, index, (task, index, 1)) for index, args in enumerate(arguments)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def embedded() -> PolicyLM:
    """The embedded model as lm-eval loads it, once; :func:`use` sets its policy and protocol."""
    return PolicyLM(pretrained="smollm2-135m", device="cpu", batch_size=4)


def use(lm: PolicyLM, policy: str, protocol: str) -> PolicyLM:
    """``lm`` as ``PolicyLM(policy=policy, protocol=protocol)`` would be, without loading the model again."""
    lm.arguments = check_arguments(policy, protocol, None, {})
    lm.described = policy_fields(lm.new_cache(), lm.arguments.spec, None)
    lm.held = HeldLog()
    return lm


@pytest.fixture
def lm_eval_cli(monkeypatch):
    """lm-eval's command line as the tests run it: it indexes its ~14,700 built-in task YAMLs on
    every run (about 20 s here), and the tests' tasks are local, so only ``--include_path`` is
    indexed; the log handler it makes once per process is made again in each test, on that
    test's standard error (the first test's is closed by then)."""
    monkeypatch.setattr(TaskManager, "__init__", partialmethod(TaskManager.__init__, include_defaults=False))
    logger = logging.getLogger("lm_eval")
    stale = lambda: [h for h in logger.handlers if type(h) is logging.StreamHandler]  # noqa: E731
    for handler in stale():
        logger.removeHandler(handler)
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", False)
    yield
    for handler in stale():
        logger.removeHandler(handler)


def write_task(folder: Path, name: str, docs: list[dict], **config: object) -> None:
    """A local lm-eval task: ``name.yaml`` over ``name.jsonl`` (YAML is a superset of JSON)."""
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    spec = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / f"{name}.jsonl")}}, "test_split": "test", **config}
    (folder / f"{name}.yaml").write_text(json.dumps(spec))


def toy_tasks(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    docs = [{"question": context, "choices": CHOICES, "answer": index % 3} for index, context in enumerate(CONTEXTS)]
    write_task(folder, "toy_mc", docs, output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice="choices",
               doc_to_target="answer", metric_list=[{"metric": "acc"}])
    write_task(folder, "toy_gen", [{"prompt": p, "answer": "x"} for p in PROMPTS], output_type="generate_until", doc_to_text="prompt",
               doc_to_target="answer", generation_kwargs={"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
               metric_list=[{"metric": "exact_match"}])
    return folder


# --- a full cache is lm-eval's hf model --------------------------------------------------------
@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_full_cache_scores_and_generates_as_lm_evals_hf_model(tiny, batch_size):
    scored = requests("loglikelihood", [(c, x) for c in CONTEXTS for x in CHOICES] + [("", "no context at all")])
    rolled = requests("loglikelihood_rolling", [(d,) for d in DOCUMENTS])
    generated = requests("generate_until", [(p, {"until": ["\n", "e"], "max_gen_toks": 10, "do_sample": False}) for p in PROMPTS])
    hf = HFLM(pretrained=tiny, device="cpu", batch_size=batch_size)
    expected = hf.loglikelihood(scored), hf.loglikelihood_rolling(rolled), hf.generate_until(generated)
    for protocol in ("prefill", "streamed", "last-token-kept"):
        ours = PolicyLM(pretrained=tiny, device="cpu", batch_size=batch_size, policy="full", protocol=protocol)
        found = ours.loglikelihood(scored)
        assert [greedy for _, greedy in found] == [greedy for _, greedy in expected[0]]
        assert [value for value, _ in found] == pytest.approx([value for value, _ in expected[0]], abs=1e-5)
        assert ours.loglikelihood_rolling(rolled) == pytest.approx(expected[1], rel=1e-5)  # sums over ~150 tokens
        assert ours.generate_until(generated) == expected[2]


# --- a window below the context: every continuation token sees only the kept tokens --------------
@pytest.mark.parametrize("protocol", ["prefill", "streamed"])
def test_a_window_scores_each_continuation_token_from_the_kept_tokens_only(tiny, protocol):
    window = 8
    lm = PolicyLM(pretrained=tiny, device="cpu", batch_size=4, policy=f"window:window={window}", protocol=protocol)
    full = PolicyLM(pretrained=tiny, device="cpu", batch_size=4, policy="full", protocol=protocol)
    generator = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (30, 30, 258)]  # 258: 257 primed, one past a chunk
    continuations = [[5], [7, 9, 11], [13, 15, 17, 19, 21]]
    tokens = [(None, context, continuation) for context in contexts for continuation in continuations]
    found, unbounded = lm._loglikelihood_tokens(tokens), full._loglikelihood_tokens(tokens)
    for (_, context, continuation), (value, greedy), (whole, _) in zip(tokens, found, unbounded):
        ids = torch.tensor([context + continuation[:-1]])
        prefix = len(context) - 1 if protocol == "prefill" else 0  # the context but its last token, prefilled
        logits = streaming_reference(lm.model, ids, window, causal_prefix=prefix)[0, len(context) - 1 :]
        logprobs = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(continuation)
        assert value == pytest.approx(float(logprobs.gather(-1, target[:, None]).sum()), abs=1e-4)
        assert greedy == bool((logprobs.argmax(-1) == target).all())
        assert abs(value - whole) > 1e-3  # the window changes every score, a one-token continuation's too


def test_a_kvzip_cache_is_copied_per_continuation_as_it_scores_each_alone(tiny):
    lm = PolicyLM(pretrained=tiny, device="cpu", batch_size=4, policy="kvzip:budget=16")
    context = torch.randint(3, 100, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    continuations = [[5, 6], [7, 8, 9], [10]]
    together = lm._loglikelihood_tokens([(None, context, c) for c in continuations])
    alone = [lm._loglikelihood_tokens([(None, context, c)])[0] for c in continuations]
    assert [v for v, _ in together] == pytest.approx([v for v, _ in alone], abs=1e-5)


# --- generation: the project's own protocol answers --------------------------------------------
@pytest.mark.parametrize("protocol", ["prefill", "streamed"])
def test_window_generations_equal_the_projects_protocol_answers(embedded, protocol):
    lm = use(embedded, "window:window=32", protocol)
    from pydoc_data.topics import topics

    prompts = [topics["for"][:length] for length in (200, 290, 380)]  # left-padded together in one batch
    kwargs = {"until": [], "max_gen_toks": 5, "do_sample": False}
    texts = lm.generate_until(requests("generate_until", [(p, dict(kwargs)) for p in prompts]))
    for prompt, text in zip(prompts, texts):
        ids = lm.tokenizer(prompt, return_tensors="pt").input_ids
        chunk, _ = resolve_chunk(lm.new_cache(), lm.model, None)  # as the harness streams: exact chunks
        alone = answer(lm.model, lm.tokenizer, ids, ids[:, :0], lm.new_cache, protocol, 5, chunk)
        assert first_line(text) == alone.texts[0]


# --- exported tasks: lm-eval scores them as the harness does -----------------------------------
def test_an_exported_recall_task_scores_in_lm_eval_as_in_the_harness(tmp_path, embedded, capsys):
    tasks, out = tmp_path / "tasks", tmp_path / "runs"
    cells = ["--task", "niah_single", "--lengths", "160", "--depths", "0.1", "0.2", "--seeds", "1"]  # cells whose text lm-eval tokenises back
    assert main(["export-lm-eval", str(tasks), *cells]) == 0
    assert "warning" not in capsys.readouterr().err  # (the export counts the prompts whose tokens come back otherwise)
    policy = "window:window=128"
    assert main(["eval", "--policy", policy, "--budgets", "--protocol", "prefill", "--out", str(out), "--no-progress", *cells]) == 0
    [harness] = read_records(out / RESULTS)

    lm = use(embedded, policy, "prefill")
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    results = lm_eval.simple_evaluate(model=lm, tasks=["kvp_niah_single_160"], task_manager=manager, log_samples=True)
    samples = results.pop("samples")["kvp_niah_single_160"]
    answers = {(s["doc"]["depth"], s["doc"]["seed"]): first_line(s["filtered_resps"][0]) for s in samples}
    assert answers == {(cell["depth"], cell["seed"]): cell["answer"] for cell in harness["cells"]}
    assert results["results"]["kvp_niah_single_160"]["score,none"] == pytest.approx(harness["score"])

    (out / "smollm2-135m").mkdir()
    (out / "smollm2-135m" / "results_2026-01-01T00-00-00.json").write_text(json.dumps(results, default=str))
    records = read_results(out)  # the harness's records and lm-eval's, side by side
    assert {record["task"] for record in records} == {"niah_single", "lm_eval:kvp_niah_single_160"}
    [imported] = [record for record in records if record["task"].startswith("lm_eval:")]
    assert imported["metrics"]["score,none"] == pytest.approx(harness["score"])
    assert (imported["spec"], imported["protocol"], imported["budget"]) == (policy, "prefill", 128)
    assert imported["held_bytes"] == harness["held_bytes"]


def test_export_refuses_what_the_harness_refuses_in_one_line(tmp_path, capsys):
    assert main(["export-lm-eval", str(tmp_path), "--task", "passkey", "--lengths", "20"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "too short" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["export-lm-eval", str(tmp_path), "--task", "nope"])
    assert exit_info.value.code == 2 and "unknown recall task 'nope'" in capsys.readouterr().err


# --- the command line, records and the report -------------------------------------------------
def test_lm_eval_runs_through_the_command_line_and_its_results_reach_the_report(tmp_path, tiny, lm_eval_cli, capsys):
    tasks, out = toy_tasks(tmp_path / "tasks"), tmp_path / "runs"
    common = ["--model", "hf-kvpolicies", "--tasks", "toy_mc,toy_gen", "--include_path", str(tasks), "--output_path", str(out), "--device", "cpu"]
    for arguments in (f"pretrained={tiny},policy=full", f"pretrained={tiny},policy=window,budget=4,protocol=streamed"):
        assert main(["lm-eval", *common, "--model_args", arguments]) == 0
    assert main(["lm-eval", *common, "--model", "hf", "--model_args", f"pretrained={tiny}"]) == 0  # lm-eval's own model
    (out / "results_damaged.json").write_text("{")  # not lm-eval's results: passed over
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    summary = (out / "summary.md").read_text()
    assert "toy_mc acc streamed" in summary and "window @4" in summary
    assert (out / "frontier_lm_eval_toy_mc_acc_streamed.png").exists()
    records = {(r["label"], r["task"]): r for r in read_results(out)}
    window = records[("window @4", "lm_eval:toy_mc")]
    assert (window["spec"], window["budget"], window["protocol"], window["bounded"]) == ("window:window=4", 4, "streamed", True)
    assert window["held_bytes"] < records[("full", "lm_eval:toy_mc")]["held_bytes"]
    assert records[("full", "lm_eval:toy_gen")]["protocols"] == ["streamed"]  # a full cache stands for the protocol run beside it
    hf = records[("hf (lm-eval's model)", "lm_eval:toy_mc")]
    assert (hf["bounded"], hf["metrics"]) == (False, records[("full", "lm_eval:toy_mc")]["metrics"])


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ("policy=nope", "unknown policy 'nope'"),
        ("policy=window:windw=8", "has no parameter 'windw'"),
        ("policy=window:window=0", "window=0"),
        ("policy=full,protocol=sideways", "unknown protocol='sideways'"),
        ("policy=full,protocol=context", "keeps a question apart"),
        ("policy=sink:sink_tokens=4,window=60", "lost window=60 to lm-eval's splitting"),
        ("policy=full,budget=64", "keeps every token"),
    ],
)
def test_bad_model_arguments_exit_with_one_line(tmp_path, tiny, lm_eval_cli, capsys, arguments, problem):
    tasks = toy_tasks(tmp_path / "tasks")
    argv = ["lm-eval", "--model", "hf-kvpolicies", "--model_args", f"pretrained={tiny},{arguments}", "--tasks", "toy_mc", "--include_path", str(tasks), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hf-kvpolicies lm-eval: error: ") and problem in last


def test_a_missing_lm_eval_is_named_with_its_install_line(monkeypatch, capsys):
    import eval.lm_eval.command as command

    monkeypatch.setattr(command.importlib.util, "find_spec", lambda name: None)
    assert main(["lm-eval", "--tasks", "toy"]) == 2
    assert capsys.readouterr().err.strip() == "hf-kvpolicies lm-eval: error: lm-eval is not installed: pip install 'hf-kvpolicies[lm-eval]'"


def test_model_arguments_are_checked_before_anything_loads():
    checked = check_arguments("snapkv", "streamed", 64, {"attn_implementation": "sdpa"})
    assert (checked.spec, checked.run.label, checked.feeding.streams) == ("snapkv:budget=64,window=16,kernel=9", "snapkv @64", True)
    with pytest.raises(ModelArgumentError, match="budget=0 must be an integer >= 1"):
        check_arguments("window", "prefill", 0, {})
    with pytest.raises(ModelArgumentError, match="sets its own budget"):
        check_arguments("window:window=8", "prefill", 16, {})
