"""Text sources: a local file through the datasets ``text`` builder, Hub datasets, clear errors."""

from __future__ import annotations

import pytest
from tiny_models import char_tokenizer

import eval.data as data
from eval.data import DataError, embedded_text, load_text, start_ids, text_label, tokenize


def test_a_text_file_loads_through_datasets_whole(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("First line.\n\nSecond paragraph, with a comma.\nThird line.\n", encoding="utf-8")
    text, label = load_text(text_file=path)
    assert text == path.read_text(encoding="utf-8")
    assert label == f"file:{path.resolve()}" == text_label(text_file=path)


def test_missing_or_empty_text_files_name_the_fix(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_text(text_file=tmp_path / "nothing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_text(text_file=tmp_path / "empty.txt")


def test_an_unreachable_hub_dataset_points_to_text_file(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(data, "_load", offline)
    with pytest.raises(DataError, match="--text-file PATH") as error:
        load_text("wikitext2")
    assert "Salesforce/wikitext" in str(error.value) and "ConnectionError" in str(error.value)


def test_hub_datasets_are_joined_documents(monkeypatch):
    calls = []

    def fake(path, config=None, **kwargs):
        calls.append((path, config, kwargs))
        return {"text": ["a book", "another book"]}

    monkeypatch.setattr(data, "_load", fake)
    text, label = load_text("pg19")
    assert text == "a book\n\nanother book" and label.startswith("pg19") and label == text_label("pg19")
    assert calls == [("emozilla/pg19-test", None, {"split": "test"})]
    load_text("wikitext2")
    assert calls[-1] == ("Salesforce/wikitext", "wikitext-2-raw-v1", {"split": "test"})


def test_unknown_dataset_names_the_choices():
    with pytest.raises(DataError, match="pydoc, wikitext2, pg19"):
        load_text("nosuch")


def test_tokenizing_a_prefix_gives_the_tokens_of_the_whole_text(embedded):
    _, tokenizer = embedded  # a BPE tokenizer: merges could cross a careless cut
    text = embedded_text()[:40000]
    whole = tokenize(tokenizer, text)
    assert tokenize(tokenizer, text, 500).equal(whole[:, :500])
    assert tokenize(tokenizer, text, 3000).equal(whole[:, :3000])
    with pytest.raises(DataError, match="fewer than"):
        tokenize(char_tokenizer(), "short text", 100)


def test_model_inputs_open_with_the_tokenizers_start_ids():
    """Gemma 3 270M reads the embedded text at perplexity 87.9 without its BOS, 18.0 with it."""
    plain, with_bos = char_tokenizer(), char_tokenizer(bos=True)
    assert start_ids(plain) == [] and start_ids(with_bos) == [with_bos.bos_token_id] == [1]
    text = embedded_text()[:3000]
    stream = tokenize(with_bos, text, 20)
    assert stream.shape == (1, 20) and stream[0, 0] == 1 and stream[0, 1:].equal(tokenize(plain, text, 19)[0])
    assert tokenize(with_bos, text, 20, start=False).equal(tokenize(plain, text, 20))
    assert tokenize(with_bos, text[:50])[0].tolist() == with_bos(text[:50]).input_ids


def test_the_embedded_tokenizer_adds_no_start_ids(embedded):
    """So SmolLM2's streams and prompts, and every figure measured on them, are as they were."""
    assert start_ids(embedded[1]) == []
