"""Long-document QA: LongBench subsets from the Hub, or any JSONL of ``{context, input, answers}``
(or ``{context, questions: [{input, answers}, ...]}``: several questions of one document),
through ``datasets.load_dataset`` (a local JSONL through the packaged ``json`` builder, offline).

Each sample becomes a context (the document, its middle cut out when it and its longest question
are longer than ``max_tokens``, as LongBench truncates) and its questions, each with an answer
prefix, run under the same protocols as the recall suite (the shared-context ones ask a sample's
questions of one context), and scored by exact match and token F1 against the best of each
question's reference answers (SQuAD's normalisation: lower case, no punctuation, no articles).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from .data import DataError, _first_line, _load
from .dialogue import Framing, Question, Turn, plain

LONGBENCH = "THUDM/LongBench"
PREFIX = "longbench:"
CONTEXT_TEMPLATE = "Read the text below and answer the question after it.\n\n{context}"
QUESTION_TEMPLATE = ("\n\nQuestion: {input}", "\nAnswer:")
"""What is asked, then the answer prefix (plain text joins them as printed)."""


def is_qa_dataset(name: str) -> bool:
    return name.startswith(PREFIX) or name.endswith((".jsonl", ".json"))


def describe(name: str) -> str:
    if name.startswith(PREFIX):
        return f"{LONGBENCH}/{name.removeprefix(PREFIX)} (test)"
    return f"file:{Path(name).resolve()}"


def load_samples(name: str, limit: int | None = None) -> list[dict]:
    """``[{"context", "input", "answers"}]`` from ``longbench:SUBSET`` or a JSONL path; a row with
    several questions gives ``{"context", "questions": [{"input", "answers"}, ...]}``."""
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
    columns = set(rows.column_names)
    missing = {"context", "input", "answers"} - columns if "questions" not in columns else {"context"} - columns
    if missing:
        raise DataError(
            f"--dataset {name!r} lacks the field(s) {', '.join(sorted(missing))}: each row needs context, and input and "
            "answers or questions (a list of {input, answers})"
        )
    samples = [_sample(name, index, row) for index, row in enumerate(rows)]
    return samples[:limit] if limit else samples


def _sample(name: str, index: int, row: dict) -> dict:
    if row.get("questions") is None:
        if row.get("input") is None or row.get("answers") is None:
            raise DataError(f"--dataset {name!r}, row {index}: it has neither input and answers nor questions: give it one or the other")
        return {"context": row["context"], "input": row["input"], "answers": _answers(row["answers"])}
    questions = row["questions"]
    if not questions or any(not isinstance(q, dict) or q.get("input") is None or q.get("answers") is None for q in questions):
        raise DataError(f"--dataset {name!r}, row {index}: questions must be a non-empty list of {{input, answers}}")
    return {"context": row["context"], "questions": [{"input": q["input"], "answers": _answers(q["answers"])} for q in questions]}


def questions_of(sample: dict) -> list[dict]:
    """A sample's questions, ``[{"input", "answers"}]``, in the order they are asked."""
    return sample.get("questions") or [{"input": sample["input"], "answers": sample["answers"]}]


def _answers(value) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class QACase:
    index: int
    context_ids: torch.Tensor
    question_ids: torch.Tensor
    """``[1, m]``: the (first) question and the answer prefix."""
    expected: tuple[str, ...]
    answer_tokens: int
    later: tuple[Turn, ...] = ()
    """The sample's questions after the first, in the order they are asked."""

    @property
    def turns(self) -> tuple[Turn, ...]:
        return (Turn(self.question_ids, self.expected), *self.later)


def make_qa_case(tokenizer: PreTrainedTokenizerBase, sample: dict, index: int, max_tokens: int, framing: Framing | None = None) -> QACase:
    """One sample whose context and longest question take at most ``max_tokens`` tokens (the
    document's middle cut if needed), framed by ``framing`` (plain text if not given)."""
    framing = framing or plain(tokenizer)
    asked = questions_of(sample)
    questions = [framing.question_ids(Question(QUESTION_TEMPLATE[0].format(input=q["input"]), QUESTION_TEMPLATE[1])) for q in asked]
    longest_question = max(map(len, questions))
    opening, context, after = list(framing.opening), framing.encode(CONTEXT_TEMPLATE.format(context=sample["context"])), list(framing.after_context)
    room = max_tokens - longest_question - len(opening) - len(after)
    if room < 16:
        raise DataError(f"QA sample {index}: its question alone takes {longest_question} tokens: raise --qa-max-tokens")
    if len(context) > room:
        context = context[: room // 2] + context[len(context) - (room - room // 2) :]
    context = opening + context + after
    longest = max(len(framing.encode(" " + answer)) for q in asked for answer in q["answers"])
    later = tuple(Turn(torch.tensor([ids]), q["answers"]) for ids, q in zip(questions[1:], asked[1:]))
    return QACase(index, torch.tensor([context]), torch.tensor([questions[0]]), asked[0]["answers"], longest + 4, later)


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
