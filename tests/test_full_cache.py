"""FullCache behaves exactly like DynamicCache: logits, generate paths, batches, beams."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import greedy, prefill_then_decode
from tiny_models import random_ids, tiny_gemma3, tiny_llama
from transformers import DynamicCache

from hf_kvpolicies import FP8Cache, FullCache


def test_logits_match_dynamic_cache(tiny_model):
    ids = random_ids(1, 48)
    expected = prefill_then_decode(tiny_model, ids, DynamicCache(config=tiny_model.config), prefill=16)
    got = prefill_then_decode(tiny_model, ids, FullCache(tiny_model), prefill=16)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_greedy_generate_matches_both_argument_names(tiny_model):
    ids = random_ids(1, 10)
    expected = greedy(tiny_model, ids, None, 24)
    assert torch.equal(greedy(tiny_model, ids, FullCache(tiny_model), 24), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        legacy = tiny_model.generate(
            ids, past_key_values=FullCache(tiny_model), max_new_tokens=24, do_sample=False
        )
    assert torch.equal(legacy, expected)


def test_beam_search_matches_dynamic_cache(tiny_model):
    ids = random_ids(1, 10, seed=3)
    expected = greedy(tiny_model, ids, None, 16, num_beams=2)
    assert torch.equal(greedy(tiny_model, ids, FullCache(tiny_model), 16, num_beams=2), expected)


def test_sampling_matches_dynamic_cache():
    model = tiny_llama()
    ids = random_ids(1, 8)
    torch.manual_seed(11)
    expected = model.generate(ids, max_new_tokens=16, do_sample=True, top_k=20)
    torch.manual_seed(11)
    got = model.generate(ids, cache=FullCache(model), max_new_tokens=16, do_sample=True, top_k=20)
    assert torch.equal(got, expected)


def test_left_padded_batch_matches_each_row_alone(tiny_model):
    long, short = random_ids(1, 12, seed=1), random_ids(1, 7, seed=2)
    pad = torch.zeros(1, 5, dtype=torch.long)
    batch = torch.cat([long, torch.cat([pad, short], dim=1)])
    mask = torch.cat([torch.ones(1, 12), torch.cat([torch.zeros(1, 5), torch.ones(1, 7)], dim=1)]).long()
    out = tiny_model.generate(
        batch, attention_mask=mask, cache=FullCache(tiny_model), max_new_tokens=12, do_sample=False
    )
    assert torch.equal(out[0, 12:], greedy(tiny_model, long, FullCache(tiny_model), 12)[0, 12:])
    assert torch.equal(out[1, 12:], greedy(tiny_model, short, FullCache(tiny_model), 12)[0, 7:])


def test_model_sliding_layers_keep_the_model_window():
    """On Gemma 3's sliding layers every policy keeps the model's window - 1 tokens, as
    transformers' DynamicSlidingWindowLayer does; full-attention layers follow the policy."""
    model = tiny_gemma3()
    cache = FullCache(model)
    prefill_then_decode(model, random_ids(1, 30), cache, prefill=12)
    window = model.config.sliding_window
    assert [layer.is_sliding for layer in cache.layers] == [True, True, False]
    assert [cache.kept_tokens(i) for i in range(3)] == [window - 1, window - 1, 30]
    assert all(cache.layers[i].get_seq_length() == 30 for i in range(3))


def test_growth_keeps_content_across_reallocation():
    model = tiny_llama()
    ids = random_ids(1, 600)
    expected = model(ids).logits[:, -1]
    cache = FullCache(model)
    with torch.no_grad():
        model(ids[:, :300], cache=cache)
        for t in range(300, 599):
            model(ids[:, t : t + 1], cache=cache)
        last = model(ids[:, 599:], cache=cache).logits[:, -1]
    assert cache.layers[0].storage.capacity == 731  # 300 slots at prefill, grown by a quarter 4 times
    torch.testing.assert_close(last, expected, atol=1e-5, rtol=0)


def test_crop_rolls_back_like_dynamic_cache():
    model = tiny_llama()
    ids = random_ids(1, 20)
    cache = FullCache(model)
    with torch.no_grad():
        model(ids, cache=cache)
        cache.crop(-5)
        assert cache.get_seq_length() == 15
        again = model(ids[:, 15:], cache=cache).logits
    torch.testing.assert_close(again, model(ids).logits[:, 15:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


def test_first_policy_layer_skips_the_models_own_sliding_layers():
    assert FullCache(tiny_llama()).first_policy_layer == 0
    assert FullCache(tiny_gemma3()).first_policy_layer == 2  # layers 0 and 1 slide with the model window
    assert FullCache(tiny_gemma3(layer_types=["sliding_attention"] * 3)).first_policy_layer == 0


def test_kept_tokens_reads_the_first_governed_layer_by_default():
    model = tiny_gemma3()  # layers 0 and 1 slide with the model window of 8
    cache = FullCache(model)
    with torch.no_grad():
        model(random_ids(1, 20), cache=cache)
    assert cache.kept_tokens() == cache.kept_tokens(2) == 20
    assert cache.kept_tokens(0) == 7  # the sliding layer keeps the model window (8) less one, as DynamicCache does


def test_governed_layers_counts_the_layers_the_policy_decides():
    assert FullCache(tiny_llama()).governed_layers == len(tiny_llama().model.layers)
    assert FullCache(tiny_gemma3()).governed_layers == 1  # layers 0 and 1 slide with the model window


def test_blocks_give_dynamic_cache_logits_and_hold_whole_blocks(tiny_model):
    ids = random_ids(1, 48)
    expected = prefill_then_decode(tiny_model, ids, DynamicCache(config=tiny_model.config), prefill=16)
    cache = FullCache(tiny_model, block=10)
    got = prefill_then_decode(tiny_model, ids, cache, prefill=16)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    grown = {layer.storage.capacity for layer in cache.layers if getattr(layer.retention, "block", None)}
    assert grown == ({50} if not all(layout.is_sliding for layout in cache.layouts) else set())  # (all sliding: windows)
    assert cache.get_seq_length() == 48


def test_blocks_serve_padded_batches_and_beams(tiny_model):
    long, short = random_ids(1, 12, seed=1), random_ids(1, 7, seed=2)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 5, dtype=torch.long), short], dim=1)])
    mask = torch.cat([torch.ones(1, 12), torch.cat([torch.zeros(1, 5), torch.ones(1, 7)], dim=1)]).long()
    out = tiny_model.generate(batch, attention_mask=mask, cache=FullCache(tiny_model, block=4), max_new_tokens=12, do_sample=False)
    assert torch.equal(out[0, 12:], greedy(tiny_model, long, FullCache(tiny_model), 12)[0, 12:])
    assert torch.equal(out[1, 12:], greedy(tiny_model, short, FullCache(tiny_model), 12)[0, 7:])
    ids = random_ids(1, 10, seed=3)
    expected = greedy(tiny_model, ids, None, 16, num_beams=2)
    assert torch.equal(greedy(tiny_model, ids, FullCache(tiny_model, block=4), 16, num_beams=2), expected)


@pytest.mark.parametrize(
    "kwargs, message", [({"block": 0}, "block"), ({"block": 8, "max_length": 64}, "not both")]
)
def test_bad_blocks_are_refused(kwargs, message):
    for make in (FullCache, FP8Cache):
        with pytest.raises(ValueError, match=message):
            make(tiny_llama(), **kwargs)
