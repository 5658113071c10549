"""Passkey retrieval: deterministic prompts, an exact scorer, and a task that shows forgetting."""

from __future__ import annotations

import pytest
from tiny_models import char_tokenizer

from eval.passkey import NEEDLE, QUESTION, is_correct, make_prompt, passkey_grid
from hf_kvpolicies import from_spec

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def test_prompts_are_deterministic_per_seed(tokenizer):
    a, b = make_prompt(tokenizer, 400, 0.5, seed=1), make_prompt(tokenizer, 400, 0.5, seed=1)
    assert a.passkey == b.passkey and a.ids.equal(b.ids)
    others = {make_prompt(tokenizer, 400, 0.5, seed=s).passkey for s in range(2, 8)}
    assert len(others | {a.passkey}) > 1  # the seed, not a constant, picks the passkey
    assert a.passkey.isdigit() and len(a.passkey) == 5


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_has_the_length_and_the_needle_at_its_depth(tokenizer, depth):
    prompt = make_prompt(tokenizer, 400, depth, seed=0)
    assert prompt.ids.shape == (1, 400)
    text = tokenizer.decode(prompt.ids[0])
    needle = NEEDLE.format(key=prompt.passkey)
    assert text.count(needle) == 1 and text.endswith(QUESTION)
    assert tokenizer.decode(prompt.ids[0, prompt.needle_at : prompt.needle_at + len(needle)]) == needle
    start, end = text.index("\n") + 1, len(text) - len(QUESTION) - len(needle)  # the filler's span
    assert text.index(needle) == start + round((end - start) * depth)


def test_too_short_a_prompt_says_how_long_it_must_be(tokenizer):
    with pytest.raises(ValueError, match="at least"):
        make_prompt(tokenizer, 50, 0.5, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        make_prompt(tokenizer, 400, 1.5, seed=0)


@pytest.mark.parametrize(
    "answer, correct",
    [
        (" 48213.", True),
        ("48213", True),
        (" 48213 is the pass key", True),
        (" The pass key is 48213", True),
        (" 4821", False),
        (" 482130", False),
        (" 48 213", False),
        (" 12345. 48213", False),
        (" forty-eight thousand", False),
        ("", False),
    ],
)
def test_scorer_is_exact_match_of_the_first_number(answer, correct):
    assert is_correct(answer, "48213") is correct


def test_a_window_forgets_a_deep_passkey_that_the_full_cache_finds(embedded):
    model, tokenizer = embedded
    for spec, expected in (("full", True), ("window:window=64", False)):
        result = passkey_grid(
            model, tokenizer, lambda: from_spec(model, spec), lengths=[384], depths=[0.1], seed=0, chunk=256
        )
        assert result["cells"][0]["correct"] is expected, (spec, result["cells"])
        assert result["accuracy"] == float(expected)
