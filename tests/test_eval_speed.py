"""Speed figures: shapes and internal consistency (timings themselves are benchmarks, not tests)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_ids, tiny_llama
from transformers import DynamicCache

from eval.speed import decode_latency, decode_step_times, prefill, speed_profile, synchronize, timer
from hf_kvpolicies import FullCache, SlidingWindowCache

pytestmark = pytest.mark.usefixtures("one_thread")


def test_decode_latency_reports_prefill_median_p90_and_rate():
    model = tiny_llama()
    timing = decode_latency(model, lambda: FullCache(model), random_ids(1, 80), context=64, steps=6)
    assert timing["context"] == 64 and timing["steps"] == 6
    assert 0 < timing["median_ms"] <= timing["p90_ms"]
    assert timing["tokens_per_s"] == 1000 / timing["median_ms"]
    assert timing["prefill_ms"] > 0


def test_side_by_side_steps_advance_every_cache_and_decode_greedily():
    model = tiny_llama()
    ids = random_ids(1, 33)
    caches = [DynamicCache(config=model.config), SlidingWindowCache(model, window=8)]
    for cache in caches:
        prefill(model, ids[:, :32], cache)
    times = decode_step_times(model, caches, ids[:, 32:], steps=4, warmup=1)
    assert [len(series) for series in times] == [4, 4] and all(t > 0 for series in times for t in series)
    assert [cache.get_seq_length() for cache in caches] == [37, 37]
    # each cache followed its own greedy continuation: the next logits equal those of decoding it alone
    probe = ids[:, :1]
    for cache, alone in zip(caches, [DynamicCache(config=model.config), SlidingWindowCache(model, window=8)]):
        prefill(model, ids[:, :32], alone)
        token = ids[:, 32:]
        with torch.no_grad():
            for _ in range(5):
                token = model(token, cache=alone, use_cache=True).logits[:, -1:].argmax(-1)
            expected = model(probe, cache=alone, use_cache=True).logits
            got = model(probe, cache=cache, use_cache=True).logits
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_side_by_side_steps_take_one_start_token_per_cache_at_different_contexts():
    model = tiny_llama()
    ids = random_ids(1, 40)
    caches = [SlidingWindowCache(model, window=8), SlidingWindowCache(model, window=8)]
    for cache, context in zip(caches, (16, 32)):
        prefill(model, ids[:, :context], cache)
    decode_step_times(model, caches, [ids[:, 16:17], ids[:, 32:33]], steps=2, warmup=0)
    assert [cache.get_seq_length() for cache in caches] == [18, 34]
    # the second cache continued from its own token: decoding it alone from token 32 gives the same logits
    alone = SlidingWindowCache(model, window=8)
    prefill(model, ids[:, :32], alone)
    token = ids[:, 32:33]
    with torch.no_grad():
        for _ in range(2):
            token = model(token, cache=alone, use_cache=True).logits[:, -1:].argmax(-1)
        expected = model(ids[:, :1], cache=alone, use_cache=True).logits
        got = model(ids[:, :1], cache=caches[1], use_cache=True).logits
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="one per cache"):
        decode_step_times(model, caches, [ids[:, 16:17]], steps=1)


def test_speed_profile_lists_every_context_in_order():
    model = tiny_llama()
    figures = speed_profile(model, lambda: SlidingWindowCache(model, window=16), random_ids(1, 80), [16, 48], steps=3)
    assert figures["contexts"] == [16, 48]
    assert all(len(figures[key]) == 2 for key in ("prefill_ms", "median_ms", "p90_ms", "tokens_per_s"))


def test_prefill_fills_the_cache_in_chunks_and_returns_the_last_logits():
    model = tiny_llama()
    ids = random_ids(1, 50)
    cache = FullCache(model)
    last = prefill(model, ids, cache, chunk=16)
    assert cache.get_seq_length() == 50
    with torch.no_grad():
        expected = model(ids).logits[:, -1]
    torch.testing.assert_close(last, expected, atol=1e-5, rtol=0)


def test_timer_works_without_a_gpu():
    into: list[float] = []
    with timer(torch.device("cpu"), into):
        pass
    synchronize(torch.device("cpu"))
    assert len(into) == 1 and into[0] >= 0
