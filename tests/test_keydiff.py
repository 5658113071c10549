"""KeyDiffCache against a naive KeyDiff written from its definition.

The reference (a rule for :func:`test_scored.naive_eviction` and
:func:`test_head_budgets.naive_pooled`) ranks a row's and head's candidates, whenever one must
go, by the cosine distance (``1 - cos``) of each key to the mean of the candidates' L2-normalised
keys (float64, then to 12 significant bits), the ``recent`` newest protected.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import generated_logits, greedy, left_padded, prefill_then_decode, real_positions
from test_h2o import SCHEDULES, full_layers, peaked, run_schedule
from test_head_budgets import naive_pooled, owned_positions
from test_scored import MODELS, naive_eviction, significant
from tiny_models import random_ids, tiny_gemma3, tiny_llama

from hf_kvpolicies import FullCache, KeyDiffCache, from_spec

BUDGET, RECENT = 10, 3


class KeyDiffRule:
    """Score: one minus the cosine of a key to the mean of the candidates' unit keys, to 12 bits."""

    def __init__(self, budget: int, recent: int):
        self.budget, self.protected = budget, recent

    def observe(self, state, attention, keys, values, start, stop):
        state["keys"] = keys.double()

    def selection(self, state, stop, b, h, candidates):
        keys = state["keys"][b, h, candidates]
        unit = keys / keys.norm(dim=-1, keepdim=True)
        anchor = unit.mean(dim=0)
        cosine = unit @ anchor / anchor.norm()
        return {p: significant(1 - float(c), 12) for p, c in zip(candidates, cosine)}


CASES = [
    ("llama-gqa", "long prompt"),
    ("llama-gqa", "chunks, also after evictions"),
    ("gemma3-mqa", "short prompt fills then evicts"),
    ("llama-mqa", "chunks, also after evictions"),
]


@functools.cache
def reference(model_name: str, schedule: str, pooled: bool = False):
    model = peaked(MODELS[model_name](), factor=8.0)
    model.set_attn_implementation("eager")
    chunks = SCHEDULES[schedule]
    naive = naive_pooled if pooled else naive_eviction
    return naive(model, random_ids(1, sum(chunks), seed=5), chunks, KeyDiffRule(BUDGET, RECENT))


@pytest.mark.parametrize("model_name, schedule", CASES)
def test_matches_naive_reference(model_name, schedule, one_thread):
    """Kept positions per layer and KV head after every forward (64+ decode steps), and logits."""
    expected_logits, expected_kept = reference(model_name, schedule)
    model = peaked(MODELS[model_name](), factor=8.0)
    chunks = SCHEDULES[schedule]
    cache = KeyDiffCache(model, budget=BUDGET, recent=RECENT)
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache)
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        for layer in want:
            assert torch.equal(got[layer], want[layer]), f"forward {step}, layer {layer}"
    final = kept[-1][full_layers(model)[0]]
    assert final.shape[-1] == BUDGET
    assert not torch.equal(final, torch.arange(sum(chunks) - BUDGET, sum(chunks)).expand_as(final))  # not a window
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


