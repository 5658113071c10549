"""Head-wise budgets (``head_budgets="adaptive"``): a layer's KV heads share ``heads x budget`` tokens.

The reference keeps the whole history in a ``DynamicCache`` and shows each query head only the
positions its KV head keeps, through a per-layer, per-head 4-D mask over absolute positions
(eager attention, ``output_attentions=True``): masking, as kvpress does, against which the
cache's pooled storage, which really frees the rest, must agree. The kept sets are recomputed
with plain Python from each paper's statistic (the rules of ``test_scored``, and H2O's) under the
documented pooled rules: a forward of several tokens (the first one always) keeps the protected
tokens of every head plus the best-ranked others of all heads together, ``heads x budget`` in
all; a decode step adds its token to every head and, beyond ``heads x budget``, evicts the
lowest-ranked tokens of any head. Ties keep the newest and evict the oldest, the lower head first.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import forward_with_attentions, generated_logits, greedy, left_padded, prefill_then_decode, real_positions
from test_h2o import SCHEDULES, full_layers, peaked, run_schedule
from test_kvzip import TOKENIZER, KVzipRule
from test_reconstruction import reference_scores
from test_scored import KNormRule, SnapKVRule, TOVARule, is_protected
from tiny_models import random_ids, tiny_gemma3, tiny_llama
from transformers import DynamicCache

from hf_kvpolicies import FullCache, H2OCache, KNormCache, KVzipCache, SnapKVCache, TOVACache, from_spec


class H2ORule:
    """Score: every attention received so far, summed over the group; the ``recent`` newest protected."""

    def __init__(self, heavy: int, recent: int):
        self.budget, self.protected = heavy + recent, recent

    def observe(self, state, attention, keys, values, start, stop):
        state["sum"] = state.get("sum", 0) + attention.sum(dim=(2, 3))

    def selection(self, state, stop, b, h, candidates):
        return {p: float(state["sum"][b, h, p]) for p in candidates}


@torch.no_grad()
def naive_pooled(model, ids: torch.Tensor, chunks: list[int], rule):
    """Logits of every position and, after each forward, ``{layer: per-head kept positions}``."""
    batch, total = ids.shape
    kv_heads = model.config.num_key_value_heads
    groups = model.config.num_attention_heads // kv_heads
    layers = full_layers(model)
    kept = {i: [[[] for _ in range(kv_heads)] for _ in range(batch)] for i in layers}
    state = {i: {} for i in layers}
    masks: dict[int, torch.Tensor] = {}

    def swap_mask(module, args, kwargs):
        if module.layer_idx in masks:
            kwargs["attention_mask"] = masks[module.layer_idx]
        return args, kwargs

    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(swap_mask, with_kwargs=True) for i in layers]
    cache = DynamicCache(config=model.config)
    logits, kept_log, start = [], [], 0
    try:
        for forward, length in enumerate(chunks):
            stop = start + length
            for i in layers:
                allowed = torch.zeros(batch, kv_heads, length, stop, dtype=torch.bool)
                for b in range(batch):
                    for h in range(kv_heads):
                        allowed[b, h, :, kept[i][b][h]] = True
                allowed[..., start:stop] |= torch.ones(length, length, dtype=torch.bool).tril()
                masks[i] = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
                masks[i] = masks[i].repeat_interleave(groups, dim=1)
            out = forward_with_attentions(model, ids, start, stop, cache)
            logits.append(out.logits)
            for i in layers:
                attention = torch.zeros(batch, kv_heads, groups, length, total)
                attention[..., :stop] = out.attentions[i].view(batch, kv_heads, groups, length, stop)
                keys = torch.zeros(batch, kv_heads, total, cache.layers[i].keys.shape[-1])
                keys[:, :, :stop] = cache.layers[i].keys
                values = torch.zeros(batch, kv_heads, total, cache.layers[i].values.shape[-1])
                values[:, :, :stop] = cache.layers[i].values
                rule.observe(state[i], attention, keys, values, start, stop)
                for b in range(batch):
                    kept[i][b] = pooled_keep(rule, state[i], kept[i][b], start, stop, b, trim=forward == 0 or length > 1)
            kept_log.append({i: kept[i] for i in layers})
            kept = {i: [[list(head) for head in row] for row in kept[i]] for i in layers}
            start = stop
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(logits, 1), kept_log


def pooled_keep(rule, state, before: list[list[int]], start: int, stop: int, b: int, trim: bool) -> list[list[int]]:
    heads = len(before)
    candidates = [before[h] + list(range(start, stop)) for h in range(heads)]
    total = sum(len(c) for c in candidates)
    if total <= heads * rule.budget:
        return candidates
    protected = {(h, p) for h in range(heads) for p in candidates[h] if is_protected(rule, p, stop)}
    ranked = [rule.selection(state, stop, b, h, candidates[h]) for h in range(heads)]
    others = [(h, p) for h in range(heads) for p in candidates[h] if (h, p) not in protected]
    if trim:
        best = sorted(others, key=lambda hp: (-ranked[hp[0]][hp[1]], -hp[1], hp[0]))[: heads * rule.budget - len(protected)]
        chosen = protected | set(best)
    else:
        victims = sorted(others, key=lambda hp: (ranked[hp[0]][hp[1]], hp[1], hp[0]))[: total - heads * rule.budget]
        chosen = {(h, p) for h in range(heads) for p in candidates[h]} - set(victims)
    return [sorted(p for g, p in chosen if g == h) for h in range(heads)]


def owned_positions(retention) -> list[list[list[int]]]:
    """Each row's and KV head's kept positions as lists (pooled heads pad their rows with -1)."""
    return [[[p for p in head.tolist() if p >= 0] for head in row] for row in retention.kept_positions()]


MODELS = {
    "llama-gqa": tiny_llama,
    "llama-4kv": functools.partial(tiny_llama, num_attention_heads=8, num_key_value_heads=4),
    "gemma3-mqa": tiny_gemma3,
}
POLICIES = {  # the cache (keywords such as storage= passed on), and its reference rule
    "h2o": (lambda m, **kw: H2OCache(m, heavy=6, recent=4, head_budgets="adaptive", **kw), lambda: H2ORule(6, 4)),
    "snapkv": (
        lambda m, **kw: SnapKVCache(m, budget=10, window=4, kernel=3, head_budgets="adaptive", **kw),
        lambda: SnapKVRule(10, 4, 3),
    ),
    "tova": (lambda m, **kw: TOVACache(m, budget=8, head_budgets="adaptive", **kw), lambda: TOVARule(8)),
    "knorm": (lambda m, **kw: KNormCache(m, budget=10, recent=3, head_budgets="adaptive", **kw), lambda: KNormRule(10, 3)),
}
CASES = [
    ("h2o", "llama-4kv", "long prompt"),
    ("h2o", "llama-4kv", "chunks, also after evictions"),
    ("snapkv", "llama-4kv", "long prompt"),
    ("snapkv", "llama-gqa", "chunks, also after evictions"),
    ("tova", "llama-gqa", "short prompt fills then evicts"),
    ("tova", "gemma3-mqa", "long prompt"),
    ("knorm", "llama-4kv", "long prompt"),
    ("knorm", "llama-gqa", "chunks, also after evictions"),
]


@functools.cache
def reference(policy: str, model_name: str, schedule: str):
    model = peaked(MODELS[model_name](), factor=8.0)
    model.set_attn_implementation("eager")
    chunks = SCHEDULES[schedule]
    return naive_pooled(model, random_ids(1, sum(chunks), seed=5), chunks, POLICIES[policy][1]())


@pytest.mark.parametrize("policy, model_name, schedule", CASES)
def test_matches_naive_masked_reference(policy, model_name, schedule, one_thread):
    """Kept positions per layer and KV head after every forward (64+ decode steps), and logits."""
    expected_logits, expected_kept = reference(policy, model_name, schedule)
    model = peaked(MODELS[model_name](), factor=8.0)
    chunks = SCHEDULES[schedule]
    cache = POLICIES[policy][0](model)
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache, owned_positions)
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        assert got == want, f"forward {step}"
    heads = model.config.num_key_value_heads
    final = kept[-1][full_layers(model)[0]][0]
    budget = cache.layers[full_layers(model)[0]].retention.budget
    assert sum(len(head) for head in final) == heads * budget
    if heads > 1:  # the heads really share: some head keeps more than the uniform budget somewhere
        assert any(len(head) != budget for step in kept for layer in step.values() for head in layer[0])
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


def test_storage_is_pooled_and_bytes_are_the_budget(one_thread):
    """One storage row of heads x (budget + 1) slots per layer: the bytes of uniform head budgets."""
    model = tiny_llama()
    ids = random_ids(2, 40, seed=3)
    pooled = H2OCache(model, heavy=6, recent=4, head_budgets="adaptive")
    uniform = H2OCache(model, heavy=6, recent=4)
    model.generate(ids, cache=pooled, max_new_tokens=8, do_sample=False)
    model.generate(ids, cache=uniform, max_new_tokens=8, do_sample=False)
    for layer_p, layer_u in zip(pooled.layers, uniform.layers):
        assert layer_p.storage.keys.shape == (2, 1, 2 * 11, 16)
        assert layer_u.storage.keys.shape == (2, 2, 11, 16)
        assert layer_p.storage.keys.nbytes == layer_u.storage.keys.nbytes  # (their row and head indices differ)
        assert layer_p.storage.values.nbytes == layer_u.storage.values.nbytes
        assert layer_p.retention.kept == layer_u.retention.kept == 10
        assert layer_p.retention.held_slots == 20
    from eval.memory import held_bytes

    assert held_bytes(pooled) == held_bytes(uniform) == 2 * 2 * 20 * 2 * 16 * 4


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "make_cache",
    [
        lambda m: H2OCache(m, heavy=40, recent=40, head_budgets="adaptive"),
        lambda m: SnapKVCache(m, budget=80, window=8, head_budgets="adaptive"),
        lambda m: KNormCache(m, budget=80, recent=8, head_budgets="adaptive"),
    ],
    ids=["h2o", "snapkv", "knorm"],
)
def test_budget_covering_everything_is_full_cache(make_cache, implementation, one_thread):
    model = tiny_llama()
    model.set_attn_implementation(implementation)
    ids = random_ids(1, 30, seed=2)
    logits = []
    for cache in (make_cache(model), FullCache(model)):
        out = model.generate(ids, cache=cache, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
        logits.append(torch.stack(out.logits))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_left_padded_batch_equals_each_row_alone(name, implementation, one_thread):
    """Rows of 20, 13 and 6 tokens (budget 8 to 10 per head: trimmed, trimmed, filling), 40 generated
    tokens: logits and the positions every head keeps (shifted by the row's padding) as if alone."""
    model = peaked(tiny_llama(), factor=8.0)
    model.set_attn_implementation(implementation)
    rows = [random_ids(1, n, seed=s) for n, s in [(20, 1), (13, 2), (6, 3)]]
    ids, mask = left_padded(rows)
    together = POLICIES[name][0](model)
    logits = generated_logits(model, ids, together, 40, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = POLICIES[name][0](model)
        torch.testing.assert_close(logits[i : i + 1], generated_logits(model, row, alone, 40), atol=1e-5, rtol=0)
        assert real_positions(together, i, ids.shape[1] - row.shape[1]) == real_positions(alone, 0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_beams_and_fp8_storage(name, one_thread):
    """Beams reorder the pooled rows; fp8 keeps what native keeps (key norms exactly in the first
    layer, whose keys no attention precedes; attention sees fp8-rounded keys, prompt included, so
    later layers' keys and the attention statistics differ a little and near-ties may go the
    other way, more often when every head of a layer competes)."""
    model = peaked(tiny_llama(), factor=8.0)
    ids = random_ids(1, 30, seed=4)
    cache = POLICIES[name][0](model)
    assert greedy(model, ids, cache, 12, num_beams=3).shape == (1, 42)
    assert cache.layers[0].retention.positions.shape[0] == 3
    long = random_ids(2, 60, seed=7)
    native, fp8 = POLICIES[name][0](model), POLICIES[name][0](model, storage="fp8:residual=0")
    prefill_then_decode(model, long, native, prefill=30)
    prefill_then_decode(model, long, fp8, prefill=30)
    for row in range(2):
        mine, theirs = real_positions(native, row), real_positions(fp8, row)
        if name == "knorm":
            assert mine[0] == theirs[0]
        kept = sum(len(head) for layer in mine for head in layer)
        shared = sum(len(set(x) & set(y)) for a, b in zip(mine, theirs) for x, y in zip(a, b))
        assert shared >= 0.55 * kept  # measured 0.60-1.0; a random choice of 10 in 60 shares about 0.17
    assert fp8.get_memory_footprint() < native.get_memory_footprint()


@functools.cache
def kvzip_reference(model_name: str, schedule: str):
    model = peaked(MODELS[model_name](), factor=8.0)
    model.set_attn_implementation("eager")
    chunks = SCHEDULES[schedule]
    ids = random_ids(1, sum(chunks), seed=5)
    rule = KVzipRule(10, 3, reference_scores(model, ids[:, : chunks[0]], 2048), sinks=2)
    return naive_pooled(model, ids, chunks, rule)


@pytest.mark.parametrize(
    "model_name, schedule",
    [("llama-4kv", "long prompt"), ("llama-gqa", "chunks, also after evictions"), ("llama-gqa", "short prompt fills then evicts")],
)
def test_kvzip_pools_heads_by_default_and_matches_the_masked_reference(model_name, schedule, one_thread):
    expected_logits, expected_kept = kvzip_reference(model_name, schedule)
    model = peaked(MODELS[model_name](), factor=8.0)
    chunks = SCHEDULES[schedule]
    cache = KVzipCache(model, budget=10, recent=3, sinks=2, layer_budgets="uniform", tokenizer=TOKENIZER)
    assert cache.head_budgets == "adaptive"
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache, owned_positions)
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        assert got == want, f"forward {step}"
    assert any(len(head) != 10 for layer in kept[0].values() for head in layer[0])
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


def test_kvzip_adaptive_layers_and_heads_keep_the_best_of_every_layer_and_head(one_thread):
    """Batch of one: each layer keeps the reconstruction scores that rank best among all layers' and
    heads' (the prompt's last tokens competing too), and its storage holds just those (plus a free slot
    per head; each layer's reserve of ``recent`` per head, room for decoded tokens, holds its next best)."""
    model = peaked(tiny_llama(num_hidden_layers=4), factor=8.0)
    ids = random_ids(1, 40, seed=5)
    cache = KVzipCache(model, budget=10, recent=3, sinks=2, tokenizer=TOKENIZER)
    with torch.no_grad():
        model(ids, cache=cache)
    reference = peaked(tiny_llama(num_hidden_layers=4), factor=8.0)
    reference.set_attn_implementation("eager")
    scores = torch.stack([s[0] for s in reference_scores(reference, ids, 2048)])  # [layer, head, token]
    scores[..., :2] = float("inf")  # the sinks win first in every layer and head
    best = scores.flatten().topk(4 * 2 * (10 - 3)).indices
    budgets = cache.layer_budget_sizes()
    assert sum(budgets) == 40 and len(set(budgets)) > 1
    for index, layer in enumerate(cache.layers):
        want = []
        for head in range(2):
            want.append([int(i) % 40 for i in best if int(i) // 80 == index and int(i) % 80 // 40 == head])
        got = [[p for p in head.tolist() if p >= 0] for head in layer.retention.kept_positions()[0]]
        # the layer's share is rounded to whole tokens per head: at most a head's worth differs
        assert sum(len(h) for h in got) == 2 * budgets[index] and layer.storage.capacity == 2 * (budgets[index] + 1)
        missing = sum(len(set(w) - set(g)) for w, g in zip(want, got))
        assert missing <= 1, (index, got, want)


def test_iteration_yields_each_heads_tokens(one_thread):
    model = tiny_llama()
    cache = TOVACache(model, budget=8, head_budgets="adaptive")
    model.generate(random_ids(1, 20, seed=1), cache=cache, max_new_tokens=4, do_sample=False)
    for (keys, values, _), layer in zip(cache, cache.layers):  # heads keep their own counts, 16 in all
        kept = (layer.retention.kept_positions() >= 0).sum(dim=-1)
        assert kept.sum() == 16 and keys.shape == values.shape == (1, 2, int(kept.max()), 16)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda m: H2OCache(m, heavy=4, recent=4, head_budgets="pooled"), "head_budgets='uniform' or 'adaptive'"),
        (lambda m: SnapKVCache(m, budget=8, window=4, head_budgets=None), "head_budgets"),
    ],
)
def test_bad_head_budgets_fail_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make(tiny_llama())


def test_attention_without_per_head_masks_is_refused():
    model = tiny_llama()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="per-head attention mask"):
        KNormCache(model, budget=8, recent=2, head_budgets="adaptive")
    KNormCache(model, budget=8, recent=2)  # uniform head budgets take any attention


def test_spec():
    cache = from_spec(tiny_llama(), "h2o:heavy=4,recent=4,head_budgets=adaptive")
    assert cache.head_budgets == "adaptive" and cache.layers[0].retention.layout.pooled
