"""Streaming perplexity and its fast mode: exact where the masks make it so, labelled elsewhere."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import random_ids, tiny_llama

from eval.perplexity import curve, perplexity, streaming_nll
from eval.stream import DEFAULT_CHUNK, chunks_are_exact, feed, forward_ends, resolve_chunk
from hf_kvpolicies import FullCache, PolicyCache, SlidingWindowCache, from_spec
from hf_kvpolicies.retention import RingRetention
from hf_kvpolicies.retention.sink import SinkRetention
from hf_kvpolicies.storage.native import NativeStorage

pytestmark = pytest.mark.usefixtures("one_thread")


def sink_absolute(model, sinks: int = 4, window: int = 12) -> PolicyCache:
    """The StreamingLLM layout at absolute positions (what ``sink:...,positions=absolute`` builds)."""
    return PolicyCache(model, lambda layout: SinkRetention(window, sinks, rotary=None))


CACHES = {
    "full": FullCache,
    "window": lambda model: SlidingWindowCache(model, window=12),
    "sink": sink_absolute,
}


def test_full_cache_streaming_equals_one_forward(tiny_model):
    ids = random_ids(1, 64)
    with torch.no_grad():
        logits = tiny_model(ids).logits[0, :-1].double()
    expected = math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))
    got = perplexity(streaming_nll(tiny_model, ids, FullCache(tiny_model)))
    assert got == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("policy", sorted(CACHES))
def test_fast_mode_equals_token_by_token(tiny_model, policy):
    ids = random_ids(1, 64, seed=4)
    make = CACHES[policy]
    reference = streaming_nll(tiny_model, ids, make(tiny_model))
    for chunk in (5, 24):  # neither divides the 63 predictions: a short last chunk too
        cache = make(tiny_model)
        assert resolve_chunk(cache, tiny_model, chunk) == (chunk, False)
        got = streaming_nll(tiny_model, ids, cache, chunk_size=chunk)
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
        assert perplexity(got) == pytest.approx(perplexity(reference), rel=1e-5)


def test_chunks_without_the_masks_would_differ():
    """The library's multi-token semantics (causal over kept + new) lets early queries of a
    chunk see evicted tokens: the banded masks are what makes fast mode exact."""
    model = tiny_llama()
    ids = random_ids(1, 90, seed=4)
    reference = streaming_nll(model, ids, SlidingWindowCache(model, window=8))
    cache = SlidingWindowCache(model, window=8)
    nll = []
    for start, end, logits in _unmasked(model, ids[:, :-1], cache, 32):
        nll.append(torch.logsumexp(logits, -1) - logits.gather(-1, ids[0, start + 1 : end + 1, None])[:, 0])
    assert (torch.cat(nll).double() - reference).abs().max() > 1e-2


def _unmasked(model, ids, cache, chunk):
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            end = min(start + chunk, ids.shape[1])
            yield start, end, model(ids[:, start:end], cache=cache).logits[0]


def test_policies_that_chunking_changes_are_approximate():
    model = tiny_llama()
    h2o = from_spec(model, "h2o:heavy=8,recent=8")
    assert not chunks_are_exact(h2o, model)
    assert resolve_chunk(h2o, model, None) == (1, False)  # default mode: streamed token by token
    assert resolve_chunk(h2o, model, 16) == (16, True)  # asked for: chunked, labelled approximate
    other_storage = PolicyCache(model, lambda layout: RingRetention(16), storage=NativeStorage)
    assert not chunks_are_exact(other_storage, model)
    assert resolve_chunk(FullCache(model), model, None) == (DEFAULT_CHUNK, False)
    assert resolve_chunk(FullCache(model), model, 1) == (1, False)


def test_feed_keeps_only_the_last_logit_for_prompts():
    model = tiny_llama()
    ids = random_ids(1, 40)
    every = list(feed(model, ids, FullCache(model), 16))
    last = list(feed(model, ids, FullCache(model), 16, every_logit=False))
    assert [(s, e) for s, e, _ in every] == [(0, 16), (16, 32), (32, 40)]
    assert [logits.shape for *_, logits in every] == [(1, 16, 128), (1, 16, 128), (1, 8, 128)]
    assert [logits.shape for *_, logits in last] == [(1, 1, 128)] * 3
    torch.testing.assert_close(last[-1][2][0, -1], every[-1][2][0, -1], atol=1e-5, rtol=0)


def test_curve_is_windowed_perplexity_by_position():
    nll = torch.cat([torch.zeros(10), torch.full((10,), math.log(4.0))]).double()
    positions, values = curve(nll, bins=2)
    assert positions == [10, 20]
    assert values == pytest.approx([1.0, 4.0])
    positions, values = curve(nll[:7], bins=3)
    assert positions == [3, 6, 7]


@pytest.mark.parametrize("spec", ["window:window=16", "sink:sink_tokens=4,window=12,positions=absolute"])
def test_a_forward_ends_at_every_stop_and_the_result_stays_exact(spec):
    """Stops every 3 tokens inside chunks of 50: the stream is cut where the memory trace samples,
    and every NLL stays the token-by-token one (a lone token between two chunks included: the
    next chunk's mask reads the window's bookkeeping after that token's static step)."""
    model, ids = tiny_llama(), random_ids(1, 120)
    ends = [(start, end) for start, end, _ in feed(model, ids, from_spec(model, spec), 50, stops=[1, 7, 50, 300])]
    assert ends == [(0, 1), (1, 7), (7, 50), (50, 100), (100, 120)]
    assert forward_ends(300, 50) == [50, 100, 150, 200, 250, 300] and forward_ends(257, 256) == [256, 257]
    assert forward_ends(120, 50, [51]) == [50, 51, 101, 120]  # a lone 51st token between two chunks
    one = streaming_nll(model, ids, from_spec(model, spec), chunk_size=1)
    for stops in (range(1, 119, 3), [49], [51], [20, 30]):
        stopped = streaming_nll(model, ids, from_spec(model, spec), chunk_size=50, stops=stops)
        torch.testing.assert_close(stopped, one, rtol=1e-5, atol=1e-5)
