"""How the scored policies see attention: chunked scores equal unchunked ones; the model's
dispatcher (hooks) is installed once and inert for every other cache."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import prefill_then_decode
from tiny_models import random_ids, tiny_gemma3, tiny_llama
from transformers import DynamicCache

from hf_kvpolicies import FullCache, H2OCache, SlidingWindowCache, TOVACache, attention_scores
from hf_kvpolicies.attention_scores import (
    accumulated_attention,
    attention_chunks,
    max_attention,
    query_probabilities,
)
from hf_kvpolicies import hooks
from hf_kvpolicies.hooks import detach


def naive_scores(query, keys, scaling, first_new):
    """The whole query x key matrix at once: causal softmax, summed over queries and grouped heads."""
    batch, query_heads, length, _ = query.shape
    kv_heads, key_count = keys.shape[1], keys.shape[2]
    expanded = keys.repeat_interleave(query_heads // kv_heads, dim=1)
    logits = query @ expanded.transpose(-1, -2) * scaling
    future = torch.arange(key_count)[None, :] > (first_new + torch.arange(length))[:, None]
    probs = logits.masked_fill(future, float("-inf")).softmax(-1)
    return probs.sum(2).view(batch, kv_heads, -1, key_count).sum(2)


def test_chunked_scores_equal_unchunked(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 37, 8, generator=generator)
    keys = torch.randn(2, 3, 50, 8, generator=generator)  # 13 kept keys, then the 37 new ones
    expected = naive_scores(query, keys, 0.35, first_new=13)
    sizes = []
    softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, *a, **k: sizes.append(x.numel()) or softmax(x, *a, **k))
    whole = accumulated_attention(query, keys, 0.35, first_new=13, chunk_elements=10**9)
    assert sizes == [2 * 6 * 37 * 50]
    for chunk_elements in (2 * 6 * 50 * 5, 1):  # 5 queries at a time, then one
        sizes.clear()
        chunked = accumulated_attention(query, keys, 0.35, first_new=13, chunk_elements=chunk_elements)
        per_chunk = 5 if chunk_elements > 1 else 1
        # each chunk's softmax spans only the keys up to its last query (the later ones are its future)
        expected_sizes = [
            2 * 6 * (min(37, start + per_chunk) - start) * (13 + min(37, start + per_chunk))
            for start in range(0, 37, per_chunk)
        ]
        assert sizes == expected_sizes and sum(sizes) < 0.7 * 2 * 6 * 37 * 50
        torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=0)


def test_shared_key_row_scores_like_a_copy_per_head():
    """Pooled heads hand one key row expanded to every KV head; scoring it as one product with
    all query heads gives what a materialised copy per head gives (masks, chunks, both statistics)."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 6, 9, 8, generator=generator)
    row = torch.randn(2, 1, 40, 8, generator=generator)
    shared, copied = row.expand(2, 3, 40, 8), row.repeat(1, 3, 1, 1)
    key_mask = torch.rand(2, 3, 40, generator=generator) > 0.3
    for statistic in (accumulated_attention, max_attention):
        for chunk_elements in (10**9, 2 * 6 * 40 * 2):
            expected = statistic(query, copied, 0.3, 31, chunk_elements, key_mask)
            got = statistic(query, shared, 0.3, 31, chunk_elements, key_mask)
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(expected[:, 0], expected[:, 1])  # the heads' masks differ, and so do their scores


