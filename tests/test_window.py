"""SlidingWindowCache against independent references: a banded causal mask over the whole
sequence, and transformers' own sliding-window cache on a model configured with that window."""

from __future__ import annotations

import pytest
import torch
from helpers import generated_logits, left_padded, prefill_then_decode, stream_long, streaming_reference
from tiny_models import random_ids, tiny_gemma3, tiny_llama, tiny_mistral

from hf_kvpolicies import FullCache, SlidingWindowCache, from_spec

ATOL = 1e-4


def test_budget_covering_the_sequence_matches_full_cache(tiny_model):
    ids = random_ids(1, 40)
    expected = prefill_then_decode(tiny_model, ids, FullCache(tiny_model), prefill=12)
    got = prefill_then_decode(tiny_model, ids, SlidingWindowCache(tiny_model, window=40), prefill=12)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_token_by_token_matches_a_banded_causal_mask(tiny_model):
    """Each query sees itself and the ``window`` tokens before it, long after the ring wrapped."""
    ids = random_ids(1, 40, seed=1)
    cache = SlidingWindowCache(tiny_model, window=5)
    got = prefill_then_decode(tiny_model, ids, cache, prefill=1)
    expected = streaming_reference(tiny_model, ids, window=5)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    full = streaming_reference(tiny_model, ids, window=40)
    assert (got[:, 6:] - full[:, 6:]).abs().max() > 1e-2  # the window binds: the test can fail
    assert cache.kept_tokens(cache.first_policy_layer) == 5
    assert cache.get_seq_length() == 40


def test_long_prompt_is_prefilled_causally_then_trimmed(tiny_model):
    """A prompt longer than the window attends causally over all of itself; decoding then sees
    the window only (as the docstring says, unlike token-by-token streaming)."""
    ids = random_ids(1, 36, seed=2)
    got = prefill_then_decode(tiny_model, ids, SlidingWindowCache(tiny_model, window=6), prefill=20)
    expected = streaming_reference(tiny_model, ids, window=6, causal_prefix=20)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_chunked_prefill_matches_the_reference():
    """Chunks arriving at a full ring: kept window + chunk under causal attention, then trimmed."""
    model = tiny_llama()
    ids = random_ids(1, 30, seed=3)
    cache = SlidingWindowCache(model, window=6)
    with torch.no_grad():
        logits = torch.cat([model(ids[:, s : s + 10], cache=cache).logits for s in range(0, 30, 10)], dim=1)
    # query i of chunk c sees the 6 tokens kept before the chunk and the chunk up to itself
    q, k = torch.arange(30)[:, None], torch.arange(30)[None, :]
    chunk_start = q - q % 10
    mask = (k <= q) & (k >= chunk_start - 6)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask[None, None]).logits
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("window", [3, 9])
def test_left_padded_batch_gives_each_row_its_result_alone(make, window):
    """Pads of 0, 1, 2 and 5 tokens; window 3 trims the prompt at prefill, window 9 wraps in decoding."""
    model = make()
    rows = [random_ids(1, n, seed=n) for n in (12, 11, 10, 7)]
    ids, mask = left_padded(rows)
    batched = generated_logits(model, ids, SlidingWindowCache(model, window=window), 16, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = generated_logits(model, row, SlidingWindowCache(model, window=window), 16)
        torch.testing.assert_close(batched[i], alone[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("beams", [1, 3])
def test_generation_matches_transformers_own_sliding_window(beams):
    """Mistral configured with ``sliding_window = W + 1`` runs transformers' DynamicSlidingWindowLayer,
    which keeps the W tokens before each query: greedy and beam search must pick the same tokens."""
    window = 5
    reference_model, model = tiny_mistral(sliding_window=window + 1), tiny_mistral()
    ids = random_ids(2, 5, seed=4)  # a prompt within the window: both prefill it the same way
    options = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, num_beams=beams)
    expected = reference_model.generate(ids, **options)
    assert torch.equal(model.generate(ids, cache=SlidingWindowCache(model, window=window), **options), expected)
    assert not torch.equal(model.generate(ids, **options), expected)  # the window matters


def test_memory_is_constant_and_decoding_writes_in_place():
    model = tiny_llama()
    ids = random_ids(1, 10_000, seed=5)
    cache = SlidingWindowCache(model, window=64)
    at_2000 = stream_long(model, cache, ids)
    assert cache.get_seq_length() == 10_000 and cache.kept_tokens() == 64
    assert cache.get_memory_footprint() == at_2000
    assert cache.layers[0].storage.capacity == 65


@pytest.mark.parametrize("window", [0, -3, 2.5, "8", True, None])
def test_bad_window_is_a_value_error_naming_it(window):
    with pytest.raises(ValueError, match=r"window must be an integer >= 1"):
        SlidingWindowCache(tiny_llama(), window=window)


def test_spec_builds_the_window_and_rejects_bad_values():
    model = tiny_llama()
    assert from_spec(model, "window:window=7").window == 7
    with pytest.raises(ValueError, match="window"):
        from_spec(model, "window:window=0")
    with pytest.raises(ValueError, match="window"):
        from_spec(model, "window:window=big")


def test_a_chunk_after_a_static_decode_step_gets_the_streamed_mask():
    """After a one-token forward (a static step: the host bookkeeping lags the device), the next
    chunk's streaming mask still shows each query what token-by-token streaming shows it."""
    from eval.stream import streaming_masks

    model, ids = tiny_llama(), random_ids(1, 60)

    def run(schedule):
        cache, logits, start = SlidingWindowCache(model, window=16), [], 0
        with torch.no_grad():
            for n in schedule:
                mask = streaming_masks(cache, n, model) if n > 1 else None
                logits.append(model(ids[:, start : start + n], attention_mask=mask, cache=cache).logits)
                start += n
        return torch.cat(logits, 1)

    one_by_one = run([1] * 60)
    for schedule in ([20, 1, 20, 19], [30, 1, 1, 28]):
        torch.testing.assert_close(run(schedule), one_by_one, atol=1e-5, rtol=0)
