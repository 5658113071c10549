"""Long-document QA: LongBench subsets from the Hub, or any JSONL of ``{context, input, answers}``,
through ``datasets.load_dataset`` (a local JSONL through the packaged ``json`` builder, offline).

Each sample becomes a context (the document, its middle cut out when it is longer than
``max_tokens``, as LongBench truncates) and a question with an answer prefix, run under the
same protocols as the recall suite, and scored by exact match and token F1 against the best of
its reference answers (SQuAD's normalisation: lower case, no punctuation, no articles).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from hf_kvpolicies.special_tokens import start_ids

from .data import DataError, _first_line, _load

LONGBENCH = "THUDM/LongBench"
PREFIX = "longbench:"
CONTEXT_TEMPLATE = "Read the text below and answer the question after it.\n\n{context}"
QUESTION_TEMPLATE = "\n\nQuestion: {input}\nAnswer:"


def is_qa_dataset(name: str) -> bool:
    return name.startswith(PREFIX) or name.endswith((".jsonl", ".json"))


def describe(name: str) -> str:
    if name.startswith(PREFIX):
        return f"{LONGBENCH}/{name.removeprefix(PREFIX)} (test)"
    return f"file:{Path(name).resolve()}"


def load_samples(name: str, limit: int | None = None) -> list[dict]:
    """``[{"context", "input", "answers"}]`` from ``longbench:SUBSET`` or a JSONL path."""
    try:
        if name.startswith(PREFIX):
            rows = _load(LONGBENCH, name.removeprefix(PREFIX), split="test")
        else:
            if not Path(name).is_file():
                raise DataError(f"--dataset {name!r} does not exist: pass a JSONL file of {{context, input, answers}} rows")
            rows = _load("json", data_files=str(Path(name).resolve()), split="train")
    except DataError:
        raise
    except Exception as error:
        raise DataError(
            f"cannot load QA dataset {name!r} ({type(error).__name__}: {_first_line(error)}); "
            "with no Hub access, pass a local JSONL of {context, input, answers} rows"
        ) from error
    missing = {"context", "input", "answers"} - set(rows.column_names)
    if missing:
        raise DataError(f"--dataset {name!r} lacks the field(s) {', '.join(sorted(missing))}: each row needs context, input and answers")
    samples = [{"context": r["context"], "input": r["input"], "answers": _answers(r["answers"])} for r in rows]
    return samples[:limit] if limit else samples


def _answers(value) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class QACase:
    index: int
    context_ids: torch.Tensor
    question_ids: torch.Tensor
    expected: tuple[str, ...]
    answer_tokens: int


def make_qa_case(tokenizer: PreTrainedTokenizerBase, sample: dict, index: int, max_tokens: int) -> QACase:
    """One sample as a prompt of at most ``max_tokens`` tokens (the document's middle cut if needed)."""
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    question = encode(QUESTION_TEMPLATE.format(input=sample["input"]))
    opening, context = start_ids(tokenizer), encode(CONTEXT_TEMPLATE.format(context=sample["context"]))
    room = max_tokens - len(question) - len(opening)
    if room < 16:
        raise DataError(f"QA sample {index}: its question alone takes {len(question)} tokens: raise --qa-max-tokens")
    if len(context) > room:
        context = context[: room // 2] + context[len(context) - (room - room // 2) :]
    context = opening + context
    longest = max(len(encode(" " + answer)) for answer in sample["answers"])
    return QACase(index, torch.tensor([context]), torch.tensor([question]), sample["answers"], longest + 4)


def normalize(text: str) -> str:
    text = "".join(char for char in text.lower() if char not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(answer: str, references: tuple[str, ...]) -> float:
    return float(any(normalize(answer) == normalize(reference) for reference in references))


def token_f1(answer: str, references: tuple[str, ...]) -> float:
    """The best F1 over the references of the answer's and the reference's normalised tokens."""
    best = 0.0
    predicted = normalize(answer).split()
    for reference in references:
        truth = normalize(reference).split()
        common = sum((Counter(predicted) & Counter(truth)).values())
        if common:
            precision, recall = common / len(predicted), common / len(truth)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
