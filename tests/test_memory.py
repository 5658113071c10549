"""get_memory_footprint() is exact: analytic size of every persistent tensor, capacity included."""

from __future__ import annotations

import torch
from helpers import prefill_then_decode
from tiny_models import random_ids, tiny_gemma3, tiny_llama

from hf_kvpolicies import FullCache, SlidingWindowCache

POSITION_BYTES = 8  # one int64 absolute position per slot, kept by the retention


def analytic(layers: int, kv_heads: int, head_dim: int, slots: int, element_bytes: int, batch: int = 1) -> int:
    """2 (keys and values) x layers x KV heads x head dim x slots x bytes, plus slot positions."""
    return layers * (2 * batch * kv_heads * head_dim * slots * element_bytes + slots * POSITION_BYTES)


def test_full_cache_counts_allocated_capacity():
    model = tiny_llama()  # 2 layers, 2 KV heads, head dim 16, fp32
    cache = FullCache(model)
    prefill_then_decode(model, random_ids(1, 40), cache, prefill=20)
    # 25 slots for the 20-token prompt, then a quarter more each time they fill: 31, 38, 47
    assert cache.get_memory_footprint() == analytic(2, 2, 16, 47, 4)
    prefill_then_decode(model, random_ids(1, 300), cache, prefill=300)
    assert cache.get_seq_length() == 340
    assert cache.get_memory_footprint() == analytic(2, 2, 16, 340, 4)  # a chunk larger than a quarter: exactly


def test_half_precision_halves_the_payload():
    model = tiny_llama().to(torch.bfloat16)
    cache = FullCache(model)
    prefill_then_decode(model, random_ids(2, 10), cache, prefill=10)
    assert cache.get_memory_footprint() == analytic(2, 2, 16, 12, 2, batch=2)  # 10 tokens + a quarter


def test_window_memory_is_constant_once_full():
    model = tiny_llama()
    cache = SlidingWindowCache(model, window=16)
    prefill_then_decode(model, random_ids(1, 40), cache, prefill=8)
    first = cache.get_memory_footprint()
    prefill_then_decode(model, random_ids(1, 60), cache, prefill=1)
    assert cache.get_memory_footprint() == first == analytic(2, 2, 16, 17, 4)  # window + 1 ring slots
    assert cache.stored_tokens() == 16 and cache.get_seq_length() == 100


def test_mixed_model_counts_sliding_layers_at_the_model_window():
    model = tiny_gemma3()  # layers: sliding (window 8), sliding, full; 1 KV head, head dim 16
    cache = FullCache(model)
    prefill_then_decode(model, random_ids(1, 30), cache, prefill=30)
    sliding = analytic(1, 1, 16, model.config.sliding_window, 4)  # ring of window - 1 kept + 1 slot
    assert cache.get_memory_footprint() == 2 * sliding + analytic(1, 1, 16, 37, 4)  # 30 tokens + a quarter
