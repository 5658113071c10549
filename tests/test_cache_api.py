"""What a user meets around the cache: the model instance it belongs to, keys and values of
different widths (multi-head latent attention), iteration, repr and argument types."""

from __future__ import annotations

import copy
import inspect

import numpy as np
import pytest
import torch
from helpers import left_padded, prefill_then_decode, streaming_reference
from tiny_models import char_tokenizer, random_ids, tiny_deepseek_v3, tiny_gemma3, tiny_llama
from transformers import DynamicCache

from hf_kvpolicies import FP8Cache, FullCache, SinkCache, SlidingWindowCache, available_policies, from_spec
from hf_kvpolicies.specs import policy_constructor

pytestmark = pytest.mark.usefixtures("one_thread")

OTHER_INSTANCE = "built for another model instance .* build the cache with the model that uses it"


# --- the model instance ----------------------------------------------------------------------
@pytest.mark.parametrize("other_has_hooks", [False, True], ids=["plain", "hooked"])
def test_window_cache_refuses_another_instance_on_a_padded_batch(other_has_hooks):
    a, b = tiny_llama(), tiny_llama()  # same weights, different instances
    if other_has_hooks:
        SlidingWindowCache(b, window=9)  # b now carries the hooks too
    ids, mask = left_padded([random_ids(1, 12, seed=1), random_ids(1, 5, seed=2)])
    cache = SlidingWindowCache(a, window=9)
    with pytest.raises(ValueError, match=OTHER_INSTANCE):
        b.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False)


def test_sink_cache_refuses_a_model_with_other_rotary_frequencies():
    a = tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    b = tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cache = SinkCache(a, sink_tokens=2, window=6)
    with pytest.raises(ValueError, match=OTHER_INSTANCE):
        with torch.no_grad():
            b(random_ids(1, 12), cache=cache)


def test_a_deep_copy_of_the_model_shares_the_cache_and_its_results():
    model = tiny_llama()
    SlidingWindowCache(model, window=4)
    twin = copy.deepcopy(model)  # a copy made after a cache was built: the hook and the model's token come along
    ids, mask = left_padded([random_ids(1, 12, seed=1), random_ids(1, 5, seed=2)])
    expected = model.generate(ids, attention_mask=mask, cache=SlidingWindowCache(model, window=4), max_new_tokens=6)
    got = twin.generate(ids, attention_mask=mask, cache=SlidingWindowCache(model, window=4), max_new_tokens=6)
    assert torch.equal(got, expected)


def test_a_config_instead_of_the_model_is_a_clear_error():
    with pytest.raises(ValueError, match=r"FullCache takes the model itself, not LlamaConfig.*FullCache\(model\)"):
        FullCache(tiny_llama().config)


# --- keys and values of different widths (DeepSeek-V3's multi-head latent attention) --------
@pytest.mark.parametrize("spec", ["full", "window:window=64", "sink:sink_tokens=2,window=62,positions=absolute"])
def test_latent_attention_matches_dynamic_cache(spec):
    model = tiny_deepseek_v3()
    ids = random_ids(1, 30)
    expected = prefill_then_decode(model, ids, DynamicCache(config=model.config), prefill=10)
    cache = from_spec(model, spec)
    torch.testing.assert_close(prefill_then_decode(model, ids, cache, prefill=10), expected, atol=1e-5, rtol=0)
    keys, values, _ = next(iter(cache))
    assert (keys.shape[-1], values.shape[-1]) == (16, 8)  # each sized from its own width


@pytest.mark.parametrize(("native_spec", "fp8_spec"), [
    ("full", "fp8:residual={}"),
    ("window:window=6", "window:window=6,storage=fp8:residual={}"),
])
def test_latent_attention_in_fp8_sizes_values_from_the_values(native_spec, fp8_spec):
    model = tiny_deepseek_v3()
    ids = random_ids(1, 30)
    native = prefill_then_decode(model, ids, from_spec(model, native_spec), prefill=10)
    all_native = from_spec(model, fp8_spec.format(64))  # a residual covering the stream: nothing quantised
    torch.testing.assert_close(prefill_then_decode(model, ids, all_native, prefill=10), native, atol=1e-5, rtol=0)
    quantised = from_spec(model, fp8_spec.format(0))
    assert 0 < (prefill_then_decode(model, ids, quantised, prefill=10) - native).abs().max() < 0.05
    storage = quantised.layers[0].storage
    assert storage.payload.shape[-1] == 16 + 8 and storage.scales.shape[-1] == 2  # a key scale and a value scale


def test_latent_attention_window_evicts_like_its_reference():
    model = tiny_deepseek_v3()
    ids = random_ids(1, 30)
    cache = SlidingWindowCache(model, window=6)
    got = prefill_then_decode(model, ids, cache, prefill=10)
    expected = streaming_reference(model, ids, window=6, causal_prefix=10)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert cache.kept_tokens() == 6 and cache.get_seq_length() == 30


