"""SnapKV, TOVA and key-norm caches against naive references written from the papers' definitions.

Each reference runs eager attention with ``output_attentions=True`` on a ``DynamicCache`` whose
layers are rebuilt from the kept positions after every forward, keeps a table over absolute
positions, and recomputes the kept set from scratch with plain Python per (row, KV head). The
rules the references encode, beyond each paper's statistic, are the documented ones of the
shared mechanism: a forward whose tokens fit in ``budget + 1`` slots evicts (at most) one token
by the raw statistic, a larger one trims by the selection scores; the ``protected`` newest
positions always stay; ties evict the oldest and keep the newest.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers import forward_with_attentions, generated_logits, greedy, left_padded, prefill_then_decode
from test_h2o import SCHEDULES, full_layers, peaked, run_schedule
from tiny_models import QUERY_ARCHITECTURES, random_ids, tiny_deepseek_v3, tiny_from_type, tiny_gemma3, tiny_llama
from transformers import DynamicCache

from hf_kvpolicies import FullCache, H2OCache, KNormCache, SnapKVCache, TOVACache, available_policies, from_spec


class SnapKVRule:
    """Score: attention from the last ``window`` queries (summed over the group); trim: that
    score max- or avg-pooled over the kept tokens in position order, the window left out."""

    def __init__(self, budget: int, window: int, kernel: int, pooling: str = "max"):
        self.budget, self.window, self.kernel, self.pooling = budget, window, kernel, pooling
        self.protected = window

    def observe(self, state, attention, keys, values, start, stop):
        state.setdefault("rows", {})
        for i, query in enumerate(range(start, stop)):
            state["rows"][query] = attention[:, :, :, i].sum(2)  # [batch, kv_heads, total]

    def selection(self, state, stop, b, h, candidates):
        raw = torch.stack([state["rows"][q] for q in range(max(0, stop - self.window), stop)]).sum(0)[b, h]
        inside = [p for p in candidates if p <= stop - 1 - self.window]
        values = {p: float(raw[p]) for p in inside}
        order = sorted(candidates)
        pooled = {}
        half = self.kernel // 2
        for j, p in enumerate(order):
            around = [values.get(order[k]) for k in range(j - half, j + half + 1) if 0 <= k < len(order)]
            if self.pooling == "max":
                pooled[p] = max((v for v in around if v is not None), default=float("-inf"))
            else:
                pooled[p] = sum(v for v in around if v is not None) / self.kernel
        return pooled


class TOVARule:
    """Score: the latest query's attention, averaged over the group; nothing protected."""

    def __init__(self, budget: int):
        self.budget, self.protected = budget, 0

    def observe(self, state, attention, keys, values, start, stop):
        state["last"] = attention[:, :, :, -1].mean(2)

    def selection(self, state, stop, b, h, candidates):
        return {p: float(state["last"][b, h, p]) for p in candidates}


class KNormRule:
    """Score: 1 / ||key|| (lower norm stays) to 12 significant bits, so that copies of one token
    tie exactly whatever fp32 noise their norms carry; the ``recent`` newest protected."""

    def __init__(self, budget: int, recent: int):
        self.budget, self.protected = budget, recent

    def observe(self, state, attention, keys, values, start, stop):
        state["norm"] = keys.norm(dim=-1).reciprocal()

    def selection(self, state, stop, b, h, candidates):
        return {p: significant(float(state["norm"][b, h, p]), 12) for p in candidates}


def significant(value: float, bits: int) -> float:
    """``value`` rounded to ``bits`` significant bits, half away from zero."""
    mantissa, exponent = math.frexp(value)
    return math.ldexp(math.copysign(math.floor(abs(mantissa) * 2**bits + 0.5), mantissa) / 2**bits, exponent)


def is_protected(rule, position: int, stop: int) -> bool:
    """Among the rule's ``protected`` newest of ``stop`` tokens, and not before its ``protected_from``
    (KVzip's rule sets it past the prompt, whose tokens compete by their reconstruction scores), or
    among its first ``sinks`` tokens (KVzip's; unpadded rows)."""
    newest = position > stop - 1 - rule.protected and position >= getattr(rule, "protected_from", 0)
    return newest or position < getattr(rule, "sinks", 0)