def test_pooled_heads_match_the_naive_masked_reference(one_thread):
    """``head_budgets="adaptive"``: each head's anchor is over its own kept keys; the heads' tokens
    compete for ``heads x budget``."""
    expected_logits, expected_kept = reference("llama-gqa", "chunks, also after evictions", pooled=True)
    model = peaked(tiny_llama(), factor=8.0)
    chunks = SCHEDULES["chunks, also after evictions"]
    cache = KeyDiffCache(model, budget=BUDGET, recent=RECENT, head_budgets="adaptive")
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache, owned_positions)
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        assert got == want, f"forward {step}"
    assert any(len(head) != BUDGET for step in kept for layer in step.values() for head in layer[0])
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3])
def test_budget_covering_everything_is_full_cache(make_model, implementation, one_thread):
    model = make_model()
    model.set_attn_implementation(implementation)
    ids = random_ids(1, 48)
    expected = prefill_then_decode(model, ids, FullCache(model), prefill=16)
    got = prefill_then_decode(model, ids, KeyDiffCache(model, budget=80, recent=8), prefill=16)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_left_padded_batch_equals_each_row_alone(heads, implementation, one_thread):
    """Rows of 20, 13 and 6 tokens (budget 8: trimmed, trimmed, filling), 40 generated tokens:
    logits and kept positions (shifted by the row's padding) as if alone; pads never join an anchor."""
    model = peaked(tiny_llama(), factor=8.0)
    model.set_attn_implementation(implementation)
    rows = [random_ids(1, n, seed=s) for n, s in [(20, 1), (13, 2), (6, 3)]]
    ids, mask = left_padded(rows)
    together = KeyDiffCache(model, budget=8, recent=3, head_budgets=heads)
    logits = generated_logits(model, ids, together, 40, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = KeyDiffCache(model, budget=8, recent=3, head_budgets=heads)
        torch.testing.assert_close(logits[i : i + 1], generated_logits(model, row, alone, 40), atol=1e-5, rtol=0)
        assert real_positions(together, i, ids.shape[1] - row.shape[1]) == real_positions(alone, 0)


def test_beams_and_fp8_storage(one_thread):
    """Beams reorder the rows; under fp8 the scores are the stored keys' (what attention sees: e4m3's
    3 mantissa bits move a 16-wide key's direction by a few percent), so near-ties go the other way
    more often than for the attention statistics, but most kept positions agree."""
    model = peaked(tiny_llama(), factor=8.0)
    ids = random_ids(1, 10, seed=3)
    wide = KeyDiffCache(model, budget=60, recent=4)
    assert torch.equal(greedy(model, ids, wide, 16, num_beams=2), greedy(model, ids, FullCache(model), 16, num_beams=2))
    cache = KeyDiffCache(model, budget=8, recent=3)
    assert greedy(model, ids, cache, 16, num_beams=2).shape == (1, 26)
    assert cache.layers[1].retention.kept_positions().shape == (2, 2, 8)
    long = random_ids(2, 60, seed=7)
    native, fp8 = KeyDiffCache(model, budget=8, recent=3), KeyDiffCache(model, budget=8, recent=3, storage="fp8:residual=0")
    prefill_then_decode(model, long, native, prefill=30)
    prefill_then_decode(model, long, fp8, prefill=30)
    for a, b in zip(native.layers, fp8.layers):
        mine, theirs = a.retention.kept_positions(), b.retention.kept_positions()
        shared = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(mine.flatten(0, 1), theirs.flatten(0, 1)))
        assert shared >= 0.65 * mine.numel()  # measured 0.72-1.0 (three prompts); a random 8 of 60 shares about 0.13
    assert fp8.get_memory_footprint() < native.get_memory_footprint()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": 0}, "budget must be an integer >= 1"),
        ({"budget": 8, "recent": 9}, "recent <= budget"),
        ({"budget": 8, "recent": -1}, "recent must be an integer >= 0"),
        ({"budget": 8, "recent": 2, "chunk": 0}, "chunk must be an integer >= 1"),
        ({"budget": 8, "recent": 2, "chunk": 9}, "chunk=9 is larger than budget=8.*give chunk <= budget"),
        ({"budget": 8, "recent": 2, "head_budgets": "pooled"}, "head_budgets='uniform' or 'adaptive'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KeyDiffCache(tiny_llama(), **kwargs)


def test_spec_and_budget_parameters():
    model = tiny_llama()
    cache = from_spec(model, "keydiff:budget=64,recent=8,chunk=4,head_budgets=adaptive")
    assert (cache.budget, cache.recent, cache.chunk, cache.head_budgets) == (64, 8, 4, "adaptive")
    assert KeyDiffCache.budget_parameters(256) == {"budget": 256, "recent": 32}
    assert KeyDiffCache.budget_parameters(8) == {"budget": 8, "recent": 2}
    assert all(KeyDiffCache(model, **KeyDiffCache.budget_parameters(b)) for b in range(1, 20))
