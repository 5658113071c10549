"""Memory figures: the footprint along the stream is the analytic size; the peak is measured."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_ids, tiny_llama
from transformers import DynamicCache

from eval.memory import MemoryTrace, PeakMemory, cuda_indices, decode_peak, footprint, memory_in_use, model_devices
from eval.perplexity import streaming_nll
from hf_kvpolicies import FullCache, SlidingWindowCache

pytestmark = pytest.mark.usefixtures("one_thread")


def analytic_bytes(model, slots: int) -> int:
    """Keys and values of every layer over ``slots`` slots, plus each layer's slot positions (int64)."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = 2 * config.num_key_value_heads * head_dim * slots * 4 + slots * 8
    return config.num_hidden_layers * per_layer


def test_footprint_along_the_stream_is_the_analytic_size():
    model = tiny_llama()
    ids = random_ids(1, 301)
    for cache, slots_at in (
        # the first chunk exactly, then max(tokens held, capacity + a quarter) whenever full
        (FullCache(model), {50: 50, 100: 100, 150: 150, 200: 200, 250: 250, 300: 312}.get),
        (SlidingWindowCache(model, window=16), lambda n: 17),  # the ring: window + 1 slots from the start
    ):
        trace = MemoryTrace(cache)
        streaming_nll(model, ids, cache, chunk_size=50, observer=trace.observe)
        assert trace.positions == [50, 100, 150, 200, 250, 300]
        assert trace.bytes == [analytic_bytes(model, slots_at(n)) for n in trace.positions]


def test_trace_samples_every_stride_tokens_and_the_end():
    model = tiny_llama()
    cache = SlidingWindowCache(model, window=8)
    trace = MemoryTrace(cache, stride=20)
    streaming_nll(model, random_ids(1, 61), cache, observer=trace.observe)
    trace.finish(60)
    assert trace.positions == [1, 21, 41, 60]
    assert trace.bytes == [analytic_bytes(model, 9)] * 4


def test_footprint_of_a_transformers_cache_sums_its_tensors():
    model = tiny_llama()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(random_ids(1, 10), cache=cache)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert footprint(cache) == config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 10 * 4


def test_peak_memory_on_the_cpu_sees_a_large_allocation():
    with PeakMemory(torch.device("cpu")) as peak:
        block = torch.ones(48 * 2**20)  # 192 MiB, touched
        peak.sample()
        del block
    assert peak.source == "sampled RSS"
    assert peak.growth >= 150 * 2**20
    with PeakMemory(torch.device("cpu")) as idle:
        pass
    assert idle.growth < 16 * 2**20
    before = memory_in_use(torch.device("cpu"))
    held = torch.ones(32 * 2**20)  # 128 MiB allocated before the block: counted from ``since``
    with PeakMemory(torch.device("cpu"), since=before) as since:
        pass
    assert since.growth >= 100 * 2**20
    del held


def test_decode_peak_continues_the_stream_one_token_at_a_time():
    model = tiny_llama()
    cache = FullCache(model)
    before = memory_in_use(torch.device("cpu"))
    streaming_nll(model, random_ids(1, 40), cache, chunk_size=16)
    peak = decode_peak(model, cache, random_ids(1, 1), steps=5, since=before)
    assert cache.get_seq_length() == 39 + 5
    assert peak.source == "sampled RSS"


def test_bytes_held_count_the_tokens_kept_and_not_the_capacity():
    """Hand-computed: tiny Llama, 2 layers, 2 KV heads of 16 dims, float32."""
    from hf_kvpolicies import FP8Cache

    from eval.memory import held_bytes

    model = tiny_llama()
    ids = random_ids(1, 301)
    native = 2 * 2 * 16 * 4  # keys and values, 2 heads, 16 dims, 4 bytes: per token per layer
    for cache, tokens in ((FullCache(model), 300), (SlidingWindowCache(model, window=16), 16)):
        trace = MemoryTrace(cache)
        streaming_nll(model, ids, cache, chunk_size=50, observer=trace.observe)
        assert trace.held[-1] == held_bytes(cache) == 2 * tokens * native
        assert trace.bytes[-1] == footprint(cache) >= trace.held[-1]
    assert footprint(FullCache(model)) == 0 and held_bytes(DynamicCache(config=model.config)) is None
    cache = FP8Cache(model, residual=8)
    streaming_nll(model, ids, cache, chunk_size=50)
    payload = 2 * 2 * (16 + 1)  # an fp8 byte per element and an E8M0 scale byte, keys and values, 2 heads
    residual = 8 * 2 * (2 * 16 * 4 + 8)  # 8 native tokens per head and the slot each shadows
    assert held_bytes(cache) == 2 * (300 * payload + residual)


def test_model_devices_names_every_device_that_holds_weights():
    model = tiny_llama()
    assert model_devices(model) == (torch.device("cpu"),)
    model.model.layers[1].to("meta")  # a model spread over devices, as device_map="auto" spreads one
    assert model_devices(model) == (torch.device("cpu"), torch.device("meta"))


def test_memory_is_read_on_the_models_gpus_only(monkeypatch):
    """Reading another GPU would open a CUDA context on it in every process of a launch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    devices = [torch.device("cpu"), torch.device("cuda", 2), torch.device("cuda", 0), torch.device("cuda", 2)]
    assert cuda_indices(devices) == [0, 2]
    assert cuda_indices(torch.device("cuda", 1)) == [1]
    assert cuda_indices(torch.device("cpu")) == []
    assert cuda_indices([torch.device("cpu"), torch.device("meta")]) == []
    peak = PeakMemory(device for device in devices)  # a generator is read once, for both uses
    assert peak.cuda and peak._gpus == [0, 2] and len(peak.devices) == 4