@torch.no_grad()
def naive_eviction(model, ids: torch.Tensor, chunks: list[int], rule):
    """Logits of every position and, after each forward, ``{layer: [batch, kv_heads, kept]}`` positions.

    After each forward, for each full layer in order, ``rule.observe(state, attention, keys, values,
    start, stop)`` sees the forward's attention weights ``[batch, kv_heads, groups, stop - start,
    total]`` over absolute positions and every key and value so far (zeros past ``stop``);
    ``rule.selection(state, stop, b, h, candidates)`` ranks a row's and head's candidates."""
    batch, total = ids.shape
    kv_heads = model.config.num_key_value_heads
    groups = model.config.num_attention_heads // kv_heads
    cache = DynamicCache(config=model.config)
    layers = full_layers(model)
    kept = {i: [[[] for _ in range(kv_heads)] for _ in range(batch)] for i in layers}
    state = {i: {} for i in layers}
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    logits, kept_log, start = [], [], 0
    for length in chunks:
        stop = start + length
        out = forward_with_attentions(model, ids, start, stop, cache)
        logits.append(out.logits)
        for i in layers:
            layer = cache.layers[i]
            new = (layer.keys[:, :, -length:], layer.values[:, :, -length:])
            history[i] = new if i not in history else tuple(torch.cat([h, n], 2) for h, n in zip(history[i], new))
            weights = out.attentions[i].view(batch, kv_heads, groups, length, -1)
            attention = torch.zeros(batch, kv_heads, groups, length, total)
            for b in range(batch):
                for h in range(kv_heads):
                    columns = torch.tensor(kept[i][b][h] + list(range(start, stop)))
                    attention[b, h, :, :, columns] = weights[b, h]
            keys = torch.zeros(batch, kv_heads, total, history[i][0].shape[-1])
            keys[:, :, :stop] = history[i][0]
            values = torch.zeros(batch, kv_heads, total, history[i][1].shape[-1])
            values[:, :, :stop] = history[i][1]
            rule.observe(state[i], attention, keys, values, start, stop)
            for b in range(batch):
                for h in range(kv_heads):
                    before = kept[i][b][h]
                    candidates = before + list(range(start, stop))
                    protected = [p for p in candidates if is_protected(rule, p, stop)]
                    others = [p for p in candidates if p not in protected]
                    if len(candidates) <= rule.budget:
                        chosen = candidates
                    elif len(before) + length <= rule.budget + 1:  # written in place: evict one
                        ranked = rule.selection(state[i], stop, b, h, candidates)
                        victim = min(others, key=lambda p: (ranked[p], p))
                        chosen = [p for p in candidates if p != victim]
                    else:  # trimmed: the protected tokens plus the best by the selection scores
                        ranked = rule.selection(state[i], stop, b, h, candidates)
                        best = sorted(others, key=lambda p: (-ranked[p], -p))[: rule.budget - len(protected)]
                        chosen = sorted(protected + best)
                    kept[i][b][h] = sorted(chosen)
            positions = torch.tensor([[kept[i][b][h] for h in range(kv_heads)] for b in range(batch)])
            index = positions.unsqueeze(-1).expand(-1, -1, -1, history[i][0].shape[-1])
            layer.keys, layer.values = (t.gather(2, index) for t in history[i])
        kept_log.append({i: torch.tensor([[kept[i][b][h] for h in range(kv_heads)] for b in range(batch)]) for i in layers})
        start = stop
    return torch.cat(logits, 1), kept_log


MODELS = {
    "llama-gqa": tiny_llama,
    "gemma3-mqa": tiny_gemma3,
    "llama-mqa": functools.partial(tiny_llama, num_key_value_heads=1),
    **{name: functools.partial(tiny_from_type, name, **kwargs) for name, kwargs in QUERY_ARCHITECTURES.items()},
}
POLICIES = {
    "snapkv": (lambda m: SnapKVCache(m, budget=10, window=4, kernel=3), lambda: SnapKVRule(10, 4, 3)),
    "snapkv-avg7": (
        lambda m: SnapKVCache(m, budget=12, window=3, kernel=7, pooling="avg"),
        lambda: SnapKVRule(12, 3, 7, "avg"),
    ),
    "tova": (lambda m: TOVACache(m, budget=8), lambda: TOVARule(8)),
    "knorm": (lambda m: KNormCache(m, budget=10, recent=3), lambda: KNormRule(10, 3)),
}
CASES = [
    (policy, model, schedule)
    for policy in ("snapkv", "tova", "knorm")
    for model, schedule in [
        ("llama-gqa", "long prompt"),
        ("llama-gqa", "chunks, also after evictions"),
        ("gemma3-mqa", "short prompt fills then evicts"),
        ("llama-mqa", "chunks, also after evictions"),
    ]
    if (policy, model) != ("knorm", "gemma3-mqa")  # Gemma 3 normalises its keys: their norms nearly tie
] + [("snapkv-avg7", "llama-gqa", "long prompt"), ("knorm", "llama-gqa", "short prompt fills then evicts")] + [
    ("tova", name, "long prompt") for name in QUERY_ARCHITECTURES  # the queries read from the model's rotation are its own
]


