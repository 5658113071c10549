"""lm-eval's ``hf`` model against ``hf-kvpolicies`` with ``policy=full`` on the embedded model: a local
multiple-choice task and an exported recall task, time and scores (``python -m eval.benchmarks.lm_eval``).

It writes the tasks into ``--out``/tasks (a cloze task over the embedded text: each document a
paragraph whose last word is to be chosen among four; and ``niah_single`` at ``--length`` tokens,
exported as ``hf-kvpolicies export-lm-eval`` does), then runs each task through both models with
``lm_eval.simple_evaluate`` (lm-eval's built-in tasks not indexed, no bootstrap), the models
taking turns, best of ``--repeats``. The frontier runs over the same tasks are commands of
``hf-kvpolicies lm-eval`` (docs/lm-eval.md). Target: ``hf-kvpolicies`` within 1.1x of ``hf``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from hf_kvpolicies.models import DEFAULT_MODEL, load_model, pretrained_path

from ..data import embedded_text
from ..lm_eval.export import export_recall, task_name
from ..lm_eval.model import PolicyLM

CLOZE = "kvp_cloze_mc"


def write_cloze(folder: Path, documents: int, seed: int = 0) -> str:
    """``CLOZE``: paragraphs of the embedded text whose last word is chosen among four (three
    other words of the text, drawn with ``seed``), scored by lm-eval's ``acc`` and ``acc_norm``."""
    rng = random.Random(seed)
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", embedded_text()) if 8 <= len(s.split()) <= 40 and s.strip()[-1] == "."]
    words = sorted({w for s in sentences for w in re.findall(r"\b[a-z]{4,12}\b", s)})
    docs = []
    for start in rng.sample(range(3, len(sentences)), len(sentences) - 3):
        *head, last = sentences[start].rstrip(".").split()
        if len(docs) == documents or not re.fullmatch(r"[A-Za-z]+", last):
            continue
        choices = [last, *rng.sample([w for w in words if w != last], 3)]
        rng.shuffle(choices)
        context = " ".join([*sentences[start - 3 : start], *head])
        docs.append({"context": context, "choices": choices, "answer": choices.index(last)})
    (folder / f"{CLOZE}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
    config = {
        "task": CLOZE, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str((folder / f"{CLOZE}.jsonl").resolve())}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "choices",
        "doc_to_target": "answer", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }
    (folder / f"{CLOZE}.yaml").write_text(json.dumps(config), encoding="utf-8")
    return CLOZE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/lm-eval-bench"))
    parser.add_argument("--documents", type=int, default=100, help="cloze documents")
    parser.add_argument("--length", type=int, default=512, help="recall prompt length")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, help="CPU threads for torch (a busy shared machine: 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = args.out / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    _, tokenizer = load_model()
    names = [write_cloze(tasks, args.documents)]
    export_recall(tasks, tokenizer, embedded_text(), ["niah_single"], [args.length], [0.1, 0.5, 0.9], [0, 1, 2])
    names.append(task_name("niah_single", args.length))
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    models = {
        "hf": HFLM(pretrained=pretrained_path(DEFAULT_MODEL), device="cpu", batch_size=args.batch_size),
        "hf-kvpolicies policy=full": PolicyLM(pretrained=DEFAULT_MODEL, device="cpu", batch_size=args.batch_size, policy="full"),
    }
    print(f"| task | model | seconds (best of {args.repeats}) | vs hf | scores |")
    print("|---|---|---|---|---|")
    for name in names:
        seconds: dict[str, list[float]] = {label: [] for label in models}
        scores: dict[str, dict] = {}
        for _ in range(args.repeats + 1):  # the first round warms up (datasets' cache, kernels)
            for label, lm in models.items():
                start = time.perf_counter()
                results = simple_evaluate(model=lm, tasks=[name], task_manager=manager, bootstrap_iters=0)
                seconds[label].append(time.perf_counter() - start)
                scores[label] = {k: round(v, 4) for k, v in results["results"][name].items() if "," in k and "stderr" not in k and isinstance(v, float)}
        for label in models:
            best = min(seconds[label][1:])
            print(f"| {name} | {label} | {best:.2f} | {best / min(seconds['hf'][1:]):.2f}x | {scores[label]} |")
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, batch size {args.batch_size}")


if __name__ == "__main__":
    main()
