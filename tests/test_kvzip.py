"""KVzipCache against a naive KVzip written from the paper's definition, plus budgets, padding, beams, memory."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import greedy, prefill_then_decode, real_positions
from test_h2o import SCHEDULES, peaked, run_schedule
from test_reconstruction import reference_scores
from test_scored import naive_eviction
from tiny_models import char_tokenizer, random_ids, save_tiny_model, tiny_gemma3, tiny_llama, tiny_qwen3

from hf_kvpolicies import FullCache, KVzipCache, from_spec
from hf_kvpolicies.retention.layer_budgets import adaptive_budgets, busiest_head_budgets

TOKENIZER = char_tokenizer()
BUDGET, RECENT, SINKS = 10, 3, 2


class KVzipRule:
    """For :func:`test_scored.naive_eviction`: the first forward's tokens carry their reconstruction
    scores (``reconstruction[layer]``, from eager attention in :func:`reference_scores`); after
    that a token's score is the largest attention any later query gave it; of the tokens after the
    prompt, the ``recent`` newest are protected (``protected_from``), and so are the first ``sinks``
    tokens. ``naive_eviction`` observes the layers in order, so the first forward's calls take the
    layers' scores one after the other."""

    def __init__(self, budget: int, recent: int, reconstruction: list[torch.Tensor], sinks: int = 0):
        self.budget, self.protected, self.sinks = budget, recent, sinks
        self.first = iter(reconstruction)
        self.protected_from = 0

    def observe(self, state, attention, keys, values, start, stop):
        if start == 0:
            self.protected_from = stop  # the prompt's tokens are ranked by their reconstruction alone
            scores = next(self.first)
            state["score"] = torch.zeros(*scores.shape[:2], attention.shape[-1])
            state["score"][..., :stop] = scores
        else:
            state["score"] = torch.maximum(state["score"], attention.amax(dim=(2, 3)))

    def score(self, state, stop):
        return state["score"]

    def selection(self, state, stop, b, h, candidates):
        return {p: float(state["score"][b, h, p]) for p in candidates}


SCHEDULES = {**SCHEDULES, "prompt of budget + 1 evicts by reconstruction": [BUDGET + 1] + [1] * 64}
MODELS = {
    "llama-gqa": tiny_llama,
    "llama-mqa": functools.partial(tiny_llama, num_key_value_heads=1),
    "qwen3": tiny_qwen3,
}
CASES = [
    ("llama-gqa", "long prompt", 2048, SINKS),
    ("llama-gqa", "long prompt", 2048, 0),
    ("llama-gqa", "long prompt", 10, SINKS),  # the prompt reconstructed in three chunks
    ("llama-gqa", "short prompt fills then evicts", 2048, SINKS),
    ("llama-gqa", "prompt of budget + 1 evicts by reconstruction", 2048, SINKS),
    ("llama-gqa", "chunks, also after evictions", 2048, SINKS),
    ("llama-mqa", "chunks, also after evictions", 2048, SINKS),
    ("qwen3", "long prompt", 2048, SINKS),
]


@functools.cache
def reference(model_name: str, schedule: str, chunk: int, sinks: int):
    model = peaked(MODELS[model_name](), factor=8.0)
    model.set_attn_implementation("eager")
    chunks = SCHEDULES[schedule]
    ids = random_ids(1, sum(chunks), seed=5)
    reconstruction = reference_scores(model, ids[:, : chunks[0]], chunk)
    return naive_eviction(model, ids, chunks, KVzipRule(BUDGET, RECENT, reconstruction, sinks))


@pytest.mark.parametrize("model_name, schedule, chunk, sinks", CASES)
def test_matches_naive_reference(model_name, schedule, chunk, sinks, one_thread):
    """Kept positions per layer and KV head after every forward (64+ decode steps), and logits."""
    expected_logits, expected_kept = reference(model_name, schedule, chunk, sinks)
    model = peaked(MODELS[model_name](), factor=8.0)
    chunks = SCHEDULES[schedule]
    cache = KVzipCache(
        model, budget=BUDGET, recent=RECENT, sinks=sinks, layer_budgets="uniform", head_budgets="uniform", replay_chunk=chunk, tokenizer=TOKENIZER
    )
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache)
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        for layer in want:
            assert torch.equal(got[layer], want[layer]), f"forward {step}, layer {layer}"
    final = kept[-1][0]
    assert final.shape[-1] == BUDGET
    assert not torch.equal(final, torch.arange(sum(chunks) - BUDGET, sum(chunks)).expand_as(final))  # not a window
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


