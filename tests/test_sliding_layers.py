"""Models' own sliding-window layers: the policy governs them on models whose every layer slides
(Mistral-7B-v0.1's layout), within the model's window; hybrids (Gemma 3) keep the model window
there. Full caches roll back on sliding layers as transformers' own does (assisted decoding,
prompt lookup); bounded ones refuse before prefill."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, left_padded, prefill_then_decode
from tiny_models import random_ids, tiny_gemma3, tiny_mistral
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from hf_kvpolicies import FP8Cache, FullCache, H2OCache, SinkCache, SlidingWindowCache, from_spec

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL_WINDOW = 6


def all_sliding():
    """Every layer a sliding-window layer (window 6), as Mistral-7B-v0.1 with ``sliding_window`` set."""
    return tiny_mistral(sliding_window=MODEL_WINDOW)


@torch.no_grad()
def banded_reference(model, ids: torch.Tensor, window: int, prefill: int) -> torch.Tensor:
    """One forward under an explicit mask: each query sees the model's band (``sliding_window - 1``
    tokens before it); decoded queries (after ``prefill``) see only the ``window`` before them."""
    length = ids.shape[1]
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    band = model.config.sliding_window - 1
    seen = (k <= q) & (q - k <= band) & ((q - k <= window) | (q < prefill))
    return model(ids, attention_mask=seen.expand(ids.shape[0], 1, length, length)).logits


def test_every_layer_is_governed_on_an_all_sliding_model():
    model = all_sliding()
    for spec in ("full", "window:window=3", "fp8"):
        cache = from_spec(model, spec)
        assert cache.governed == [True, True] and cache.governed_layers == 2
    hybrid = FullCache(tiny_gemma3())
    assert hybrid.governed == [False, False, True]  # the model window on sliding layers, the policy on full ones


@pytest.mark.parametrize("make", [FullCache, lambda m: SlidingWindowCache(m, window=MODEL_WINDOW - 1),
                                  lambda m: SlidingWindowCache(m, window=100)], ids=["full", "window=5", "window=100"])
def test_budget_covering_the_model_window_is_transformers_sliding_layer(make):
    model = all_sliding()
    ids = random_ids(2, 30)
    reference = DynamicCache(config=model.config)
    expected = prefill_then_decode(model, ids, reference, prefill=10)
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in reference.layers)
    cache = make(model)
    torch.testing.assert_close(prefill_then_decode(model, ids, cache, prefill=10), expected, atol=1e-5, rtol=0)
    assert [cache.kept_tokens(i) for i in range(2)] == [MODEL_WINDOW - 1] * 2
    assert torch.equal(greedy(model, ids[:1, :9], make(model), 20), greedy(model, ids[:1, :9], None, 20))


@pytest.mark.parametrize("prefill", [2, 12])
def test_a_smaller_window_chooses_inside_the_model_window(prefill):
    model = all_sliding()
    ids = random_ids(1, 28, seed=4)
    cache = SlidingWindowCache(model, window=3)
    got = prefill_then_decode(model, ids, cache, prefill=prefill)
    torch.testing.assert_close(got, banded_reference(model, ids, window=3, prefill=prefill), atol=1e-5, rtol=0)
    assert cache.kept_tokens() == 3 and cache.get_seq_length() == 28
    full = prefill_then_decode(model, ids, FullCache(model), prefill=prefill)
    assert (got - full).abs().max() > 1e-2  # the policy does something


def test_left_padded_rows_match_each_row_alone():
    model = all_sliding()
    rows = [random_ids(1, 12, seed=1), random_ids(1, 7, seed=2)]
    ids, mask = left_padded(rows)
    out = model.generate(ids, attention_mask=mask, cache=SlidingWindowCache(model, window=3),
                         max_new_tokens=10, do_sample=False)
    for row, alone in zip(out, rows):
        expected = greedy(model, alone, SlidingWindowCache(model, window=3), 10)[0, alone.shape[1]:]
        assert torch.equal(row[ids.shape[1]:], expected)


@pytest.mark.parametrize(("make", "name"), [
    (lambda m: SinkCache(m, sink_tokens=2, window=3), "SinkCache"),
    (lambda m: H2OCache(m, heavy=2, recent=2), "H2OCache"),
])
def test_a_policy_that_cannot_choose_inside_the_window_is_refused(make, name):
    with pytest.raises(ValueError, match=f"{name} cannot serve mistral: every layer .* sliding-window .*SlidingWindowCache"):
        make(all_sliding())


# --- rolling back: assisted decoding and prompt lookup -------------------------------------
@pytest.mark.parametrize("make", [FullCache, lambda m: FP8Cache(m, residual=64)], ids=["full", "fp8"])
@pytest.mark.parametrize("mode", ["assistant", "prompt-lookup"])
def test_full_caches_roll_back_on_a_hybrid_model_like_dynamic_cache(make, mode):
    """The prompt (20 tokens) is longer than the sliding window (8): the sliding layers evict.
    FP8 with a residual covering the sequence holds every token natively, so tokens must equal."""
    model = tiny_gemma3()
    assistant = tiny_gemma3(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    extra = {"assistant_model": assistant} if mode == "assistant" else {"prompt_lookup_num_tokens": 3}
    ids = torch.cat([random_ids(1, 10, seed=5)] * 2, dim=1)  # repeats: prompt lookup finds drafts
    expected = greedy(model, ids, DynamicCache(config=model.config), 24, **extra)
    cache = make(model)
    assert torch.equal(greedy(model, ids, cache, 24, **extra), expected)
    assert torch.equal(expected, greedy(model, ids, None, 24))  # greedy drafting changes no token
    window = model.config.sliding_window
    assert [cache.kept_tokens(i) for i in range(2)] == [window - 1] * 2  # restricted back to the window


def test_fp8_cache_rolls_back_with_its_default_residual():
    model = tiny_gemma3()
    ids = torch.cat([random_ids(1, 10, seed=5)] * 2, dim=1)
    expected = greedy(model, ids, FP8Cache(model), 24)
    assert torch.equal(greedy(model, ids, FP8Cache(model), 24, prompt_lookup_num_tokens=3), expected)


@pytest.mark.parametrize("spec", ["window:window=4", "sink:sink_tokens=2,window=4", "window:window=4,storage=fp8"])
def test_bounded_caches_refuse_rollback_before_prefill(spec):
    model = tiny_gemma3()
    cache = from_spec(model, spec)
    with pytest.raises(NotImplementedError, match=f"{type(cache).__name__} evicts tokens.*FullCache, FP8Cache"):
        greedy(model, random_ids(1, 12), cache, 8, prompt_lookup_num_tokens=3)
    assert cache.get_seq_length() == 0  # refused before the prefill ran


def test_crop_of_a_sliding_layer_needs_past_recording():
    """As DynamicSlidingWindowLayer: once the window has evicted, a rollback needs recording."""
    model = tiny_gemma3()
    cache = FullCache(model)
    with torch.no_grad():
        model(random_ids(1, 20), cache=cache)
    with pytest.raises(NotImplementedError, match="activate_past_recording"):
        cache.crop(-2)
    cache.crop(0)  # nothing to remove: allowed