@functools.cache
def reference(policy: str, model_name: str, schedule: str):
    model = peaked(MODELS[model_name](), factor=8.0)
    model.set_attn_implementation("eager")
    chunks = SCHEDULES[schedule]
    return naive_eviction(model, random_ids(1, sum(chunks), seed=5), chunks, POLICIES[policy][1]())


@pytest.mark.parametrize("policy, model_name, schedule", CASES)
def test_matches_naive_reference(policy, model_name, schedule, one_thread):
    """Kept positions per layer and KV head after every forward (64+ decode steps), and logits."""
    expected_logits, expected_kept = reference(policy, model_name, schedule)
    model = peaked(MODELS[model_name](), factor=8.0)
    chunks = SCHEDULES[schedule]
    cache = POLICIES[policy][0](model)
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache)
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        for layer in want:
            assert torch.equal(got[layer], want[layer]), f"forward {step}, layer {layer}"
    final = kept[-1][full_layers(model)[0]]
    assert final.shape[-1] == cache.layers[full_layers(model)[0]].retention.budget
    assert not torch.equal(final, torch.arange(sum(chunks) - final.shape[-1], sum(chunks)).expand_as(final))  # not a window
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize(
    "make_cache",
    [
        lambda m: SnapKVCache(m, budget=80, window=8),
        lambda m: TOVACache(m, budget=80),
        lambda m: KNormCache(m, budget=80, recent=8),
    ],
    ids=["snapkv", "tova", "knorm"],
)
def test_budget_covering_everything_is_full_cache(make_cache, make_model, implementation, one_thread):
    model = make_model()
    model.set_attn_implementation(implementation)
    ids = random_ids(1, 48)
    expected = prefill_then_decode(model, ids, FullCache(model), prefill=16)
    # static decode steps attend over the whole fixed buffer, unfilled slots masked: equal up to rounding
    torch.testing.assert_close(prefill_then_decode(model, ids, make_cache(model), prefill=16), expected, rtol=0, atol=1e-5)