def test_one_decode_query_scores_as_the_last_row_of_a_forward():
    """A decode step's query takes its own short path (one product, one softmax): it gives the
    probabilities the chunked path gives the last query of a longer forward, for grouped heads and
    for a pooled shared key row, with key masks, and both statistics follow."""
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(2, 6, 4, 8, generator=generator)
    row = torch.randn(2, 1, 30, 8, generator=generator)
    key_mask = torch.rand(2, 3, 30, generator=generator) > 0.3
    for keys in (torch.randn(2, 3, 30, 8, generator=generator), row.expand(2, 3, 30, 8)):
        whole = list(attention_chunks(query, keys, 0.3, 26, key_mask, chunk_elements=10**9))
        last = whole[0][2][:, :, :, -1:]
        step = list(attention_chunks(query[:, :, -1:], keys, 0.3, 29, key_mask))
        assert len(step) == 1 and step[0][:2] == (0, 1)
        torch.testing.assert_close(step[0][2], last, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(query_probabilities(query[:, :, -1:], keys, 0.3, key_mask), last[:, :, :, 0])
        for statistic, reduce in ((accumulated_attention, torch.sum), (max_attention, torch.amax)):
            got = statistic(query[:, :, -1:], keys, 0.3, 29, key_mask=key_mask)
            torch.testing.assert_close(got, reduce(last[:, :, :, 0], dim=2), rtol=1e-6, atol=1e-7)
        assert (got[~key_mask] == 0).all() and (got[key_mask] > 0).all()


def test_prefill_scores_do_not_depend_on_the_chunk(monkeypatch):
    model = tiny_llama()
    ids = random_ids(1, 60)
    default = H2OCache(model, heavy=6, recent=4)
    prefill_then_decode(model, ids, default, prefill=40)
    monkeypatch.setattr(attention_scores, "SCORE_CHUNK_ELEMENTS", 4 * 40 * 3)  # 3 queries per chunk
    chunked = H2OCache(model, heavy=6, recent=4)
    prefill_then_decode(model, ids, chunked, prefill=40)
    for a, b in zip(default.layers, chunked.layers):
        assert torch.equal(a.retention.kept_positions(), b.retention.kept_positions())
        torch.testing.assert_close(a.retention.scores, b.retention.scores, atol=1e-5, rtol=0)


def hook_counts(model) -> list[tuple[int, int]]:
    """(pre-hooks on each attention module, forward hooks on its q_proj)."""
    attention = [layer.self_attn for layer in model.model.layers]
    return [(len(module._forward_pre_hooks), len(module.q_proj._forward_hooks)) for module in attention]


def test_hooks_are_installed_once_and_other_caches_are_unchanged():
    model = tiny_gemma3()
    ids = random_ids(1, 40)
    caches = {
        "dynamic": lambda: DynamicCache(config=model.config),
        "full": lambda: FullCache(model),
        "window": lambda: SlidingWindowCache(model, window=8),
    }
    before = {name: prefill_then_decode(model, ids, make(), prefill=12) for name, make in caches.items()}
    with torch.no_grad():
        plain = model(ids).logits  # no cache given: transformers builds its own
    for _ in range(5):
        prefill_then_decode(model, ids, H2OCache(model, heavy=4, recent=4), prefill=12)
    assert hook_counts(model) == [(1, 1)] * 3
    for name, make in caches.items():
        assert torch.equal(prefill_then_decode(model, ids, make(), prefill=12), before[name]), name
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain)
    detach(model)
    assert hook_counts(model) == [(0, 0)] * 3
    H2OCache(model, heavy=4, recent=4)  # a new cache installs them again
    assert hook_counts(model) == [(1, 1)] * 3


def test_a_query_that_sees_only_hidden_keys_stays_finite_in_every_dtype():
    """A row whose keys are all hidden (a pad query of a padded batch) gets finite probabilities in
    float64 too, whose lowest logit would become ``-inf`` in the float32 softmax (``NaN`` out)."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(2, 4, 3, 8, generator=generator).to(dtype)
        keys = torch.randn(2, 2, 10, 8, generator=generator).to(dtype)
        key_mask = torch.ones(2, 2, 10, dtype=torch.bool)
        key_mask[1] = False  # the second row sees no key at all
        chunks = [probs for _, _, probs in attention_chunks(query, keys, 0.3, 7, key_mask)]
        one = query_probabilities(query[:, :, -1:], keys, 0.3, key_mask)
        for probs in (*chunks, one):
            assert torch.isfinite(probs).all(), dtype
        torch.testing.assert_close(one[0].sum(-1), torch.ones_like(one[0].sum(-1)))


def test_each_layer_reads_the_rotated_query_its_attention_is_given(monkeypatch):
    """The query a layer's policy reads is the one the model's attention runs on (taken from the
    model's own rotation, not computed again): at the prefill (the rows the policy reads) and at
    every decode step. Layers whose policy reads none (Gemma 3's sliding layers keep the model's
    window) receive none, so no layer is handed another's query."""
    model = tiny_gemma3()
    model.set_attn_implementation("eager")
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    given: dict[int, list[torch.Tensor]] = {}
    eager = modeling.eager_attention_forward

    def recording(module, query, *args, **kwargs):
        given.setdefault(module.layer_idx, []).append(query)
        return eager(module, query, *args, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", recording)
    cache = TOVACache(model, budget=6)
    received: dict[int, list[torch.Tensor]] = {}
    handed_over = cache.receive_query

    def receive(layer_idx, query, scaling):
        received.setdefault(layer_idx, []).append(query)
        handed_over(layer_idx, query, scaling)

    monkeypatch.setattr(cache, "receive_query", receive)
    prefill_then_decode(model, random_ids(1, 16), cache, prefill=12)
    sliding = {i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"}
    assert sliding and set(received) == set(given) - sliding
    for layer, queries in received.items():
        assert len(queries) == 5  # the prefill and four decode steps
        for query, attended in zip(queries, given[layer]):
            assert query.shape[-2] == 1 and torch.equal(query, attended[:, :, -1:])


def test_a_rotation_in_another_layout_is_refused_by_name():
    """A model that rotated its queries as ``[batch, tokens, heads, head_dim]`` would hand the
    policy queries it cannot read: the forward stops with the fix instead of scoring them."""
    model = tiny_llama()
    TOVACache(model, budget=6)  # installs the taps
    module = model.model.layers[0].self_attn
    heads = module.q_proj.out_features // module.head_dim
    tap = getattr(module, hooks.TAP_ATTRIBUTE)
    hooks.ROTATION.arm(tap, 1)
    with pytest.raises(ValueError, match=r"rotates queries shaped \(1, 5, %d, %d\).*use a policy that needs no attention" % (heads, module.head_dim)):
        hooks.ROTATION.receive(torch.zeros(1, 5, heads, module.head_dim))
    assert hooks.ROTATION.tap is None  # disarmed: the next layer's rotation goes nowhere
