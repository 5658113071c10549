"""The project's tasks as lm-eval tasks (``hf-kvpolicies export-lm-eval DIR``): each recall task at
each length, a document per depth and seed, and a QA JSONL, written as lm-eval task YAMLs over
local JSONL files, so that ``lm-eval --include_path DIR --tasks kvp_recall`` runs them offline.

The prompts are the harness's own cases (:mod:`eval.recall`, :mod:`eval.qa`) written as text,
which lm-eval tokenises again: the export counts the prompts whose tokens then differ from the
harness's. Answers are scored as the harness scores them (:func:`recall_results`,
:func:`qa_results`: the first non-empty line, then RULER's string match, or exact match and token
F1), decoded greedily with no stop but EOS, for the most answer tokens of the task's cases (the
harness decodes the most of the prompts it batches together, so answers whose first line runs
longer than that may differ).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hf_kvpolicies.models import pretrained_path
from hf_kvpolicies.special_tokens import start_ids

from ..protocols import first_line
from ..qa import exact_match, make_qa_case, token_f1
from ..recall import parse_task, score_answer
from ..settings import Settings, UsageError
from ..sweep import inputs
from ..tasks.base import Bench
from ..tasks.recall import _case

PREFIX = "kvp_"
RECALL_TAG = "kvp_recall"
QA_TASK = "kvp_qa"


@dataclass
class Exported:
    """What an export wrote: the lm-eval task names, the prompts, and how many of them lm-eval's
    tokenisation of their text turns into other tokens than the harness's."""

    tasks: list[str] = field(default_factory=list)
    prompts: int = 0
    retokenized: int = 0


def task_name(recall_task: str, length: int) -> str:
    """``niah_single:value=uuid`` at 512 tokens as ``kvp_niah_single_value_uuid_512``."""
    return PREFIX + re.sub(r"[^A-Za-z0-9]+", "_", recall_task).strip("_") + f"_{length}"


def export_tasks(out: Path, settings: Settings, tasks: Sequence[str]) -> Exported:
    """The recall ``tasks`` at the settings' lengths, depths and seeds, over the settings' text, with
    the tokenizer of the settings' model; a QA dataset's samples as :data:`QA_TASK` besides."""
    try:
        extra = {"gguf_file": settings.gguf_file} if settings.gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(pretrained_path(settings.model), **extra)
    except (OSError, ValueError, ModuleNotFoundError) as error:
        raise UsageError(f"cannot load the tokenizer of --model {settings.model!r} ({str(error).strip().splitlines()[0]})") from error
    text, samples = inputs(settings)
    try:
        done = export_recall(out, tokenizer, text, tasks, settings.lengths, settings.depths, settings.seeds)
    except ValueError as error:
        raise UsageError(str(error)) from error
    if samples:
        qa = export_qa(out, tokenizer, samples, settings.qa_max_tokens, settings.dataset)
        done = Exported(done.tasks + qa.tasks, done.prompts + qa.prompts, done.retokenized + qa.retokenized)
    return done


def export_recall(
    out: Path, tokenizer: PreTrainedTokenizerBase, text: str, tasks: Sequence[str],
    lengths: Sequence[int], depths: Sequence[float], seeds: Sequence[int],
) -> Exported:
    """A task per recall task and length (tagged :data:`RECALL_TAG`), a document per depth and seed
    (one depth for ``cwe``, whose list of words has none), the cases the harness builds; every case
    is made before anything is written (``ValueError`` naming the task and length it cannot make)."""
    bench = Bench(Settings(lengths=tuple(lengths), depths=tuple(depths), seeds=tuple(seeds)), None, tokenizer, torch.empty(0), text, [])
    done, written = Exported(), []
    for task in tasks:
        for length in lengths:
            try:
                cases = [
                    _case(bench, task, length, depth, seed)
                    for depth in (depths if parse_task(task)[0] != "cwe" else depths[:1])
                    for seed in seeds
                ]
            except ValueError as error:
                raise ValueError(f"--task {task} at --lengths {length}: {error}") from error
            docs = [
                {"prompt": _prompt(tokenizer, case.context_ids, case.question_ids, done), "expected": list(case.expected),
                 "target": ", ".join(case.expected), "depth": None if case.task == "cwe" else case.depth, "seed": case.seed}
                for case in cases
            ]
            metadata = {"version": 1.0, "recall_task": task, "length": length, "depths": list(depths), "seeds": list(seeds)}
            written.append((task_name(task, length), docs, max(case.answer_tokens for case in cases), metadata))
    for name, docs, answer_tokens, metadata in written:
        _write(out, name, docs, answer_tokens, "recall_results", {"score": True}, metadata, RECALL_TAG)
        done.tasks.append(name)
    return done