SCORED = {
    "h2o": lambda m, **kw: H2OCache(m, heavy=5, recent=3, **kw),
    "snapkv": lambda m, **kw: SnapKVCache(m, budget=8, window=3, kernel=3, **kw),
    "tova": lambda m, **kw: TOVACache(m, budget=8, **kw),
    "knorm": lambda m, **kw: KNormCache(m, budget=8, recent=3, **kw),
}


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(SCORED))
def test_left_padded_batch_equals_each_row_alone(name, implementation, one_thread):
    """Rows of 20, 13 and 6 tokens (budget 8: trimmed, trimmed, filling), 40 generated tokens:
    logits and kept positions (shifted by the row's padding; pads never kept) as if alone."""
    model = peaked(tiny_llama(), factor=8.0)
    model.set_attn_implementation(implementation)
    rows = [random_ids(1, n, seed=s) for n, s in [(20, 1), (13, 2), (6, 3)]]
    ids, mask = left_padded(rows)
    together = SCORED[name](model)
    logits = generated_logits(model, ids, together, 40, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = SCORED[name](model)
        torch.testing.assert_close(logits[i : i + 1], generated_logits(model, row, alone, 40), atol=1e-5, rtol=0)
        pads = ids.shape[1] - row.shape[1]
        for a, b in zip(alone.layers, together.layers):
            mine = b.retention.kept_positions()[i]
            assert bool((mine[:, :-8] == -1).all()) or mine.shape[-1] == 8  # anything beyond the row's tokens is empty
            assert torch.equal(mine[:, -a.retention.kept_positions().shape[-1] :] - pads, a.retention.kept_positions()[0])


@pytest.mark.parametrize("name", sorted(SCORED))
def test_beam_search_and_fp8_storage_keep_the_same_positions(name, one_thread):
    model = peaked(tiny_llama(), factor=8.0)
    ids = random_ids(1, 10, seed=3)
    covering = {"h2o": dict(heavy=30, recent=30)}.get(name, dict(budget=60))
    wide = type(SCORED[name](model))(model, **covering)
    assert torch.equal(greedy(model, ids, wide, 16, num_beams=2), greedy(model, ids, FullCache(model), 16, num_beams=2))
    cache = SCORED[name](model)
    assert greedy(model, ids, cache, 16, num_beams=2).shape == (1, 26)
    assert cache.layers[1].retention.kept_positions().shape == (2, 2, 8)  # both beams at the budget
    long = random_ids(2, 60, seed=7)
    native, fp8 = SCORED[name](model), SCORED[name](model, storage="fp8:residual=0")
    prefill_then_decode(model, long, native, prefill=30)
    prefill_then_decode(model, long, fp8, prefill=30)
    # key norms are taken from the keys as the model computed them: the same positions exactly; the
    # attention statistics see the fp8-rounded keys (as attention does), and only near-ties may differ
    for a, b in zip(native.layers, fp8.layers):
        mine, theirs = a.retention.kept_positions(), b.retention.kept_positions()
        if name == "knorm":
            assert torch.equal(mine, theirs)
        else:
            shared = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(mine.flatten(0, 1), theirs.flatten(0, 1)))
            assert shared >= 0.8 * mine.numel()
    assert fp8.get_memory_footprint() < native.get_memory_footprint()


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3])
def test_snapkv_and_tova_receive_only_the_last_queries_they_read(make_model, one_thread):
    """At a 24-token prefill the hook rotates SnapKV's window (4) and TOVA's last query only:
    exactly those rows of the queries H2O (which reads every query) receives."""
    model = make_model()
    ids = random_ids(1, 24)
    received = {}
    for name, cache in [("h2o", H2OCache(model, heavy=4, recent=4)), ("snapkv", SnapKVCache(model, budget=8, window=4)),
                        ("tova", TOVACache(model, budget=8))]:
        layer = full_layers(model)[0]
        cache.receive_query = lambda index, query, *rest, name=name, own=cache.receive_query, layer=layer: (
            index == layer and received.__setitem__(name, query), own(index, query, *rest))
        with torch.no_grad():
            model(ids, cache=cache)
    assert received["h2o"].shape[-2] == 24
    assert torch.equal(received["snapkv"], received["h2o"][:, :, -4:])
    assert torch.equal(received["tova"], received["h2o"][:, :, -1:])


def test_knorm_scores_copies_of_a_key_alike_despite_fp32_noise():
    """Copies of one key differing in their last bits (as a projection of 3 rows and of 1 differ)
    score exactly alike, so the shared rule breaks their tie by age; distinct keys stay apart."""
    from hf_kvpolicies.policies.knorm import KNormRetention
    from hf_kvpolicies.retention.scoring import Attended, rounded

    key = torch.randn(16, generator=torch.Generator().manual_seed(0))
    noisy = key * (1 + 2**-21)  # a few units in the last place
    keys = torch.stack([key, noisy, key * 1.01]).view(1, 1, 3, 16)
    assert key.norm() != noisy.norm()
    scores = KNormRetention(budget=2, recent=0).score(Attended(keys, keys, 0, 0), torch.zeros(1, 1, 3), {})
    assert scores[0, 0, 0] == scores[0, 0, 1] != scores[0, 0, 2]
    assert torch.equal(rounded(torch.tensor([1 + 2**-11, 1 + 2**-13, 3.0])), torch.tensor([1 + 2**-11, 1.0, 3.0]))