def test_latent_attention_refuses_rerotated_sinks_at_construction():
    with pytest.raises(ValueError, match="positions='cache' .* use positions='absolute'"):
        SinkCache(tiny_deepseek_v3(), sink_tokens=2, window=6)


# --- small things ------------------------------------------------------------------------------
def test_iterating_yields_what_dynamic_cache_yields():
    model = tiny_gemma3()  # sliding (window 8), sliding, full
    ids = random_ids(1, 20)
    reference = DynamicCache(config=model.config)
    cache = FullCache(model)
    with torch.no_grad():
        model(ids, cache=reference)
        model(ids, cache=cache)
    ours, theirs = list(cache), list(reference)
    assert len(ours) == len(theirs) == 3
    for (keys, values, window), (ref_keys, ref_values, ref_window) in zip(ours, theirs):
        torch.testing.assert_close(keys, ref_keys, atol=0, rtol=0)
        torch.testing.assert_close(values, ref_values, atol=0, rtol=0)
        assert (window is None) == (ref_window is None) and (window is None or int(window) == int(ref_window))


@pytest.mark.parametrize("name", available_policies())
def test_every_policy_iterates_over_what_it_keeps(name):
    model = tiny_llama()
    constructor = policy_constructor(name)
    kwargs = constructor.budget_parameters(8) or {}
    if "tokenizer" in inspect.signature(constructor).parameters:
        kwargs["tokenizer"] = char_tokenizer()  # KVzip writes its repeat prompt with it
    cache = constructor(model, **kwargs)
    ids = random_ids(2, 20)
    if getattr(cache, "head_budgets", "uniform") == "adaptive":  # pooled heads: each head keeps its own count
        prefill_then_decode(model, ids, cache, prefill=12)
        reference = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, cache=reference)
        for (keys, values, window), layer, ref in zip(cache, cache.layers, reference.layers):
            positions = layer.retention.kept_positions()[..., -keys.shape[2] :]  # right-aligned, -1 in front
            assert keys.shape[:3] == values.shape[:3] == positions.shape and window is None
            assert keys.shape[2] == int((positions >= 0).sum(-1).max())  # as many as the busiest head keeps
            assert bool((keys[positions < 0] == 0).all())
            if layer is cache.layers[0]:  # the first layer's keys depend on the tokens alone
                expected = ref.keys.gather(2, positions.clamp(min=0)[..., None].expand_as(keys))
                torch.testing.assert_close(keys[positions >= 0], expected[positions >= 0])
        cache = constructor(model, **kwargs, head_budgets="uniform")
    prefill_then_decode(model, ids, cache, prefill=12)
    layers = list(cache)
    assert len(layers) == 2
    for index, (keys, values, window) in enumerate(layers):
        assert keys.shape == values.shape == (2, 2, cache.kept_tokens(index), 16) and window is None


def test_repr_is_readable():
    model = tiny_llama()
    assert repr(FP8Cache(model)) == (
        "FP8Cache(layers=2, storage=FP8Storage.factory(residual=32, dtype='float8_e4m3fn'))"
    )
    assert repr(SlidingWindowCache(model, window=4)) == "SlidingWindowCache(layers=2, storage='native')"


def test_numpy_integers_are_integers():
    model = tiny_llama()
    cache = SlidingWindowCache(model, window=np.int64(4))
    prefill_then_decode(model, random_ids(1, 12), cache, prefill=6)
    assert cache.kept_tokens() == 4 and type(cache.window) is int
    sink = SinkCache(model, sink_tokens=np.int32(2), window=np.int64(4))
    assert (sink.sink_tokens, sink.window) == (2, 4)
    with pytest.raises(ValueError, match="window must be an integer >= 1, got True"):
        SlidingWindowCache(model, window=True)


@pytest.mark.parametrize("name", available_policies())
def test_a_cache_refuses_another_batch_size_before_writing(name):
    model = tiny_llama()
    constructor = policy_constructor(name)
    kwargs = constructor.budget_parameters(8) or {}
    if "tokenizer" in inspect.signature(constructor).parameters:
        kwargs["tokenizer"] = char_tokenizer()
    cache = constructor(model, **kwargs)
    prefill_then_decode(model, random_ids(3, 12), cache, prefill=10)
    seen, kept = cache.get_seq_length(), [layer.kept_keys_values() for layer in cache.layers]
    with torch.no_grad(), pytest.raises(ValueError, match=r"holds a batch of 3 rows and this forward brings 1: call cache.reset\(\)"):
        model(random_ids(1, 1), cache=cache)
    assert cache.get_seq_length() == seen  # nothing was written
    for layer, (keys, values) in zip(cache.layers, kept):
        torch.testing.assert_close(layer.kept_keys_values()[0], keys, atol=0, rtol=0)
    cache.reset()
    prefill_then_decode(model, random_ids(1, 12), cache, prefill=10)
    assert cache.get_seq_length() == 12
