"""The eviction benchmark's prefill timing: contenders in turn, medians, paired ratios to full."""

from __future__ import annotations

import torch
from tiny_models import random_ids, tiny_llama

from eval.benchmarks.eviction import beside_full, greedy_answer, miss_line, prefill_seconds, targets
from eval.benchmarks.runner import Contender
from hf_kvpolicies import FullCache, KNormCache, SlidingWindowCache


def test_prefill_seconds_gives_each_contender_its_median_and_ratio_to_full(one_thread):
    model = tiny_llama()
    made = []

    def counting(factory):
        return lambda m: made.append(factory.__name__) or factory(m)

    def full(m):
        return FullCache(m)

    def knorm(m):
        return KNormCache(m, budget=16, recent=4)

    def window(m):
        return SlidingWindowCache(m, window=16)

    contenders = [Contender(name, counting(f)) for name, f in [("window", window), ("full", full), ("knorm", knorm)]]
    prefill_seconds(model, random_ids(1, 64), contenders, rounds=3)
    assert made == ["window", "full", "knorm", "full", "knorm", "window", "knorm", "window", "full"]  # turns rotate
    figures = {c.label: c.figures for c in contenders}
    assert figures["full"]["prefill / full @64"] == 1.0
    assert all(f["prefill s @64"] > 0 and f["prefill / full @64"] > 0 for f in figures.values())
    lines = targets({c.label: c for c in contenders}, [], "prefill / full @64")
    ratio = figures["knorm"]["prefill / full @64"]
    assert lines == [f"knorm prefill / full @64: {ratio:.2f}x ({'met' if ratio <= 1.3 else 'MISSED'}, <= 1.3)"]


def test_last_token_kept_decodes_the_prompts_last_token_from_what_was_kept(one_thread):
    """kvpress's protocol: with every token kept it changes nothing; with a window it does (the
    last prompt token no longer sees what the prefill evicted), and it equals doing it by hand."""
    model, ids = tiny_llama(), random_ids(1, 48)
    at_once = greedy_answer(model, ids, FullCache(model), 6)
    assert torch.equal(greedy_answer(model, ids, FullCache(model), 6, last_token_kept=True), at_once)
    cache = SlidingWindowCache(model, window=8)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
        last = model(ids[:, -1:], cache=cache).logits[0, -1]
        assert not torch.allclose(last, model(ids).logits[0, -1], atol=1e-4)  # the window changed what it saw
    kept = greedy_answer(model, ids, SlidingWindowCache(model, window=8), 6, last_token_kept=True)
    assert kept.shape == (6,) and kept[0] == last.argmax()


def test_beside_full_counts_the_full_caches_needles_found_and_the_others():
    assert beside_full({0, 1, 3}, {0, 1, 2}) == "2/3 +1"
    assert beside_full({0, 1, 2}, {0, 1, 2}) == "3/3"
    assert beside_full(set(), set()) == "0/0"


def test_miss_line_names_each_missed_prompt_with_its_answer():
    missed = [(2048, 4, "1234567", " 1234560\n"), (1024, 0, "7654321", "mellow-muffin")]
    assert miss_line("kvzip", missed) == "kvzip missed 2: 2048/4 '1234567' -> '1234560', 1024/0 '7654321' -> 'mellow-muffin'"
    assert miss_line("full", []) == "full missed 0"