def test_adaptive_budgets_share_the_total_and_keep_the_best_reconstructed(one_thread):
    model = peaked(tiny_llama(num_hidden_layers=4), factor=8.0)
    ids = random_ids(1, 40, seed=5)
    cache = KVzipCache(
        model, budget=BUDGET, recent=RECENT, sinks=SINKS, layer_budgets="adaptive", head_budgets="uniform", tokenizer=TOKENIZER
    )
    with torch.no_grad():
        model(ids, cache=cache)
    budgets = cache.layer_budget_sizes()
    assert sum(budgets) == 4 * BUDGET and len(set(budgets)) > 1
    reference = peaked(tiny_llama(num_hidden_layers=4), factor=8.0)  # the same weights, eager
    reference.set_attn_implementation("eager")
    scores = reference_scores(reference, ids, 2048)
    for layer, budget, score in zip(cache.layers, budgets, scores):
        score[..., :SINKS] = float("inf")  # the sinks first, then the best; the prompt's last tokens compete too
        expected = score.topk(budget, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.retention.kept_positions(), expected)
        assert layer.storage.capacity == budget + 1  # each layer's storage is sized to its own budget


def test_busiest_head_budgets_by_hand():
    one_head_layer = torch.tensor([[[0.9, 0.8, 0.7, 0.6], [0.0, 0.0, 0.0, 0.0]]])  # [row, head, token]
    spread_layer = torch.tensor([[[0.5, 0.4, 0.05, 0.05], [0.45, 0.35, 0.05, 0.05]]])
    # the best 4 x 2 scores: layer 0's first head wins 4, layer 1's heads 2 each -> shares 4 : 2 of 4 spare
    assert busiest_head_budgets([one_head_layer, spread_layer], reserve=[1, 1], total=6) == [4, 2]
    # pooled heads keep what they won: layer 0's 4 + 0 and layer 1's 2 + 2 are 2 per head each, plus the reserve
    assert busiest_head_budgets([one_head_layer, spread_layer], reserve=[1, 1], total=6, pooled=True) == [3, 3]
    assert adaptive_budgets([one_head_layer, spread_layer], reserve=[1, 1], total=6) == [3, 3]  # normalised sums
    protected = one_head_layer.clone()
    protected[..., -1] = float("-inf")  # protected tokens and pads never compete, even with room to spare
    assert busiest_head_budgets([protected, spread_layer], reserve=[1, 1], total=20) == [4, 4]