def test_reorder_moves_the_observation_history_with_the_rows(one_thread):
    model = peaked(tiny_llama(), factor=8.0)
    ids = random_ids(2, 50, seed=4)
    cache = SnapKVCache(model, budget=8, window=3, kernel=3)
    with torch.no_grad():
        model(ids[:, :20], cache=cache)
        for t in range(20, 30):
            model(ids[:, t : t + 1], cache=cache)
        cache.reorder_cache(torch.tensor([1, 0]))
        logits = [model(ids.flip(0)[:, t : t + 1], cache=cache).logits for t in range(30, 50)]
    expected = SnapKVCache(model, budget=8, window=3, kernel=3)
    expected_logits = prefill_then_decode(model, ids.flip(0), expected, prefill=20)
    torch.testing.assert_close(torch.cat(logits, 1), expected_logits[:, 30:], atol=1e-5, rtol=0)
    for a, b in zip(cache.layers, expected.layers):
        torch.testing.assert_close(a.retention.extra["history"], b.retention.extra["history"], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda m: SnapKVCache(m, budget=0), "budget must be an integer >= 1"),
        (lambda m: SnapKVCache(m, budget=16, window=32), "window <= budget"),
        (lambda m: SnapKVCache(m, budget=64, kernel=4), "must be odd"),
        (lambda m: SnapKVCache(m, budget=64, kernel=0), "kernel must be an integer >= 1"),
        (lambda m: SnapKVCache(m, budget=64, pooling="mean"), "pooling must be one of"),
        (lambda m: TOVACache(m, budget=0), "budget must be an integer >= 1"),
        (lambda m: KNormCache(m, budget=-3), "budget must be an integer >= 1"),
        (lambda m: KNormCache(m, budget=8, recent=9), "recent <= budget"),
        (lambda m: TOVACache(m, budget=8, layer_budgets="linear"), "layer_budgets='uniform', 'pyramid' or 'adaptive'"),
        (lambda m: H2OCache(m, heavy=4, recent=4, layer_budgets="Pyramid"), "layer_budgets must be one of"),
    ],
)
def test_bad_arguments_fail_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make(tiny_llama())


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
@pytest.mark.parametrize("name", ["h2o", "snapkv", "tova"])
def test_policies_that_read_queries_refuse_other_attention_at_construction(name, implementation):
    model = tiny_llama()
    model.config._attn_implementation_internal = implementation
    with pytest.raises(ValueError, match=r"set_attn_implementation\('sdpa'\)"):
        SCORED[name](model)
    KNormCache(model, budget=8, recent=3)  # reads no queries: any implementation
    from_spec(model, "keydiff:budget=8,recent=3")
    from_spec(model, "expected_attention:budget=8")  # reads the queries before their rotation, no probabilities


