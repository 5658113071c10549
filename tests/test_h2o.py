"""H2OCache against a naive H2O written from the paper's definition, plus budgets, batches, beams, padding, memory."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import forward_with_attentions, greedy, prefill_then_decode
from tiny_models import COMMON, random_ids, tiny_deepseek_v3, tiny_from_type, tiny_gemma3, tiny_llama, tiny_qwen3
from transformers import DynamicCache, Phi3Config, Phi3ForCausalLM

from hf_kvpolicies import FullCache, H2OCache, SlidingWindowCache, from_spec
from hf_kvpolicies.model_layout import layer_layouts


def peaked(model, factor: float = 50.0):
    """Sharpen every attention (scale its logits): a random tiny model attends almost uniformly,
    which makes the oldest tokens the heavy hitters; peaked attention makes them depend on content."""
    for layer in model.model.layers:
        layer.self_attn.scaling *= factor
    return model


def full_layers(model) -> list[int]:
    return [layout.index for layout in layer_layouts(model) if not layout.is_sliding]


@torch.no_grad()
def naive_h2o(model, ids: torch.Tensor, chunks: list[int], heavy: int, recent: int):
    """H2O from its definition: eager attention with ``output_attentions=True``, a score table over
    every absolute position, the kept set recomputed from it after each forward, and a
    ``DynamicCache`` whose full-attention layers are rebuilt from the kept positions.

    Returns the logits of every position and, after each forward, ``{layer: [batch, kv_heads, kept]}``
    kept positions (ascending).
    """
    batch, total = ids.shape
    kv_heads = model.config.num_key_value_heads
    groups = model.config.num_attention_heads // kv_heads
    cache = DynamicCache(config=model.config)
    layers = full_layers(model)
    scores = {i: torch.zeros(batch, kv_heads, total) for i in layers}
    kept = {i: torch.zeros(batch, kv_heads, total, dtype=torch.bool) for i in layers}
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    every_position = torch.arange(total).expand(batch, kv_heads, total)
    logits, kept_log, start = [], [], 0
    for length in chunks:
        stop = start + length
        columns = {i: every_position[kept[i]].view(batch, kv_heads, -1) for i in layers}  # what attention sees
        out = forward_with_attentions(model, ids, start, stop, cache)
        logits.append(out.logits)
        for i in layers:
            layer = cache.layers[i]
            new = (layer.keys[:, :, -length:], layer.values[:, :, -length:])
            history[i] = new if i not in history else tuple(torch.cat([h, n], 2) for h, n in zip(history[i], new))
            seen = torch.cat([columns[i], torch.arange(start, stop).expand(batch, kv_heads, length)], -1)
            weights = out.attentions[i].view(batch, kv_heads, groups, length, -1)
            scores[i].scatter_add_(-1, seen, weights.sum(dim=(2, 3)))
            kept[i][..., start:stop] = True
            excess = int(kept[i][0, 0].sum()) - (heavy + recent)
            if excess > 0:
                candidate = kept[i] & (every_position <= stop - 1 - recent)
                drop = scores[i].masked_fill(~candidate, float("inf")).topk(excess, largest=False).indices
                kept[i].scatter_(-1, drop, False)
            positions = every_position[kept[i]].view(batch, kv_heads, -1)
            index = positions.unsqueeze(-1).expand(-1, -1, -1, history[i][0].shape[-1])
            layer.keys, layer.values = (h.gather(2, index) for h in history[i])
        kept_log.append({i: every_position[kept[i]].view(batch, kv_heads, -1) for i in layers})
        start = stop
    return torch.cat(logits, 1), kept_log


@torch.no_grad()
def run_schedule(model, ids: torch.Tensor, chunks: list[int], cache, kept=lambda retention: retention.kept_positions()):
    """The same schedule through ``cache``; same return values as :func:`naive_h2o` (the test
    files of every scored policy drive their caches with it), each full layer's kept positions
    as ``kept(retention)`` gives them."""
    logits, kept_log, start = [], [], 0
    for length in chunks:
        logits.append(model(ids[:, start : start + length], cache=cache, use_cache=True).logits)
        kept_log.append({i: kept(cache.layers[i].retention) for i in full_layers(model)})
        start += length
    return torch.cat(logits, 1), kept_log


SCHEDULES = {
    "long prompt": [24] + [1] * 64,
    "short prompt fills then evicts": [5] + [1] * 64,
    "chunks, also after evictions": [16, 8, 1, 1, 1, 4] + [1] * 64,
}


MODELS = {"llama-gqa": tiny_llama, "gemma3-mqa": tiny_gemma3, "qwen3": tiny_qwen3}
CASES = [("llama-gqa", schedule) for schedule in SCHEDULES] + [
    ("gemma3-mqa", "chunks, also after evictions"),
    ("gemma3-mqa", "short prompt fills then evicts"),
    ("qwen3", "long prompt"),
]
HEAVY, RECENT = 6, 4


@functools.cache
def reference(model_name: str, schedule: str):
    model = peaked(MODELS[model_name]())
    model.set_attn_implementation("eager")
    chunks = SCHEDULES[schedule]
    return naive_h2o(model, random_ids(1, sum(chunks), seed=5), chunks, HEAVY, RECENT)


@pytest.mark.parametrize(
    "model_name, schedule, implementation",
    [(*case, "sdpa") for case in CASES] + [(*CASES[2], "eager"), (*CASES[4], "eager")],
)
def test_matches_naive_reference(model_name, schedule, implementation):
    """Kept positions per layer and head after every forward (64+ decode steps), and logits."""
    expected_logits, expected_kept = reference(model_name, schedule)
    model = peaked(MODELS[model_name]())
    model.set_attn_implementation(implementation)
    chunks = SCHEDULES[schedule]
    cache = H2OCache(model, heavy=HEAVY, recent=RECENT)
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache)
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        for layer in want:
            assert torch.equal(got[layer], want[layer]), f"forward {step}, layer {layer}"
    final = kept[-1][full_layers(model)[0]]
    assert final.shape[-1] == HEAVY + RECENT
    assert not (final[..., :HEAVY] == torch.arange(HEAVY)).all()  # heavy hitters are not merely the oldest
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3])
def test_budget_covering_everything_is_full_cache(make_model, implementation):
    model = make_model()
    model.set_attn_implementation(implementation)
    ids = random_ids(1, 48)
    expected = prefill_then_decode(model, ids, FullCache(model), prefill=16)
    got = prefill_then_decode(model, ids, H2OCache(model, heavy=40, recent=40), prefill=16)
    # static decode steps attend over the whole fixed buffer, unfilled slots masked: equal up to rounding
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_generate_with_both_argument_names():
    model = tiny_llama()
    prompt = random_ids(1, 10)
    expected = greedy(model, prompt, None, 24)
    assert torch.equal(greedy(model, prompt, H2OCache(model, heavy=40, recent=40), 24), expected)
    with pytest.warns(FutureWarning):
        legacy = model.generate(
            prompt, past_key_values=H2OCache(model, heavy=64, recent=64), max_new_tokens=24, do_sample=False
        )
    assert torch.equal(legacy, expected)


def test_no_heavy_hitters_is_a_sliding_window():
    model = tiny_llama()
    ids = random_ids(1, 60)
    expected = prefill_then_decode(model, ids, SlidingWindowCache(model, window=8), prefill=20)
    got = prefill_then_decode(model, ids, H2OCache(model, heavy=0, recent=8), prefill=20)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_batch_rows_are_independent():
    model = peaked(tiny_llama())
    ids = random_ids(2, 70, seed=9)
    chunks = [20] + [1] * 50
    together_logits, together_kept = run_schedule(model, ids, chunks, H2OCache(model, heavy=5, recent=3))
    for row in range(2):
        alone_logits, alone_kept = run_schedule(model, ids[row : row + 1], chunks, H2OCache(model, heavy=5, recent=3))
        torch.testing.assert_close(together_logits[row : row + 1], alone_logits, atol=1e-5, rtol=0)
        assert all(torch.equal(t[i][row : row + 1], a[i]) for t, a in zip(together_kept, alone_kept) for i in a)
    assert not torch.equal(together_kept[-1][0][0], together_kept[-1][0][1])  # rows really differ


def test_reorder_moves_scores_and_positions_with_the_keys():
    """Swapping the rows mid-stream (what beam search does) equals having run them swapped."""
    model = peaked(tiny_llama())
    ids = random_ids(2, 60, seed=4)
    swapped = ids.flip(0)
    cache = H2OCache(model, heavy=5, recent=3)
    with torch.no_grad():
        model(ids[:, :20], cache=cache)
        for t in range(20, 40):
            model(ids[:, t : t + 1], cache=cache)
        cache.reorder_cache(torch.tensor([1, 0]))
        logits = [model(swapped[:, t : t + 1], cache=cache).logits for t in range(40, 60)]
    expected = H2OCache(model, heavy=5, recent=3)
    expected_logits, expected_kept = run_schedule(model, swapped, [20] + [1] * 40, expected)
    torch.testing.assert_close(torch.cat(logits, 1), expected_logits[:, 40:], atol=1e-5, rtol=0)
    for layer, want in zip(cache.layers, expected.layers):
        assert torch.equal(layer.retention.kept_positions(), want.retention.kept_positions())
        torch.testing.assert_close(layer.retention.scores, want.retention.scores, atol=1e-5, rtol=0)


def test_beam_search():
    model = tiny_gemma3()
    ids = random_ids(1, 10, seed=3)
    expected = greedy(model, ids, FullCache(model), 16, num_beams=2)
    assert torch.equal(greedy(model, ids, H2OCache(model, heavy=30, recent=30), 16, num_beams=2), expected)
    cache = H2OCache(model, heavy=4, recent=4)
    out = greedy(model, ids, cache, 16, num_beams=2)
    assert out.shape == (1, 26)
    assert cache.layers[2].retention.kept_positions().shape == (2, 1, 8)  # both beams at the budget


def test_fractions_are_fixed_at_prefill():
    model = tiny_llama()
    cache = H2OCache(model, heavy=0.25, recent=0.25)
    prefill_then_decode(model, random_ids(1, 40), cache, prefill=24)
    assert cache.get_max_length() == 12 and cache.kept_tokens() == 12 and cache.get_seq_length() == 40
    cache.reset()  # a new prompt fixes the budget again
    prefill_then_decode(model, random_ids(1, 44), cache, prefill=40)
    assert cache.get_max_length() == 20 and cache.kept_tokens() == 20 and cache.get_seq_length() == 44
    cache = from_spec(model, "h2o:heavy=0.5,recent=3")
    assert (cache.heavy, cache.recent) == (0.5, 3)
    with pytest.raises(ValueError, match="at least 1 token"):
        prefill_then_decode(model, random_ids(1, 12), H2OCache(model, heavy=0.01, recent=0.01), prefill=12)


@pytest.mark.parametrize(
    "heavy, recent, message",
    [
        (-1, 4, "heavy must be"),
        (4, -2, "recent must be"),
        (0, 0, "at least 1 token"),
        (1.5, 4, r"\(0, 1\]"),
        (0.0, 4, r"\(0, 1\]"),
        (4, float("nan"), r"\(0, 1\]"),
        (True, 4, "heavy must be"),
        ("8", 4, "heavy must be"),
    ],
)
def test_bad_budgets(heavy, recent, message):
    with pytest.raises(ValueError, match=message):
        H2OCache(tiny_llama(), heavy=heavy, recent=recent)


def test_models_it_cannot_serve_fail_at_construction():
    model = tiny_llama()
    del model.model.layers[1].self_attn.q_proj
    with pytest.raises(ValueError, match="q_proj"):
        H2OCache(model, heavy=4, recent=4)
    fused = Phi3ForCausalLM(Phi3Config(**{**COMMON, "pad_token_id": 0})).eval()  # one qkv_proj
    with pytest.raises(ValueError, match="phi3"):
        H2OCache(fused, heavy=4, recent=4)
    with pytest.raises(ValueError, match="deepseek_v3.*q_proj"):  # latent attention: q_a_proj, q_b_proj
        H2OCache(tiny_deepseek_v3(), heavy=4, recent=4)
    softcapped = tiny_from_type("gemma2")
    with pytest.raises(ValueError, match="softcaps"):
        H2OCache(softcapped, heavy=4, recent=4)
    model = tiny_llama()
    cache = H2OCache(model, heavy=4, recent=4)
    model.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa"):
        model(random_ids(1, 4), cache=cache)


def test_memory_counts_scores_and_positions_and_is_constant():
    model = tiny_llama()  # 2 layers, 2 KV heads, head dim 16, fp32
    cache = H2OCache(model, heavy=6, recent=4)
    prefill_then_decode(model, random_ids(2, 30), cache, prefill=8)
    slots, batch, heads = 11, 2, 2
    # keys and values, each slot's position and score, each head's free slot, each row's first real
    # position, and the row and head indices of the storage's per-slot writes
    per_layer = 2 * batch * heads * 16 * slots * 4 + batch * heads * slots * (8 + 4) + batch * heads * 8 + batch * 8 + (batch + heads) * 8
    assert cache.get_memory_footprint() == 2 * per_layer
    prefill_then_decode(model, random_ids(2, 60), cache, prefill=1)
    assert cache.get_memory_footprint() == 2 * per_layer
    assert cache.kept_tokens() == 10 and cache.get_seq_length() == 90


def test_composes_with_fp8_storage():
    """H2O reaches its slots through the Storage API only, so another storage drops in."""
    model = tiny_llama()
    ids = random_ids(2, 60)
    native = H2OCache(model, heavy=8, recent=8)
    expected = prefill_then_decode(model, ids, native, prefill=30)
    fp8 = H2OCache(model, heavy=8, recent=8, storage="fp8:residual=0")
    got = prefill_then_decode(model, ids, fp8, prefill=30)
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0)
    assert fp8.get_memory_footprint() < native.get_memory_footprint() / 2
    assert fp8.kept_tokens() == native.kept_tokens() == 16