def export_qa(out: Path, tokenizer: PreTrainedTokenizerBase, samples: list[dict], max_tokens: int, source: str) -> Exported:
    """The task :data:`QA_TASK`: a document per QA sample (of ``source``), cut as the harness cuts it."""
    done = Exported()
    cases = [make_qa_case(tokenizer, sample, index, max_tokens) for index, sample in enumerate(samples)]
    docs = [
        {"prompt": _prompt(tokenizer, case.context_ids, case.question_ids, done), "expected": list(case.expected),
         "target": case.expected[0], "index": case.index}
        for case in cases
    ]
    metadata = {"version": 1.0, "dataset": source, "samples": len(samples), "max_tokens": max_tokens}
    _write(out, QA_TASK, docs, max(case.answer_tokens for case in cases), "qa_results", {"exact_match": True, "f1": True}, metadata, None)
    done.tasks.append(QA_TASK)
    return done


def recall_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's ``process_results`` for recall: RULER's string match on the answer's first line."""
    return {"score": score_answer(first_line(results[0]), doc["expected"])}


def qa_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's ``process_results`` for QA: exact match and token F1 of the answer's first line."""
    answer, expected = first_line(results[0]), tuple(doc["expected"])
    return {"exact_match": exact_match(answer, expected), "f1": token_f1(answer, expected)}


def _prompt(tokenizer: PreTrainedTokenizerBase, context: torch.Tensor, question: torch.Tensor, done: Exported) -> str:
    """A case's prompt as the text lm-eval is given (without the start tokens the tokenizer sets
    again), counted in ``done`` and among the re-tokenised where its tokens come back otherwise."""
    ids = context[0].tolist() + question[0].tolist()
    text = tokenizer.decode(ids[len(start_ids(tokenizer)) :])
    done.prompts += 1
    done.retokenized += tokenizer(text).input_ids != ids
    return text


def _write(out: Path, name: str, docs: list[dict], answer_tokens: int, scorer: str, metrics: dict[str, bool], metadata: dict, tag: str | None) -> None:
    """``NAME.jsonl`` and ``NAME.yaml`` in ``out`` (the YAML names the JSONL by its absolute path:
    lm-eval resolves data files against its working folder)."""
    data = (out / f"{name}.jsonl").resolve()
    data.write_text("".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs), encoding="utf-8")
    lines = [
        f"task: {name}",
        *([f"tag: [{tag}]"] if tag else []),
        "dataset_path: json",
        f"dataset_kwargs: {{data_files: {{test: {json.dumps(str(data))}}}}}",
        "test_split: test",
        "output_type: generate_until",
        "doc_to_text: prompt",
        "doc_to_target: target",
        f"generation_kwargs: {{until: [], max_gen_toks: {answer_tokens}, do_sample: false}}",
        f"process_results: !function {__name__}.{scorer}",
        "metric_list:",
        *(f"  - {{metric: {metric}, aggregation: mean, higher_is_better: {json.dumps(better)}}}" for metric, better in metrics.items()),
        f"metadata: {json.dumps(metadata)}",
    ]
    (out / f"{name}.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
