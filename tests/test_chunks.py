"""``chunk=`` (ChunkKV) on the scored policies, against the naive references of their statistics.

:class:`ChunkRule` wraps any rule of :func:`test_scored.naive_eviction` (and
:func:`test_head_budgets.naive_pooled`) with the documented chunk ranking, from scratch over each
row's and head's candidates: a chunk is ``chunk`` neighbouring positions counted from the row's
first token; a chunk whose every position is a candidate ranks by the sum of its tokens' finite
scores, one with fewer below every whole one, the chunk of the newest position is kept while it is
not whole, and a token the statistic ranks ``+inf`` (a sink) keeps that rank.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from test_batch_equivalence import PADDED, UNPADDED, build, differences
from test_expected_attention import ExpectedAttentionRule
from test_h2o import SCHEDULES, full_layers, peaked, run_schedule
from test_head_budgets import H2ORule, naive_pooled, owned_positions
from test_keydiff import KeyDiffRule
from test_scored import MODELS, KNormRule, SnapKVRule, naive_eviction
from tiny_models import random_ids, tiny_llama

from hf_kvpolicies import H2OCache, from_spec
from hf_kvpolicies.retention.chunks import chunk_ranking

INF = float("inf")


class ChunkRule:
    """``rule``'s statistic, ranked in chunks of ``chunk`` positions (see the module docstring)."""

    def __init__(self, rule, chunk: int):
        self.rule, self.chunk = rule, chunk

    def __getattr__(self, name):  # budget, protected, sinks, watching: the statistic's
        return getattr(self.rule, name)

    def observe(self, *args):
        self.rule.observe(*args)

    def selection(self, state, stop, b, h, candidates):
        scores = self.rule.selection(state, stop, b, h, candidates)
        chunks: dict[int, list[int]] = {}
        for p in candidates:
            chunks.setdefault(p // self.chunk, []).append(p)
        ranked = {}
        for index, members in chunks.items():
            whole = len(members) == self.chunk
            total = sum(scores[p] for p in members if math.isfinite(scores[p]))
            for p in members:
                if scores[p] == INF or (index == (stop - 1) // self.chunk and not whole):
                    ranked[p] = INF
                else:
                    ranked[p] = total if whole else -INF
        return ranked


CACHES = {  # the cache and its reference rule (given the reference's model)
    "snapkv": (lambda m: from_spec(m, "snapkv:budget=12,window=3,kernel=3,chunk=4"), lambda m: SnapKVRule(12, 3, 3)),
    "knorm": (lambda m: from_spec(m, "knorm:budget=10,recent=3,chunk=3"), lambda m: KNormRule(10, 3)),
    "h2o": (lambda m: from_spec(m, "h2o:heavy=6,recent=4,chunk=4"), lambda m: H2ORule(6, 4)),
    "keydiff": (lambda m: from_spec(m, "keydiff:budget=10,recent=2,chunk=2"), lambda m: KeyDiffRule(10, 2)),
    "expected_attention": (
        lambda m: from_spec(m, "expected_attention:budget=12,sinks=2,n_future_positions=32,chunk=3"),
        lambda m: ExpectedAttentionRule(m, 12, 2, 32),
    ),
    "snapkv-pooled": (
        lambda m: from_spec(m, "snapkv:budget=12,window=3,kernel=3,chunk=4,head_budgets=adaptive"),
        lambda m: SnapKVRule(12, 3, 3),
    ),
}
CHUNKS = {"snapkv": 4, "knorm": 3, "h2o": 4, "keydiff": 2, "expected_attention": 3, "snapkv-pooled": 4}
CASES = [
    ("snapkv", "llama-gqa", "long prompt"),
    ("snapkv", "gemma3-mqa", "chunks, also after evictions"),
    ("knorm", "llama-mqa", "chunks, also after evictions"),
    ("h2o", "gemma3-mqa", "short prompt fills then evicts"),
    ("keydiff", "llama-gqa", "chunks, also after evictions"),
    ("expected_attention", "llama-gqa", "long prompt"),
    ("snapkv-pooled", "llama-gqa", "chunks, also after evictions"),
]


@functools.cache
def reference(policy: str, model_name: str, schedule: str):
    model = peaked(MODELS[model_name](), factor=8.0)
    model.set_attn_implementation("eager")
    chunks = SCHEDULES[schedule]
    rule = ChunkRule(CACHES[policy][1](model), CHUNKS[policy])
    naive = naive_pooled if policy.endswith("pooled") else naive_eviction
    ids = random_ids(1, sum(chunks), seed=5)
    if hasattr(rule.rule, "watching"):
        with rule.watching():
            return naive(model, ids, chunks, rule)
    return naive(model, ids, chunks, rule)


@pytest.mark.parametrize("policy, model_name, schedule", CASES)
def test_matches_naive_reference(policy, model_name, schedule, one_thread):
    """Kept positions per layer and KV head after every forward (64+ decode steps), and logits;
    what stays is whole chunks, but for the open one and one chunk leaving."""
    expected_logits, expected_kept = reference(policy, model_name, schedule)
    model = peaked(MODELS[model_name](), factor=8.0)
    chunks = SCHEDULES[schedule]
    cache = CACHES[policy][0](model)
    pooled = policy.endswith("pooled")
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache, *([owned_positions] if pooled else []))
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        for layer in want:
            got_layer = got[layer] if pooled else got[layer].tolist()
            want_layer = want[layer] if pooled else want[layer].tolist()
            assert got_layer == want_layer, f"forward {step}, layer {layer}"
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)
    size, retention = CHUNKS[policy], cache.layers[full_layers(model)[0]].retention
    heads = kept[-1][full_layers(model)[0]]
    for head in (heads[0] if pooled else heads[0].tolist()):
        partial = {p // size for p in head if sum(q // size == p // size for q in head) < size}
        assert len(partial) <= 2 + math.ceil(retention.protected / size), head  # whole chunks but a few


def test_ranking_of_chunks():
    """Whole chunks by the sum of finite scores, leaving ones below them, the open one (and +inf tokens) kept."""
    positions = torch.tensor([[[0, 1, 2, 3, 4, 5, 7, 8, 9, 10, -1]]])
    scores = torch.tensor([[[1.0, 2.0, INF, 4.0, 0.5, 0.5, 9.0, 1.0, 1.0, 1.0, 3.0]]])
    # chunks of 3: {0,1,2} whole (1 + 2, the sink +inf kept), {3,4,5} whole (5.0), {6,7,8} leaving, {9,10} open
    ranked = chunk_ranking(positions, scores, torch.zeros(1, 1, 1, dtype=torch.long), 11, 3)
    expected = torch.tensor([[[3.0, 3.0, INF, 5.0, 5.0, 5.0, -INF, -INF, INF, INF, -INF]]])
    assert torch.equal(ranked, expected)
    shifted = chunk_ranking(positions + 2, scores, torch.full((1, 1, 1), 2), 13, 3)  # a row padded by 2: the same
    assert torch.equal(shifted[..., :-1], expected[..., :-1])


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv:budget=24,window=6,kernel=3,chunk=4",
        "snapkv:budget=24,window=6,kernel=3,chunk=4,layer_budgets=adaptive,head_budgets=adaptive",
        "h2o:heavy=12,recent=12,chunk=5,layer_budgets=pyramid,storage=fp8:residual=4",
        "tova:budget=24,chunk=3,head_budgets=adaptive",
        "knorm:budget=24,recent=6,chunk=4,layer_budgets=adaptive",
        "keydiff:budget=24,recent=6,chunk=4,head_budgets=adaptive",
        "expected_attention:budget=24,sinks=4,chunk=4,layer_budgets=adaptive",
        "kvzip:budget=24,recent=6,sinks=4,chunk=4",
    ],
)
@pytest.mark.parametrize("lengths", [PADDED, UNPADDED], ids=["padded", "unpadded"])
def test_each_row_of_a_batch_gets_what_it_gets_alone(spec, lengths, one_thread):
    """A row's chunks count from its first real token, under every layer and head budget rule."""
    got = differences(spec, lengths, torch.float32)
    assert max(got) < 1e-5, got