@torch.no_grad()
def _prefill_decode_chunk(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Prefill 16 tokens (trimmed), decode 10 one at a time, a 6-token chunk, then 8 more steps."""
    out = [model(ids[:, :16], cache=cache).logits]
    out += [model(ids[:, t : t + 1], cache=cache).logits for t in range(16, 26)]
    out.append(model(ids[:, 26:32], cache=cache).logits)
    out += [model(ids[:, t : t + 1], cache=cache).logits for t in range(32, 40)]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("spec", ["knorm:budget=10,recent=4", "keydiff:budget=10,recent=4", "expected_attention:budget=10,sinks=2"])
def test_attention_free_statistics_evict_alike_under_eager_sdpa_and_flex_attention(spec, one_thread):
    """KNorm and KeyDiff read no queries, Expected Attention only the queries before their rotation,
    and none of them attention probabilities, so every attention implementation serves them: the same
    kept positions and logits under eager, sdpa and flex_attention (compiled, on CPU: the cache hands
    flex a tensor kv offset, see ``PolicyCache.get_mask_sizes``). flash_attention_2 has no CPU
    kernel; its construction is accepted (test_policies_that_read_queries_refuse_other_attention...)."""
    ids = random_ids(1, 40, seed=6)
    logits, kept = {}, {}
    for implementation in ("sdpa", "eager", "flex_attention"):
        model = tiny_llama()
        model.set_attn_implementation(implementation)
        cache = from_spec(model, spec)
        logits[implementation] = _prefill_decode_chunk(model, cache, ids)
        kept[implementation] = [layer.retention.kept_positions() for layer in cache.layers]
        assert cache.kept_tokens(0) < 40 and cache.get_seq_length() == 40
    for implementation in ("eager", "flex_attention"):
        torch.testing.assert_close(logits[implementation], logits["sdpa"], atol=1e-5, rtol=0)
        assert all(torch.equal(a, b) for a, b in zip(kept[implementation], kept["sdpa"]))


def test_specs_and_budget_parameters():
    model = tiny_llama()
    cache = from_spec(model, "snapkv:budget=64,window=16,kernel=5,pooling=avg,layer_budgets=pyramid")
    assert (cache.budget, cache.window, cache.kernel, cache.pooling, cache.layer_budgets) == (64, 16, 5, "avg", "pyramid")
    assert isinstance(from_spec(model, "tova:budget=32,storage=fp8"), TOVACache)
    assert from_spec(model, "knorm:budget=32,recent=4").recent == 4
    assert SnapKVCache.budget_parameters(256) == {"budget": 256, "window": 32, "kernel": 21}
    assert SnapKVCache.budget_parameters(16) == {"budget": 16, "window": 4, "kernel": 3}
    assert TOVACache.budget_parameters(256) == {"budget": 256}
    assert KNormCache.budget_parameters(8) == {"budget": 8, "recent": 2}
    for name in ("snapkv", "tova", "knorm"):
        assert name in available_policies()
    from eval.benchmarks.eviction import contender

    assert SnapKVCache(model, budget=64).kernel == 21  # the needles' measured width (policies/snapkv.py)
    named = contender("snapkv:kernel=7", 64)  # the eviction benchmark's SnapKV at the paper's kernel 7
    assert named.label == "snapkv:budget=64,window=16,kernel=7"  # the spec's kernel wins over the budget's
    built = named.make(model)
    assert (type(built), built.budget, built.window, built.kernel) == (SnapKVCache, 64, 16, 7)


@pytest.mark.parametrize("cls, protected", [(SnapKVCache, "window"), (KNormCache, "recent")])
def test_small_budgets_keep_the_policy_a_policy(cls, protected, one_thread):
    """At every budget most of it is chosen by the statistic: the protected newest tokens are at
    most a quarter of it, so a budget sweep never measures a sliding window under another name."""
    for budget in range(1, 600):
        parameters = cls.budget_parameters(budget)
        assert parameters["budget"] == budget and parameters[protected] <= max(1, budget // 4)
        assert parameters.get("kernel", 1) <= max(1, budget // 8) | 1  # pooling spans an eighth at most
    model = peaked(tiny_llama(), factor=8.0)
    ids = random_ids(1, 80, seed=9)
    cache = cls(model, **cls.budget_parameters(16))
    prefill_then_decode(model, ids, cache, prefill=40)
    kept = cache.layers[0].retention.kept_positions()
    assert not torch.equal(kept, torch.arange(80 - 16, 80).expand_as(kept))  # not the newest 16: no window


@pytest.mark.parametrize("policy", ["h2o:heavy=4,recent=4", "snapkv:budget=16,window=4", "tova:budget=16"])
def test_cli_refuses_flex_attention_for_query_policies_in_one_line(policy, tmp_path, capsys, one_thread):
    from eval.cli import main
    from eval.data import embedded_text
    from tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(embedded_text()[:3000], encoding="utf-8")
    args = ["eval", "--model", str(model), "--text-file", str(text), "--policy", policy, "--attn-implementation",
            "flex_attention", "--task", "perplexity", "--tokens", "32", "--no-progress", "--out", str(tmp_path / "out")]
    capsys.readouterr()  # saving the model prints a progress bar
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "set_attn_implementation('sdpa')" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("budgets", ["", ",head_budgets=adaptive", ",layer_budgets=pyramid", ",storage=fp8"])
def test_knorm_serves_keys_and_values_of_different_widths(budgets, one_thread):
    """DeepSeek-V3's latent attention caches 16-wide keys and 8-wide values: the decode step, the
    trim and the pooled heads store each by its own width. A padded batch (over budget, under it)
    gives each row what it gets alone; a budget covering the sequence gives the full cache's logits (DynamicCache's, natively)."""
    model = tiny_deepseek_v3()
    spec = f"knorm:budget=24,recent=4{budgets}"
    rows = [random_ids(1, n, seed=i + 1) for i, n in enumerate((40, 9, 20))]
    ids, mask = left_padded(rows)
    batch = generated_logits(model, ids, from_spec(model, spec), 30, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = generated_logits(model, row, from_spec(model, spec), 30)[0]
        assert (batch[i] - alone).abs().max() < 1e-5
    ids = random_ids(2, 40)
    covering = prefill_then_decode(model, ids, from_spec(model, f"knorm:budget=1000,recent=4{budgets}"), 20)  # pyramid: the last layer 1/20
    full = from_spec(model, "full:storage=fp8" if budgets.endswith("fp8") else "full")
    torch.testing.assert_close(covering, prefill_then_decode(model, ids, full, 20), atol=1e-5, rtol=0)
    if not budgets.endswith("fp8"):
        torch.testing.assert_close(covering, prefill_then_decode(model, ids, DynamicCache(config=model.config), 20), atol=1e-5, rtol=0)
