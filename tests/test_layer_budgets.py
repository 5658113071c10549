"""Layer budgets of the scored policies: pyramid (PyramidKV) and adaptive, same total as uniform,
each layer's storage sized to its own budget."""

from __future__ import annotations

import pytest
import torch
from helpers import prefill_then_decode
from test_h2o import peaked
from tiny_models import random_ids, tiny_llama

from hf_kvpolicies import H2OCache, KNormCache, SnapKVCache, TOVACache
from hf_kvpolicies.retention.layer_budgets import adaptive_budgets, pyramid_budgets


def test_pyramid_budgets_by_hand():
    # 16 evictable tokens per layer over 4 layers: 31.2, 21.07, 10.93, 0.8 -> 31, 21, 11, 1 (largest remainders)
    assert pyramid_budgets(20, 4, 4) == [35, 25, 15, 5]
    assert pyramid_budgets(256, 32, 30)[0] > pyramid_budgets(256, 32, 30)[-1] >= 32
    assert sum(pyramid_budgets(256, 32, 30)) == 256 * 30
    assert pyramid_budgets(8, 8, 3) == [8, 8, 8]  # nothing evictable: nothing to share
    assert min(pyramid_budgets(3, 0, 6)) >= 1


def test_adaptive_budgets_by_hand():
    flat = torch.ones(1, 1, 4)
    peaked_layer = torch.tensor([[[8.0, 1.0, 1.0, 0.0]]])  # normalised 0.8, 0.1, 0.1, 0
    assert adaptive_budgets([peaked_layer, flat], reserve=[1, 1], total=4) == [2, 2]
    two_strong = torch.tensor([[[5.0, 4.0, 1.0, 0.0]]])  # 0.5, 0.4 beat the flat layer's 0.25
    assert adaptive_budgets([two_strong, flat], reserve=[1, 1], total=4) == [3, 1]
    excluded = torch.tensor([[[float("-inf"), 4.0, 1.0, float("-inf")]]])  # protected or pads never compete
    assert adaptive_budgets([excluded, flat], reserve=[2, 1], total=5) == [3, 2]


def footprint_by_hand(budgets, batch=1, heads=2, head_dim=16, history=0):
    """Native fp32 keys and values, int64 positions, fp32 scores, the int64 free slot, each row's
    int64 first real position, the int64 row and head indices of the storage's per-slot writes and
    SnapKV's fp32 window history, for ``budget + 1`` slots per layer."""
    total = 0
    for budget in budgets:
        slots = budget + 1
        total += 2 * batch * heads * slots * head_dim * 4 + batch * heads * slots * (8 + 4) + batch * heads * 8 + batch * 8
        total += (batch + heads) * 8
        total += batch * heads * history * slots * 4
    return total


def test_pyramid_layers_hold_their_own_budgets(one_thread):
    model = tiny_llama(num_hidden_layers=4)
    cache = SnapKVCache(model, budget=20, window=4, kernel=3, layer_budgets="pyramid")
    prefill_then_decode(model, random_ids(1, 90), cache, prefill=50)
    assert cache.layer_budget_sizes() == [35, 25, 15, 5]
    assert [cache.kept_tokens(i) for i in range(4)] == [35, 25, 15, 5]
    assert [layer.storage.capacity for layer in cache.layers] == [36, 26, 16, 6]
    assert cache.get_memory_footprint() == footprint_by_hand([35, 25, 15, 5], history=4)
    uniform = SnapKVCache(model, budget=20, window=4, kernel=3)
    prefill_then_decode(model, random_ids(1, 90), uniform, prefill=50)
    assert uniform.get_memory_footprint() == footprint_by_hand([20] * 4, history=4)


@pytest.mark.parametrize(
    "make",
    [
        lambda m, **kw: H2OCache(m, heavy=12, recent=4, **kw),
        lambda m, **kw: SnapKVCache(m, budget=16, window=4, kernel=3, **kw),
        lambda m, **kw: TOVACache(m, budget=16, **kw),
        lambda m, **kw: KNormCache(m, budget=16, recent=4, **kw),
    ],
    ids=["h2o", "snapkv", "tova", "knorm"],
)
def test_adaptive_budgets_keep_the_total_and_size_each_layer(make, one_thread):
    model = peaked(tiny_llama(num_hidden_layers=4), factor=8.0)
    ids = random_ids(2, 80, seed=2)
    cache = make(model, layer_budgets="adaptive")
    logits = prefill_then_decode(model, ids, cache, prefill=60)
    by_row = cache.row_layer_budgets()  # each row ranks its own layers
    budgets = cache.layer_budget_sizes()  # each layer sized for its largest row
    assert len(by_row) == 2 and all(sum(row) == 4 * 16 for row in by_row)
    assert budgets == [max(row[i] for row in by_row) for i in range(4)]
    # H2O's accumulated attention ranks a random model's tokens alike in every layer (by age): equal shares
    assert any(len(set(row)) > 1 for row in by_row) or isinstance(cache, H2OCache)
    assert all(b >= layer.retention.protected for row in by_row for b, layer in zip(row, cache.layers))
    assert [layer.storage.capacity for layer in cache.layers] == [b + 1 for b in budgets]
    assert [cache.kept_tokens(i) for i in range(4)] == budgets
    assert [tuple(layer.retention.kept_positions().shape) for layer in cache.layers] == [(2, 2, b) for b in budgets]
    for row, row_budgets in enumerate(by_row):  # a row keeps its own budget in every layer and head
        for layer, budget in zip(cache.layers, row_budgets):
            assert ((layer.retention.kept_positions()[row] >= 0).sum(dim=-1) == budget).all()
    assert torch.isfinite(logits).all()
    short = make(model, layer_budgets="adaptive")  # a prompt within the budget: nothing to share
    prefill_then_decode(model, ids[:, :30], short, prefill=10)
    assert short.layer_budget_sizes() == [16] * 4


def test_a_model_without_the_finishing_hook_is_refused_at_the_next_forward():
    built_with, other = tiny_llama(), tiny_llama()  # same weights, another instance: no hooks
    cache = KNormCache(built_with, budget=8, recent=2, layer_budgets="adaptive")
    ids = random_ids(1, 24)
    with torch.no_grad(), pytest.raises(ValueError, match="build the cache with the model that uses it"):
        other(ids[:, :20], cache=cache)  # would be scored, waiting for a cache-level trim that never comes
        other(ids[:, 20:21], cache=cache)