@pytest.mark.parametrize("layer_budgets", ["uniform", "adaptive"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_budget_covering_everything_is_full_cache(make_model, layer_budgets, one_thread):
    model = make_model()
    ids = random_ids(1, 48)
    expected = prefill_then_decode(model, ids, FullCache(model), prefill=16)
    cache = KVzipCache(model, budget=80, recent=8, layer_budgets=layer_budgets, tokenizer=TOKENIZER)
    # uniform budgets take static decode steps (the whole fixed buffer, unfilled slots masked): equal up to rounding
    torch.testing.assert_close(prefill_then_decode(model, ids, cache, prefill=16), expected, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 48 and cache.kept_tokens() == 48


def test_memory_is_the_budget_and_the_reconstruction_is_not_kept(one_thread):
    model = tiny_llama()  # 2 layers, 2 KV heads, head dim 16, fp32
    cache = KVzipCache(model, budget=BUDGET, recent=RECENT, layer_budgets="uniform", head_budgets="uniform", tokenizer=TOKENIZER)
    with torch.no_grad():
        model(random_ids(2, 120), cache=cache)
    slots, batch, heads = BUDGET + 1, 2, 2
    # keys and values, each slot's position and score, each head's free slot, each row's first real
    # position, and the row and head indices of the storage's per-slot writes
    per_layer = 2 * batch * heads * 16 * slots * 4 + batch * heads * slots * (8 + 4) + batch * heads * 8 + batch * 8 + (batch + heads) * 8
    assert cache.get_memory_footprint() == 2 * per_layer
    assert all(layer.retention.pending is None for layer in cache.layers)  # the 120-token prompt is freed
    assert cache.get_seq_length() == 120 and cache.kept_tokens() == BUDGET  # no reconstruction token counted
    prefill_then_decode(model, random_ids(2, 40), cache, prefill=1)
    assert cache.get_memory_footprint() == 2 * per_layer and cache.get_seq_length() == 160


@pytest.mark.parametrize("head_budgets", ["uniform", "adaptive"])
def test_left_padded_rows_keep_what_they_keep_alone(head_budgets, one_thread):
    model = peaked(tiny_llama(), factor=8.0)
    lengths = (30, 21, 14)
    rows = [random_ids(1, n, seed=20 + i) for i, n in enumerate(lengths)]
    ids = torch.zeros(3, 30, dtype=torch.long)
    mask = torch.zeros(3, 30, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 30 - row.shape[1] :], mask[i, 30 - row.shape[1] :] = row[0], 1
    def make() -> KVzipCache:
        return KVzipCache(model, budget=BUDGET, recent=RECENT, tokenizer=TOKENIZER, layer_budgets="uniform", head_budgets=head_budgets)

    cache = make()
    together = greedy(model, ids, cache, 20, attention_mask=mask, min_new_tokens=20)
    for i, row in enumerate(rows):
        alone_cache = make()
        alone = greedy(model, row, alone_cache, 20, min_new_tokens=20)
        assert torch.equal(together[i, 30:], alone[0, row.shape[1] :]), f"row {i}"
        assert real_positions(cache, i, 30 - row.shape[1]) == real_positions(alone_cache, 0)


def test_beam_search_and_fp8_storage(one_thread):
    model = tiny_llama()
    ids = random_ids(1, 30, seed=3)
    expected = greedy(model, ids, FullCache(model), 12, num_beams=2)
    assert torch.equal(greedy(model, ids, KVzipCache(model, budget=64, tokenizer=TOKENIZER), 12, num_beams=2), expected)
    cache = KVzipCache(model, budget=BUDGET, recent=RECENT, tokenizer=TOKENIZER, head_budgets="uniform")
    assert greedy(model, ids, cache, 12, num_beams=2).shape == (1, 42)
    assert cache.layers[0].retention.kept_positions().shape == (2, 2, cache.layer_budget_sizes()[0])
    pooled = KVzipCache(model, budget=BUDGET, recent=RECENT, tokenizer=TOKENIZER)
    assert greedy(model, ids, pooled, 12, num_beams=2).shape == (1, 42)
    assert pooled.layers[0].retention.positions.shape[0] == 2
    native = KVzipCache(model, budget=BUDGET, recent=RECENT, tokenizer=TOKENIZER)
    fp8 = KVzipCache(model, budget=BUDGET, recent=RECENT, tokenizer=TOKENIZER, storage="fp8:residual=0")
    with torch.no_grad():
        model(ids, cache=native), model(ids, cache=fp8)
    for a, b in zip(native.layers, fp8.layers):  # the prompt is scored on the model's own keys (heads pooled)
        assert torch.equal(a.retention.kept_positions(), b.retention.kept_positions())
    assert fp8.get_memory_footprint() < native.get_memory_footprint()


def test_spec_finds_the_saved_tokenizer(tmp_path, one_thread):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path)).eval()
    cache = from_spec(model, "kvzip:budget=12,recent=2,layer_budgets=pyramid,replay_chunk=16")
    assert cache.prompt.first == KVzipCache(model, tokenizer=TOKENIZER).prompt.first
    assert KVzipCache.budget_parameters(64) == {"budget": 64, "recent": 8, "sinks": 4}
    assert KVzipCache.budget_parameters(8) == {"budget": 8, "recent": 4, "sinks": 2}
    assert all(KVzipCache(model, **KVzipCache.budget_parameters(b), tokenizer=TOKENIZER) for b in range(1, 12))
    prefill_then_decode(model, random_ids(1, 40), cache, prefill=30)
    assert cache.layer_budget_sizes() != [12, 12] and sum(cache.layer_budget_sizes()) == 24


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": 0}, "budget must be"),
        ({"budget": 8, "recent": 8, "sinks": 0}, "recent=8 plus sinks=0 must be below budget=8"),
        ({"budget": 8, "recent": 4, "sinks": 4}, "recent=4 plus sinks=4 must be below budget=8: .*lower recent or sinks"),
        ({"recent": -1}, "recent must be"),
        ({"sinks": -1}, "sinks must be"),
        ({"replay_chunk": 0}, "replay_chunk must be"),
        ({"chunk": 0}, "chunk must be"),
        ({"layer_budgets": "even"}, "layer_budgets"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVzipCache(tiny_llama(), **{"tokenizer": TOKENIZER, **kwargs})


def test_what_it_cannot_serve_fails_clearly():
    with pytest.raises(ValueError, match="sliding-window layers"):
        KVzipCache(tiny_gemma3(), tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match="pass tokenizer="):
        KVzipCache(tiny_llama())  # built from a config: no tokenizer saved beside it
    model = tiny_llama()
    cache = KVzipCache(model, budget=8, recent=2, tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match="input_ids, not inputs_embeds"):
        model(inputs_embeds=model.model.embed_tokens(random_ids(1, 12)), cache=cache)


def test_reset_reconstructs_the_next_prompt(one_thread):
    model = peaked(tiny_llama(), factor=8.0)
    first, second = random_ids(1, 30, seed=1), random_ids(1, 34, seed=2)
    cache = KVzipCache(model, budget=BUDGET, recent=RECENT, tokenizer=TOKENIZER)
    fresh = KVzipCache(model, budget=BUDGET, recent=RECENT, tokenizer=TOKENIZER)
    prefill_then_decode(model, first, cache, prefill=20)
    cache.reset()
    got = prefill_then_decode(model, second, cache, prefill=24)
    expected = prefill_then_decode(model, second, fresh, prefill=24)
    assert torch.equal(got, expected)
    for a, b in zip(cache.layers, fresh.layers):
        assert torch.equal(a.retention.kept_positions(), b.retention.kept_positions())


@pytest.mark.parametrize("head_budgets", ["uniform", "adaptive"])
def test_sinks_stay_in_every_head_where_their_scores_alone_would_evict_them(head_budgets, one_thread):
    """Each head keeps the first ``sinks`` tokens through the trim and 40 decode steps; without
    sinks, some head evicts one of them (so the rule is what keeps them)."""
    model = peaked(tiny_llama(), factor=8.0)
    ids = random_ids(1, 80, seed=5)

    def kept_sinks(sinks: int) -> list[bool]:
        cache = KVzipCache(model, budget=BUDGET, recent=RECENT, sinks=sinks, head_budgets=head_budgets, tokenizer=TOKENIZER)
        prefill_then_decode(model, ids, cache, prefill=40)
        assert cache.get_seq_length() == 80
        return [set(range(SINKS)) <= set(head.tolist()) for layer in cache.layers for head in layer.retention.kept_positions()[0]]

    assert all(kept_sinks(SINKS))
    assert not all(kept_sinks(0))


def test_a_tokenizer_that_is_none_is_refused_naming_the_fix(tmp_path):
    model = tiny_llama()
    with pytest.raises(ValueError, match="none loads from tokenizer='notatok'.*Hub id or local folder"):
        KVzipCache(model, budget=16, tokenizer="notatok")
    with pytest.raises(ValueError, match="not int: pass tokenizer="):
        KVzipCache(model, budget=16, tokenizer=3)
    TOKENIZER.save_pretrained(tmp_path)
    assert KVzipCache(model, budget=16, tokenizer=str(tmp_path)).prompt == KVzipCache(model, budget=16, tokenizer=TOKENIZER).prompt
