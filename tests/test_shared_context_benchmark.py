"""The shared-context benchmark: exact matches per turn from the protocols, the copy's cost beside
a prefill's, and the KVzip target's lines."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tiny_models import char_tokenizer, random_ids, tiny_llama

from eval.asking import ask
from eval.benchmarks.shared_context import copy_cost, per_turn, target_lines
from eval.data import embedded_text, tokenize
from eval.dialogue import Turn, plain
from eval.protocols import PROTOCOLS
from eval.recall import make_case
from hf_kvpolicies import from_spec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_exact_matches_are_counted_per_turn_with_the_bytes_held():
    model, tokenizer = tiny_llama(max_position_embeddings=2048), char_tokenizer()
    haystack = tokenize(tokenizer, embedded_text()[:8000], start=False)
    cases = [make_case(tokenizer, haystack, "niah_multiturn", 800, 0.5, seed, turns=2) for seed in range(2)]
    found = ask(model, tokenizer, cases, PROTOCOLS["multiturn"], lambda: from_spec(model, "window:window=64"), plain(tokenizer))
    second = next(asked.text.strip() for asked in found if (asked.case, asked.turn) == (0, 1))
    assert second  # the tiny random model finds no needle: expecting what it answers makes one exact match
    cases[0] = replace(cases[0], later=(Turn(cases[0].later[0].question_ids, (second,)),))
    exact, held, seconds = per_turn(model, tokenizer, "window", 64, cases, "multiturn", plain(tokenizer))
    assert exact == [0, 1] and held == 2 * 2 * 2 * 64 * 16 * 4 and seconds > 0  # layers x keys and values x KV heads x tokens x head dim x fp32


def test_the_target_holds_kvzip_to_the_full_cache_at_each_later_turn():
    results = {("full", "multiturn"): [10, 10, 0], ("kvzip", "multiturn"): [9, 8, 1], ("full", "multiquery"): [5, 5, 5]}
    assert target_lines(results, ["multiturn", "multiquery"]) == [
        "kvzip multiturn turn 2: 8 / full's 10 (MISSED, >= 0.9)",
        "kvzip multiturn turn 3: 1 / full's 0 (no ratio: the full cache found none)",
    ]


def test_a_copy_costs_less_than_prefilling_the_context_again():
    model = tiny_llama()
    prefill, copied = copy_cost(model, "window", 16, random_ids(1, 200))
    assert 0 < copied < prefill
