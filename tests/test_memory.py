"""get_memory_footprint() is exact: analytic size of every persistent tensor, capacity included."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import prefill_then_decode
from tiny_models import random_ids, tiny_gemma3, tiny_llama

from hf_kvpolicies import FullCache, SlidingWindowCache, from_spec
from hf_kvpolicies.storage import NativeStorage

POSITION_BYTES = 8  # one int64 absolute position per slot, kept by the retention


def analytic(layers: int, kv_heads: int, head_dim: int, slots: int, element_bytes: int, batch: int = 1) -> int:
    """2 (keys and values) x layers x KV heads x head dim x slots x bytes, plus slot positions."""
    return layers * (2 * batch * kv_heads * head_dim * slots * element_bytes + slots * POSITION_BYTES)


def test_full_cache_counts_allocated_capacity():
    model = tiny_llama()  # 2 layers, 2 KV heads, head dim 16, fp32
    cache = FullCache(model)
    prefill_then_decode(model, random_ids(1, 40), cache, prefill=20)
    # 20 slots for the 20-token prompt, then a quarter more each time they fill: 25, 31, 38, 47
    assert cache.get_memory_footprint() == analytic(2, 2, 16, 47, 4)
    prefill_then_decode(model, random_ids(1, 300), cache, prefill=300)
    assert cache.get_seq_length() == 340
    assert cache.get_memory_footprint() == analytic(2, 2, 16, 340, 4)  # a chunk larger than a quarter: exactly


def test_half_precision_halves_the_payload():
    model = tiny_llama().to(torch.bfloat16)
    cache = FullCache(model)
    prefill_then_decode(model, random_ids(2, 10), cache, prefill=10)
    assert cache.get_memory_footprint() == analytic(2, 2, 16, 10, 2, batch=2)  # the prompt's 10 tokens exactly


def test_window_memory_is_constant_once_full():
    model = tiny_llama()
    cache = SlidingWindowCache(model, window=16)
    prefill_then_decode(model, random_ids(1, 40), cache, prefill=8)
    first = cache.get_memory_footprint()
    prefill_then_decode(model, random_ids(1, 60), cache, prefill=1)
    assert cache.get_memory_footprint() == first == analytic(2, 2, 16, 17, 4)  # window + 1 ring slots
    assert cache.kept_tokens() == 16 and cache.get_seq_length() == 100


def test_mixed_model_counts_sliding_layers_at_the_model_window():
    model = tiny_gemma3()  # layers: sliding (window 8), sliding, full; 1 KV head, head dim 16
    cache = FullCache(model)
    prefill_then_decode(model, random_ids(1, 30), cache, prefill=30)
    sliding = analytic(1, 1, 16, model.config.sliding_window, 4)  # ring of window - 1 kept + 1 slot
    assert cache.get_memory_footprint() == 2 * sliding + analytic(1, 1, 16, 30, 4)  # the prompt's 30 tokens exactly


@pytest.mark.parametrize("spec", [
    "window:window=99999999999999999999",
    "window:window=1000000000",
    "sink:sink_tokens=4,window=100000000000",
    "tova:budget=100000000",
    "h2o:heavy=100000000,recent=5",
    "knorm:budget=100000000,layer_budgets=adaptive",
    "full:max_length=100000000",
])
def test_budgets_beyond_the_models_positions_allocate_no_more_than_them(spec, caplog):
    """A budget the model cannot use (its 512 positions) is capped there, saying so: a 2-token
    prompt allocates at most 513 slots per layer (a pre-sized full cache 512), never the budget."""
    model = tiny_llama()  # max_position_embeddings=512
    with caplog.at_level(logging.WARNING):
        cache = from_spec(model, spec)
    assert "exceeds the 512 positions of llama; each layer keeps (and allocates) at most 512 tokens" in caplog.text
    prefill_then_decode(model, random_ids(1, 3), cache, prefill=2)
    assert all(layer.storage.capacity <= 513 for layer in cache.layers)
    assert cache.get_memory_footprint() <= 2 * (2 * 2 * 513 * 16 * 4 + 2 * 513 * (8 + 4) + 2 * 8) + 2 * 513 * 8


def test_storage_no_model_can_use_is_refused_at_construction():
    with pytest.raises(ValueError, match="residual=1000000000 exceeds the 512 positions of the model.*give residual <= 512"):
        from_spec(tiny_llama(), "fp8:residual=1000000000")


def test_an_allocation_the_device_cannot_hold_names_its_bytes():
    with pytest.raises(ValueError, match=r"the keys of 1000000000000 slots asks for 128,000,000,000,000 bytes .* cannot be allocated"):
        NativeStorage().allocate(torch.zeros(1, 2, 1, 16), 10**12)
