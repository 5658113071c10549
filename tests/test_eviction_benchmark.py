"""The eviction benchmark: contenders built from specs at the budget, the prefill timing
(contenders in turn, medians, paired ratios to full), the needle table's helpers."""

from __future__ import annotations

import torch
from tiny_models import random_ids, tiny_llama

from eval.benchmarks.eviction import beside_full, contender, miss_line, prefill_seconds, targets
from eval.benchmarks.runner import Contender
from hf_kvpolicies import FullCache, KNormCache, SlidingWindowCache, SnapKVCache


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


def test_contenders_are_specs_built_at_the_budget_as_the_sweep_builds_them():
    model = tiny_llama()
    assert contender("full", 64).label == "full" and isinstance(contender("full", 64).make(model), FullCache)
    assert contender("window", 64).label == "window:window=64"
    avg = contender("snapkv:pooling=avg", 64)
    keywords = {**SnapKVCache.budget_parameters(64), "pooling": "avg"}
    assert avg.label == "snapkv:" + ",".join(f"{k}={v}" for k, v in keywords.items())
    built = avg.make(model)
    assert (type(built), built.budget, built.pooling) == (SnapKVCache, 64, "avg")
    assert contender("snapkv:budget=32", 64).label == "snapkv:budget=32"  # a spec that sets its budget keeps it


def test_beside_full_counts_the_full_caches_needles_found_and_the_others():
    assert beside_full({0, 1, 3}, {0, 1, 2}) == "2/3 +1"
    assert beside_full({0, 1, 2}, {0, 1, 2}) == "3/3"
    assert beside_full(set(), set()) == "0/0"


def test_miss_line_names_each_missed_prompt_with_its_answer():
    missed = [(2048, 4, "1234567", " 1234560\n"), (1024, 0, "7654321", "mellow-muffin")]
    assert miss_line("kvzip", missed) == "kvzip missed 2: 2048/4 '1234567' -> '1234560', 1024/0 '7654321' -> 'mellow-muffin'"
    assert miss_line("full", []) == "full missed 0"
