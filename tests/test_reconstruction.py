"""KVzip's reconstruction scores against eager attention recomputed from scratch."""

from __future__ import annotations

import pytest
import torch
from tiny_models import char_tokenizer, random_ids, tiny_gemma3, tiny_llama, tiny_qwen3
from transformers import DynamicCache

from hf_kvpolicies import attention_scores
from hf_kvpolicies.attention_scores import max_attention
from hf_kvpolicies.reconstruction import (
    RepeatPrompt,
    answer_opening,
    check_reconstructable,
    reconstruction_scores,
)

PROMPT = RepeatPrompt.from_tokenizer(char_tokenizer())


@torch.no_grad()
def prefilled(model, ids, padding=None):
    """Per layer (keys, values) after one ordinary prefill, positions numbered as generate() does."""
    cache = DynamicCache(config=model.config)
    positions = None if padding is None else (padding.cumsum(-1) - 1).clamp(min=0)
    model(ids, attention_mask=padding, position_ids=positions, cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def repeat_prompts(ids: list[int], chunk: int) -> list[list[int]]:
    """The paper's reconstruction prompts, written out: instruction (plus, after the first chunk,
    the previous chunk's last 8 tokens), the answer opening, then the chunk itself."""
    prompts = []
    for start in range(0, len(ids), chunk):
        lead = list(PROMPT.first) if start == 0 else list(PROMPT.later) + ids[max(0, start - 8) : start]
        prompts.append(lead + list(PROMPT.suffix) + ids[start : start + chunk])
    return prompts


@torch.no_grad()
def reference_scores(eager_model, ids: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Context + each reconstruction prompt in one eager forward with output_attentions: the
    reconstruction rows' largest probability on each context column, over query heads of a KV head."""
    config = eager_model.config
    kv_heads, length = config.num_key_value_heads, ids.shape[1]
    groups = config.num_attention_heads // kv_heads
    best = None
    for prompt in repeat_prompts(ids[0].tolist(), chunk):
        full = torch.cat([ids, torch.tensor([prompt])], dim=1)
        attentions = eager_model(full, output_attentions=True).attentions
        scores = [a[:, :, length:, :length].amax(dim=2).view(1, kv_heads, groups, length).amax(dim=2) for a in attentions]
        best = scores if best is None else [torch.maximum(a, b) for a, b in zip(best, scores)]
    return best


def naive_max(query, keys, scaling, first_new, key_mask):
    """The whole query x key matrix at once, heads expanded: causal, masked softmax, max over queries and grouped heads."""
    batch, query_heads, length, _ = query.shape
    kv_heads, key_count = keys.shape[1], keys.shape[2]
    expanded = keys.repeat_interleave(query_heads // kv_heads, dim=1)
    logits = query @ expanded.transpose(-1, -2) * scaling
    hidden = torch.arange(key_count)[None, :] > (first_new + torch.arange(length))[:, None]
    hidden = hidden | ~key_mask.repeat_interleave(query_heads // kv_heads, dim=1)[:, :, None, :]
    probs = logits.masked_fill(hidden, float("-inf")).softmax(-1)
    return probs.amax(2).view(batch, kv_heads, -1, key_count).amax(2)


@pytest.mark.parametrize("chunk_elements", [10**9, 2 * 6 * 50 * 4, 1], ids=["whole", "4-queries", "1-query"])
def test_max_attention_equals_the_whole_matrix(chunk_elements):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 37, 8, generator=generator)
    keys = torch.randn(2, 3, 50, 8, generator=generator)  # 13 earlier keys, then the 37 new ones
    key_mask = torch.rand(2, 3, 50, generator=generator) > 0.2
    expected = naive_max(query, keys, 0.35, 13, key_mask)
    got = max_attention(query, keys, 0.35, 13, key_mask=key_mask, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert torch.equal(got[~key_mask], torch.zeros_like(got[~key_mask]))  # pads receive nothing
    step = max_attention(query[:, :, -1:], keys, 0.35, 49)  # one decode step sees every key
    torch.testing.assert_close(step, naive_max(query[:, :, -1:], keys, 0.35, 49, torch.ones_like(key_mask)))


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("chunk", [2048, 16], ids=["one-chunk", "three-chunks"])
def test_scores_equal_eager_attention_of_the_reconstruction(factory, chunk, monkeypatch, one_thread):
    model, eager = factory(), factory()
    eager.set_attn_implementation("eager")
    ids = random_ids(1, 40, seed=3)
    layers_kv = prefilled(model, ids)
    before = [(keys.clone(), values.clone()) for keys, values in layers_kv]
    monkeypatch.setattr(attention_scores, "SCORE_CHUNK_ELEMENTS", 4 * 60 * 5)  # 5 queries at a time
    scores = reconstruction_scores(model, layers_kv, ids, PROMPT, chunk=chunk)
    expected = reference_scores(eager, ids, chunk)
    assert len(scores) == len(expected) == model.config.num_hidden_layers
    for got, want in zip(scores, expected):
        assert got.shape == (1, model.config.num_key_value_heads, 40)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert not torch.equal(scores[0], scores[0].new_zeros(scores[0].shape))
    for (keys, values), (old_keys, old_values) in zip(layers_kv, before):  # the context is left as it was
        assert torch.equal(keys, old_keys) and torch.equal(values, old_values)


def test_padded_rows_score_as_they_would_alone(one_thread):
    model = tiny_llama()
    lengths = (40, 31, 22)
    rows = [random_ids(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    ids = torch.zeros(3, 40, dtype=torch.long)
    padding = torch.zeros(3, 40, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 40 - row.shape[1] :] = row[0]
        padding[i, 40 - row.shape[1] :] = 1
    batched = reconstruction_scores(model, prefilled(model, ids, padding), ids, PROMPT, padding=padding, chunk=16)
    for i, row in enumerate(rows):
        alone = reconstruction_scores(model, prefilled(model, row), row, PROMPT, chunk=16)
        pad = 40 - row.shape[1]
        for got, want in zip(batched, alone):
            torch.testing.assert_close(got[i : i + 1, :, pad:], want, atol=1e-5, rtol=1e-4)
            assert torch.equal(got[i, :, :pad], torch.zeros_like(got[i, :, :pad]))


def test_answer_opening_follows_the_chat_template():
    tokenizer = char_tokenizer()
    assert answer_opening(tokenizer) == "\n"
    tokenizer.chat_template = (
        "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    assert answer_opening(tokenizer) == "</u><a>"
    prompt = RepeatPrompt.from_tokenizer(tokenizer)
    assert tokenizer.decode(list(prompt.suffix)) == "</u><a>"
    assert tokenizer.decode(list(prompt.first)) == "\n\nRepeat the previous context exactly."


def test_a_context_opening_with_the_bos_is_replayed_without_it():
    """The BOS is no part of the text to repeat (kvpress skips the chat template's prefix, BOS included)."""
    prompt = RepeatPrompt.from_tokenizer(char_tokenizer(bos=True))
    assert prompt.start == (1,) and PROMPT.start == ()
    first, later, suffix = list(prompt.first), list(prompt.later), list(prompt.suffix)
    assert prompt.chunks([1, 10, 11, 12], chunk=2) == [first + suffix + [10, 11], later + [10, 11] + suffix + [12]]
    assert prompt.chunks([10, 11, 12], chunk=2) == [first + suffix + [10, 11], later + [10, 11] + suffix + [12]]
    assert PROMPT.chunks([1, 10], chunk=4) == [list(PROMPT.first) + list(PROMPT.suffix) + [1, 10]]


def test_models_with_sliding_window_layers_are_refused():
    with pytest.raises(ValueError, match=r"layers \[0, 1\] of gemma3_text are sliding-window layers"):
        check_reconstructable(tiny_gemma3())


def test_mismatched_context_is_refused():
    model = tiny_llama()
    ids = random_ids(1, 12)
    with pytest.raises(ValueError, match="context ids"):
        reconstruction_scores(model, prefilled(model, ids), ids[:, :10], PROMPT)


def test_attention_the_replay_does_not_compute_is_refused():
    model = tiny_llama()
    model.config.attn_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="adds logit soft-capping: use a policy that scores without a replay"):
        check_reconstructable(model)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_the_models_own_attention_is_back_after_the_replay_and_after_an_error(implementation, monkeypatch, one_thread):
    model = tiny_llama()
    model.set_attn_implementation(implementation)
    ids = random_ids(1, 20)
    before = model(ids).logits
    reconstruction_scores(model, prefilled(model, ids), ids, PROMPT)
    assert model.config._attn_implementation == implementation
    assert torch.equal(model(ids).logits, before)

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr("hf_kvpolicies.reconstruction.ReplayLayer.attend", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        reconstruction_scores(model, prefilled(model, ids), ids, PROMPT)
    assert model.config._attn_implementation == implementation