SPECS = {  # each scored policy at a budget of 8 tokens
    "h2o": "h2o:heavy=4,recent=4",
    "snapkv": "snapkv:budget=8,window=2",
    "tova": "tova:budget=8",
    "knorm": "knorm:budget=8,recent=2",
    "keydiff": "keydiff:budget=8,recent=2",
    "expected_attention": "expected_attention:budget=8",
    "kvzip": "kvzip:budget=8,recent=2,sinks=2",
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_chunk_below_one_or_above_the_budget_is_refused_at_construction(name):
    model = tiny_llama()
    with pytest.raises(ValueError, match="chunk must be an integer >= 1"):
        build(model, SPECS[name] + ",chunk=0")
    with pytest.raises(ValueError, match=r"chunk=9 is larger than budget=8.*give chunk <= budget"):
        build(model, SPECS[name] + ",chunk=9")
    assert build(model, SPECS[name] + ",chunk=8").chunk == 8


def test_a_budget_as_a_fraction_checks_the_chunk_at_the_first_forward(one_thread):
    model = tiny_llama()
    with torch.no_grad():
        model(random_ids(1, 40), cache=H2OCache(model, heavy=0.25, recent=0.25, chunk=8))  # 20 tokens: fits
        with pytest.raises(ValueError, match=r"chunk=8 is larger than the budget of 6 tokens .*give chunk <= the budget"):
            model(random_ids(1, 12), cache=H2OCache(model, heavy=0.25, recent=0.25, chunk=8))


def test_specs_sweep_the_budget_and_keep_the_chunk():
    from eval.benchmarks.eviction import contender

    model = tiny_llama()
    assert from_spec(model, "snapkv:budget=256,chunk=16").chunk == 16
    named = contender("snapkv:chunk=16", 64)  # a shaping keyword: swept at the benchmark's budget
    built = named.make(model)
    assert "chunk=16" in named.label and (built.budget, built.chunk) == (64, 16)
    assert from_spec(model, "snapkv:budget=64").chunk == 1  # off by default


def test_beams_reorder_the_rows_chunks(one_thread):
    """Beam search reorders each row's first real position with its chunks; a budget covering the
    sequence keeps every token, so beams equal the full cache's."""
    from helpers import greedy

    from hf_kvpolicies import FullCache

    model = peaked(tiny_llama(), factor=8.0)
    ids = random_ids(1, 10, seed=3)
    wide = from_spec(model, "snapkv:budget=60,window=4,kernel=3,chunk=8")
    assert torch.equal(greedy(model, ids, wide, 16, num_beams=2), greedy(model, ids, FullCache(model), 16, num_beams=2))
    cache = from_spec(model, "keydiff:budget=8,recent=2,chunk=3")
    assert greedy(model, ids, cache, 16, num_beams=3).shape == (1, 26)
    retention = cache.layers[1].retention
    assert retention.kept_positions().shape == (3, 2, 8) and retention.row_start.shape == (3, 1, 1)
