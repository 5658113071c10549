"""A statistic that computes every query's attention probabilities (H2O, KVzip after its
reconstruction) hands attention's output to the model: the model's own kernel does not run, the
logits are the full cache's, and the model's configured implementation is back after the call."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded
from tiny_models import char_tokenizer, random_ids, tiny_gemma3, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from hf_kvpolicies import FullCache, H2OCache, KVzipCache, SnapKVCache
from hf_kvpolicies.hooks import SHARED_ATTENTION
from hf_kvpolicies.model_layout import layer_layouts


class KernelCalls(TorchDispatchMode):
    """Counts the calls of the model's attention kernels: sdpa's, or eager attention's softmax
    (``aten._softmax``, which the statistics' own softmax calls as well)."""

    def __init__(self) -> None:
        super().__init__()
        self.sdpa = self.softmax = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.sdpa += "scaled_dot_product" in name
        self.softmax += name == "aten._softmax"
        return func(*args, **(kwargs or {}))


def full_attention_layers(model) -> int:
    return sum(not layout.is_sliding for layout in layer_layouts(model))


@torch.no_grad()
def kernel_calls(model, ids: torch.Tensor, cache, **kwargs) -> tuple[KernelCalls, torch.Tensor]:
    with KernelCalls() as calls:
        logits = model(ids, cache=cache, **kwargs).logits
    return calls, logits


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3])
def test_a_scored_prefill_runs_no_sdpa_kernel_in_its_scored_layers(make_model):
    model = make_model()
    ids = random_ids(1, 40)
    full_calls, expected = kernel_calls(model, ids, FullCache(model))
    calls, got = kernel_calls(model, ids, H2OCache(model, heavy=8, recent=8))  # over budget: pending, then trimmed
    assert full_calls.sdpa == len(layer_layouts(model))
    assert calls.sdpa == full_calls.sdpa - full_attention_layers(model)  # a model's own sliding layers keep theirs
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_a_prompt_within_the_budget_and_a_later_chunk_share_too():
    model = tiny_llama()
    ids = random_ids(1, 50)
    cache, full = H2OCache(model, heavy=40, recent=40), FullCache(model)
    for start, stop in ((0, 20), (20, 30)):
        full_calls, expected = kernel_calls(model, ids[:, start:stop], full)
        calls, got = kernel_calls(model, ids[:, start:stop], cache)
        assert (calls.sdpa, full_calls.sdpa) == (0, 2)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_eager_attention_computes_one_softmax_per_layer_instead_of_two():
    model = tiny_llama()
    model.set_attn_implementation("eager")
    ids = random_ids(1, 40)
    full_calls, expected = kernel_calls(model, ids, FullCache(model))
    calls, got = kernel_calls(model, ids, H2OCache(model, heavy=8, recent=8, storage="native"))
    assert full_calls.softmax == 2  # the model's, per layer
    assert calls.softmax == 2  # the statistic's (one chunk per layer), which attention's output reuses
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert model.config._attn_implementation == "eager"


def test_decode_steps_and_statistics_of_the_last_queries_keep_the_models_attention():
    model = tiny_llama()
    ids = random_ids(1, 41)
    cache = H2OCache(model, heavy=8, recent=8)
    kernel_calls(model, ids[:, :40], cache)
    assert kernel_calls(model, ids[:, 40:], cache)[0].sdpa == 2  # one query: the static step's attention
    assert kernel_calls(model, ids[:, :40], SnapKVCache(model, budget=16, window=4))[0].sdpa == 2


def test_kvzip_shares_after_its_reconstruction_only():
    model = tiny_llama()
    ids = random_ids(1, 60)
    cache = KVzipCache(model, budget=10, recent=3, sinks=2, tokenizer=char_tokenizer())
    prompt_calls, _ = kernel_calls(model, ids[:, :30], cache)
    assert prompt_calls.sdpa == 2  # the prompt's forward is scored by the reconstruction that follows it
    calls, got = kernel_calls(model, ids[:, 30:40], cache)
    assert calls.sdpa == 0
    reference = KVzipCache(model, budget=10, recent=3, sinks=2, tokenizer=char_tokenizer())
    kernel_calls(model, ids[:, :30], reference)
    model.set_attn_implementation("eager")  # the same kept tokens, attended by eager attention
    expected = kernel_calls(model, ids[:, 30:40], reference)[1]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3])
def test_padded_rows_get_the_full_caches_prefill_logits(make_model):
    model = make_model()
    ids, mask = left_padded([random_ids(1, n, seed=n) for n in (30, 22, 27)])
    expected = model(ids, attention_mask=mask, cache=FullCache(model)).logits
    calls, got = kernel_calls(model, ids, H2OCache(model, heavy=6, recent=6), attention_mask=mask)
    assert calls.sdpa == len(layer_layouts(model)) - full_attention_layers(model)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)


def test_a_forward_that_fails_mid_layer_leaves_the_model_as_configured():
    model = tiny_llama()
    ids = random_ids(1, 40)
    failing = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(ids, cache=H2OCache(model, heavy=8, recent=8))
    failing.remove()
    assert model.config._attn_implementation == SHARED_ATTENTION  # swapped for layer 0, never called
    calls, got = kernel_calls(model, ids, None)  # the next forward, with the model's own cache
    assert model.config._attn_implementation == "sdpa" and calls.sdpa == 2
    torch.testing.assert_close(got, kernel_calls(model, ids, FullCache(model))[1], rtol=0, atol=0)


def test_a_causal_4d_mask_shares_and_a_mask_of_ones_own_keeps_the_models_attention():
    model = tiny_llama()
    ids = random_ids(1, 40)
    q = torch.arange(40)
    causal = (q[None, :] <= q[:, None]).view(1, 1, 40, 40)
    assert kernel_calls(model, ids, H2OCache(model, heavy=8, recent=8), attention_mask=causal)[0].sdpa == 0
    packed = causal & ((q[None, :] >= 20) == (q[:, None] >= 20))  # two sequences packed in one row
    full_calls, expected = kernel_calls(model, ids, FullCache(model), attention_mask=packed)
    calls, got = kernel_calls(model, ids, H2OCache(model, heavy=40, recent=40), attention_mask=packed)
    assert calls.sdpa == full_calls.sdpa == 2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_generate_shares_in_its_prefill():
    model = tiny_llama()
    ids, mask = left_padded([random_ids(1, n, seed=n) for n in (30, 24)])
    with KernelCalls() as calls:
        model.generate(ids, attention_mask=mask, cache=H2OCache(model, heavy=6, recent=6), max_new_tokens=1, do_sample=False)
    assert calls.sdpa == 0  # one new token: the prefill's logits give it
