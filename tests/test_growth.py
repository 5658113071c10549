"""A full cache holds at most 1.25x the tokens it keeps, appends in place, amortised O(1)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_llama

from hf_kvpolicies import FP8Cache, FullCache

STREAM = 2000
POSITION_BYTES = 8


def buffer(storage) -> torch.Tensor:
    return getattr(storage, "keys", None) if hasattr(storage, "keys") else storage.payload


def held_bytes(layer) -> int:
    """What the tokens kept cost without spare capacity (fp8: plus its fixed native residual)."""
    storage, live = layer.storage, layer.retention.live
    if hasattr(storage, "payload"):
        per_slot = storage.payload[:, :, :, :1].nbytes + storage.scales[:, :, :, :1].nbytes
        fixed = storage.ring.nbytes
    else:
        per_slot, fixed = storage.keys[:, :, :1].nbytes + storage.values[:, :, :1].nbytes, 0
    return live * (per_slot + POSITION_BYTES) + fixed


@pytest.mark.parametrize("make", [FullCache, FP8Cache], ids=["full", "fp8"])
@pytest.mark.parametrize("prompt", [1, 100, 1500])
def test_allocation_stays_within_a_quarter_of_the_tokens_held(make, prompt):
    """Keys and values go straight to the cache's ``update`` (the model's cost is not the point):
    a prompt, then one token at a time up to 2,000 tokens."""
    model = tiny_llama()
    cache = make(model)
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(1, heads, STREAM, dim, generator=generator)
    layer = cache.layers[0]
    cache.update(tokens[:, :, :prompt], tokens[:, :, :prompt], 0)
    reallocations, last = 0, buffer(layer.storage)
    for t in range(prompt, STREAM):
        cache.update(tokens[:, :, t : t + 1], tokens[:, :, t : t + 1], 0)
        reallocations += buffer(layer.storage) is not last
        last = buffer(layer.storage)
        allocated = layer.storage.nbytes + layer.retention.state_nbytes
        assert allocated <= 1.25 * held_bytes(layer), f"at {t + 1} tokens"
    assert layer.retention.live == STREAM
    # geometric growth by a quarter (by one slot while under 8 slots): log_1.25 of the stream's
    # growth reallocations, every other append written in place
    assert 0 < reallocations <= math.ceil(math.log(STREAM / prompt, 1.25)) + 8
    keys, _ = layer.storage.read(STREAM)
    torch.testing.assert_close(keys, tokens, atol=0.07, rtol=0.07)  # content survives every reallocation
