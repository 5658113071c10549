"""Long-document QA: SQuAD-style scorers on hand-made answers, the JSONL path and its errors."""

from __future__ import annotations

import json

import pytest
from tiny_models import char_tokenizer

from eval.data import DataError
from eval.qa import exact_match, is_qa_dataset, load_samples, make_qa_case, normalize, questions_of, token_f1


@pytest.mark.parametrize(
    "answer, references, em, f1",
    [
        ("The Eiffel Tower.", ("eiffel tower",), 1.0, 1.0),
        ("Paris", ("London", "paris"), 1.0, 1.0),
        ("in Paris, France", ("Paris",), 0.0, 2 * (1 / 3) * 1 / (1 / 3 + 1)),
        ("red green", ("green blue",), 0.0, 0.5),
        ("", ("anything",), 0.0, 0.0),
    ],
)
def test_exact_match_and_token_f1(answer, references, em, f1):
    assert exact_match(answer, references) == em
    assert token_f1(answer, references) == pytest.approx(f1)


def test_normalisation_drops_case_punctuation_and_articles():
    assert normalize("  The  Cat, a DOG!  ") == "cat dog"


def test_jsonl_rows_become_cases_whose_long_context_loses_its_middle(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"context": "A" * 50 + "B" * 500 + "C" * 50, "input": "Which?", "answers": "A"}, {"context": "short", "input": "Q?", "answers": ["x", "y"]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    assert is_qa_dataset(str(path)) and is_qa_dataset("longbench:qasper") and not is_qa_dataset("pydoc")
    samples = load_samples(str(path))
    assert [s["answers"] for s in samples] == [("A",), ("x", "y")] and len(load_samples(str(path), limit=1)) == 1
    tokenizer = char_tokenizer()
    case = make_qa_case(tokenizer, samples[0], 0, max_tokens=200)
    assert case.context_ids.shape[1] + case.question_ids.shape[1] == 200
    text = tokenizer.decode(case.context_ids[0])
    assert text.startswith("Read the text below") and text.endswith("C" * 50) and "B" * 200 not in text
    assert tokenizer.decode(case.question_ids[0]) == "\n\nQuestion: Which?\nAnswer:"
    with_bos = char_tokenizer(bos=True)  # the BOS opens the prompt and counts in its length
    opened = make_qa_case(with_bos, samples[0], 0, max_tokens=200)
    assert opened.context_ids.shape[1] + opened.question_ids.shape[1] == 200 and opened.context_ids[0, 0] == with_bos.bos_token_id
    assert with_bos.decode(opened.context_ids[0, 1:]).startswith("Read the text below") and opened.context_ids[0, -50:].equal(case.context_ids[0, -50:])


def test_a_jsonl_without_the_fields_or_a_missing_file_says_what_is_needed(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "no"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match="lacks the field"):
        load_samples(str(path))
    with pytest.raises(DataError, match="does not exist"):
        load_samples(str(tmp_path / "none.jsonl"))


def test_rows_with_several_questions_ask_them_of_one_context_cut_for_the_longest(tmp_path):
    path = tmp_path / "multi.jsonl"
    rows = [
        {"context": "A" * 50 + "B" * 500 + "C" * 50, "questions": [{"input": "First?", "answers": "A"}, {"input": "A much longer second?", "answers": ["C", "c"]}]},
        {"context": "short", "input": "Only?", "answers": ["x"]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    samples = load_samples(str(path))
    assert [len(questions_of(s)) for s in samples] == [2, 1] and questions_of(samples[0])[1]["answers"] == ("C", "c")
    tokenizer = char_tokenizer()
    case = make_qa_case(tokenizer, samples[0], 0, max_tokens=200)
    assert [turn.expected for turn in case.turns] == [("A",), ("C", "c")]
    assert [tokenizer.decode(turn.question_ids[0]) for turn in case.turns] == ["\n\nQuestion: First?\nAnswer:", "\n\nQuestion: A much longer second?\nAnswer:"]
    assert case.context_ids.shape[1] + case.turns[1].question_ids.shape[1] == 200  # the longest question fits beside the context
    assert len(make_qa_case(tokenizer, samples[1], 1, max_tokens=200).turns) == 1


def test_a_row_with_empty_or_malformed_questions_says_what_is_needed(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"context": "c", "questions": []}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match="row 0: questions must be a non-empty list of {input, answers}"):
        load_samples(str(path))
