"""ExpectedAttentionCache against a naive Expected Attention written from its definition.

The reference (a rule for :func:`test_scored.naive_eviction` and
:func:`test_head_budgets.naive_pooled`) keeps every counted query of every forward (captured from
each full layer's ``q_proj``, normalised per head where the model does), recomputes their mean
and covariance from scratch in float64, averages the model's rotation matrices explicitly over the
window after each forward, scores the forward's new keys with them, and ranks the candidates by
the softmax of those expected logits over the non-sink candidates, averaged over the group, times
the value norms; the first ``sinks`` positions stay. A token's expected logits are those of the
forward that brought it (the documented decoding rule).
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

import pytest
import torch
from helpers import generated_logits, greedy, left_padded, prefill_then_decode, real_positions
from test_h2o import SCHEDULES, full_layers, peaked, run_schedule
from test_head_budgets import naive_pooled, owned_positions
from test_scored import MODELS, naive_eviction
from tiny_models import random_ids, tiny_gemma3, tiny_llama, tiny_qwen3

from hf_kvpolicies import ExpectedAttentionCache, FullCache, from_spec
from hf_kvpolicies.policies.expected_attention import ExpectedAttentionRetention

BUDGET, SINKS = 10, 2


class ExpectedAttentionRule:
    """Expected Attention from its definition (see the module docstring); ``watching()`` captures
    the queries of the forwards it runs around."""

    def __init__(self, model, budget: int, sinks: int, future: int, covariance: bool = True, vnorm: bool = True):
        self.budget, self.protected, self.sinks = budget, 0, sinks
        self.future, self.covariance, self.vnorm = future, covariance, vnorm
        self.modules = [model.model.layers[i].self_attn for i in full_layers(model)]
        self.rotary = model.model.rotary_emb
        self.groups = model.config.num_attention_heads // model.config.num_key_value_heads
        self.projected: list[torch.Tensor] = []
        self.turn = 0
        self.states: dict[int, dict] = {}
        """Each full layer's state (by order), as the last forward left it."""

    @contextmanager
    def watching(self):
        hooks = [m.q_proj.register_forward_hook(lambda _, args, out: self.projected.append(out)) for m in self.modules]
        try:
            yield self
        finally:
            for hook in hooks:
                hook.remove()

    def mean_rotation(self, first: int, dim: int) -> torch.Tensor:
        """The mean over positions ``first .. first + future - 1`` of the model's rotation matrices
        ``s (diag(cos) + diag(sin) P)`` (float64; ``P`` the model's own ``rotate_half``)."""
        inv_freq = getattr(self.rotary, "full_attention_inv_freq", getattr(self.rotary, "inv_freq", None)).double()
        scale = getattr(self.rotary, "full_attention_attention_scaling", getattr(self.rotary, "attention_scaling", 1.0))
        rotate_half = sys.modules[type(self.rotary).__module__].rotate_half
        turn = rotate_half(torch.eye(dim, dtype=torch.float64)).T  # P: rotate_half(x) = P x
        angles = torch.arange(first, first + self.future, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        matrices = torch.diag_embed(angles.cos()) + torch.diag_embed(angles.sin()) @ turn
        return scale * matrices.mean(dim=0)

    def observe(self, state, attention, keys, values, start, stop):
        module = self.modules[self.turn]
        self.states[self.turn] = state
        self.turn = (self.turn + 1) % len(self.modules)
        projected = self.projected.pop(0)
        batch, length = projected.shape[:2]
        queries = projected.view(batch, length, -1, module.head_dim)
        if getattr(module, "q_norm", None) is not None:
            queries = module.q_norm(queries)
        queries = queries.transpose(1, 2).double()[:, :, max(0, self.sinks - start) :]  # no sinks
        state["queries"] = torch.cat([state["queries"], queries], 2) if "queries" in state else queries
        counted = state["queries"]
        heads, total, dim = counted.shape[1], keys.shape[2], keys.shape[-1]
        state.setdefault("z", torch.zeros(batch, heads, total, dtype=torch.float64))
        state["vnorm"] = values.norm(dim=-1).double()
        mean = counted.mean(dim=2) if counted.shape[2] else torch.zeros(batch, heads, dim, dtype=torch.float64)
        centred = counted - mean[:, :, None]
        covariance = centred.transpose(-1, -2) @ centred / max(1, counted.shape[2])
        rotation = self.mean_rotation(stop, dim)
        new = keys[:, :, start:stop].double().repeat_interleave(self.groups, dim=1)  # each query head's keys
        c = module.scaling
        z = torch.einsum("bhd,bhld->bhl", mean @ rotation.T, new) * c
        if self.covariance:
            z += torch.einsum("bhld,bhde,bhle->bhl", new, rotation @ covariance @ rotation.T, new) * c**2 / 2
        state["z"][:, :, start:stop] = z

    def selection(self, state, stop, b, h, candidates):
        others = [p for p in candidates if p >= self.sinks]
        logits = state["z"][b, h * self.groups : (h + 1) * self.groups][:, others]
        weights = torch.softmax(logits, dim=-1).mean(dim=0)
        if self.vnorm:
            weights = weights * state["vnorm"][b, h, others]
        scores = {p: float("inf") for p in candidates if p < self.sinks}
        return {**scores, **{p: float(w) for p, w in zip(others, weights)}}


OPTIONS = {
    "default": dict(n_future_positions=512),
    "short window": dict(n_future_positions=24),
    "mean only, no value norms": dict(n_future_positions=64, use_covariance=False, use_vnorm=False),
}
CASES = [
    ("llama-gqa", "long prompt", "default"),
    ("llama-gqa", "chunks, also after evictions", "short window"),
    ("gemma3-mqa", "short prompt fills then evicts", "default"),
    ("gemma3-mqa", "chunks, also after evictions", "short window"),
    ("llama-mqa", "chunks, also after evictions", "mean only, no value norms"),
]


def rule_for(model, options: str) -> ExpectedAttentionRule:
    kwargs = OPTIONS[options]
    return ExpectedAttentionRule(
        model, BUDGET, SINKS, kwargs["n_future_positions"], kwargs.get("use_covariance", True), kwargs.get("use_vnorm", True)
    )


@functools.cache
def reference(model_name: str, schedule: str, options: str, pooled: bool = False):
    model = peaked(MODELS[model_name](), factor=8.0)
    model.set_attn_implementation("eager")
    chunks = SCHEDULES[schedule]
    with rule_for(model, options).watching() as rule:
        naive = naive_pooled if pooled else naive_eviction
        return naive(model, random_ids(1, sum(chunks), seed=5), chunks, rule)


@pytest.mark.parametrize("model_name, schedule, options", CASES)
def test_matches_naive_reference(model_name, schedule, options, one_thread):
    """Kept positions per layer and KV head after every forward (64+ decode steps), and logits."""
    expected_logits, expected_kept = reference(model_name, schedule, options)
    model = peaked(MODELS[model_name](), factor=8.0)
    chunks = SCHEDULES[schedule]
    cache = ExpectedAttentionCache(model, budget=BUDGET, sinks=SINKS, **OPTIONS[options])
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache)
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        for layer in want:
            assert torch.equal(got[layer], want[layer]), f"forward {step}, layer {layer}"
    final = kept[-1][full_layers(model)[0]]
    assert final.shape[-1] == BUDGET and bool((final[..., :SINKS] == torch.arange(SINKS)).all())  # the sinks stay
    assert not torch.equal(final[..., SINKS:], torch.arange(sum(chunks) - BUDGET + SINKS, sum(chunks)).expand_as(final[..., SINKS:]))
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


def test_pooled_heads_match_the_naive_masked_reference(one_thread):
    """``head_budgets="adaptive"``: the heads' expected attention competes for ``heads x budget``."""
    expected_logits, expected_kept = reference("llama-gqa", "chunks, also after evictions", "default", pooled=True)
    model = peaked(tiny_llama(), factor=8.0)
    chunks = SCHEDULES["chunks, also after evictions"]
    cache = ExpectedAttentionCache(model, budget=BUDGET, sinks=SINKS, head_budgets="adaptive")
    logits, kept = run_schedule(model, random_ids(1, sum(chunks), seed=5), chunks, cache, owned_positions)
    for step, (got, want) in enumerate(zip(kept, expected_kept)):
        assert got == want, f"forward {step}"
    assert any(len(head) != BUDGET for step in kept for layer in step.values() for head in layer[0])
    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3, tiny_qwen3], ids=["llama", "gemma3", "qwen3"])
def test_prefill_scores_are_the_definitions(make_model, one_thread):
    """At the prefill every score is the reference's (kvpress's definition): the mean and covariance
    of the prompt's queries but the sinks, rotated on average over the next positions."""
    model = make_model()
    model.set_attn_implementation("eager")
    ids = random_ids(2, 30, seed=2)
    with ExpectedAttentionRule(model, 8, SINKS, 512).watching() as rule:
        _, kept = naive_eviction(model, ids, [30], rule)
    cache = ExpectedAttentionCache(model, budget=8, sinks=SINKS)
    with torch.no_grad():
        model(ids, cache=cache)
    for index, layer in enumerate(full_layers(model)):
        state = rule.states[index]
        retention = cache.layers[layer].retention
        positions = retention.kept_positions()
        assert torch.equal(positions, kept[0][layer])
        for b in range(2):
            for h in range(positions.shape[1]):
                expected = rule.selection(state, 30, b, h, list(range(30)))
                got = retention.scores[b, h, : retention.live][retention.positions[b, h, : retention.live].argsort()]
                want = torch.tensor([expected[int(p)] for p in positions[b, h]], dtype=torch.float32)
                torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)
        assert torch.equal(retention.count, torch.full((2,), 30.0 - SINKS))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3])
def test_budget_covering_everything_is_full_cache(make_model, implementation, one_thread):
    model = make_model()
    model.set_attn_implementation(implementation)
    ids = random_ids(1, 48)
    expected = prefill_then_decode(model, ids, FullCache(model), prefill=16)
    got = prefill_then_decode(model, ids, ExpectedAttentionCache(model, budget=80), prefill=16)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_left_padded_batch_equals_each_row_alone(heads, implementation, one_thread):
    """Rows of 20, 13 and 6 tokens (budget 8: trimmed, trimmed, filling), 40 generated tokens:
    logits and kept positions (shifted by the row's padding) as if alone. A row's sinks, window
    and statistics count from its first real token."""
    model = peaked(tiny_llama(), factor=8.0)
    model.set_attn_implementation(implementation)
    rows = [random_ids(1, n, seed=s) for n, s in [(20, 1), (13, 2), (6, 3)]]
    ids, mask = left_padded(rows)
    make = lambda: ExpectedAttentionCache(model, budget=8, sinks=2, n_future_positions=32, head_budgets=heads)  # noqa: E731
    together = make()
    logits = generated_logits(model, ids, together, 40, attention_mask=mask)
    for i, row in enumerate(rows):
        alone = make()
        torch.testing.assert_close(logits[i : i + 1], generated_logits(model, row, alone, 40), atol=1e-5, rtol=0)
        assert real_positions(together, i, ids.shape[1] - row.shape[1]) == real_positions(alone, 0)
        for a, b in zip(alone.layers, together.layers):
            torch.testing.assert_close(b.retention.mean[i], a.retention.mean[0], atol=1e-5, rtol=0)
            assert b.retention.count[i] == a.retention.count[0] == row.shape[1] + 40 - 1 - 2


def test_beams_and_fp8_storage(one_thread):
    """Beams reorder the query statistics with the rows; fp8 storage keeps what native keeps in the
    first layer (its keys, values and queries are the model's own, before any storage)."""
    model = peaked(tiny_llama(), factor=8.0)
    ids = random_ids(1, 10, seed=3)
    wide = ExpectedAttentionCache(model, budget=60)
    assert torch.equal(greedy(model, ids, wide, 16, num_beams=2), greedy(model, ids, FullCache(model), 16, num_beams=2))
    cache = ExpectedAttentionCache(model, budget=8, sinks=2)
    assert greedy(model, ids, cache, 16, num_beams=2).shape == (1, 26)
    assert cache.layers[1].retention.kept_positions().shape == (2, 2, 8) and cache.layers[1].retention.moment.shape[0] == 2
    long = random_ids(2, 60, seed=7)
    native, fp8 = ExpectedAttentionCache(model, budget=8), ExpectedAttentionCache(model, budget=8, storage="fp8:residual=0")
    prefill_then_decode(model, long, native, prefill=30)
    prefill_then_decode(model, long, fp8, prefill=30)
    assert torch.equal(native.layers[0].retention.kept_positions(), fp8.layers[0].retention.kept_positions())
    assert fp8.get_memory_footprint() < native.get_memory_footprint()


def test_decoding_holds_running_sums_not_queries(one_thread):
    """The statistics are a count, a mean and a centred second moment per query head: their size does
    not grow with the stream, and they equal the definition's over every query seen but the sinks."""
    model = tiny_llama()
    ids = random_ids(1, 70, seed=4)
    cache = ExpectedAttentionCache(model, budget=12, sinks=3)
    prefill_then_decode(model, ids[:, :40], cache, prefill=20)
    held = cache.get_memory_footprint()
    retention = cache.layers[0].retention  # the first layer's queries depend on the tokens alone
    with torch.no_grad():
        for t in range(40, 70):
            model(ids[:, t : t + 1], cache=cache)
    assert cache.get_memory_footprint() == held and int(retention.count) == 70 - 3
    captured = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda _, args, out: captured.append(out))
    with torch.no_grad():
        model(ids, cache=FullCache(model))
    hook.remove()
    queries = captured[0].view(1, 70, 4, 16).transpose(1, 2)[:, :, 3:].double()
    torch.testing.assert_close(retention.mean.double(), queries.mean(2), atol=1e-5, rtol=1e-5)
    centred = queries - queries.mean(2, keepdim=True)
    torch.testing.assert_close(retention.moment.double(), centred.transpose(-1, -2) @ centred, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention"])
def test_reads_no_attention_weights_so_every_kernel_serves_it(implementation):
    """Only the queries before their rotation are read (no attention probabilities): the
    construction accepts every kernel (flex_attention runs in test_scored.py, against eager and sdpa)."""
    model = tiny_llama()
    model.config._attn_implementation_internal = implementation
    assert ExpectedAttentionCache(model, budget=16).layers[0].retention.queries_before_rope


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": 0}, "budget must be an integer >= 1"),
        ({"budget": 16, "n_future_positions": 0}, "n_future_positions must be an integer >= 1"),
        ({"budget": 16, "sinks": 16}, "sinks=16 must be below budget=16.*lower sinks or raise budget"),
        ({"budget": 16, "sinks": -1}, "sinks must be an integer >= 0"),
        ({"budget": 16, "use_covariance": "yes"}, "use_covariance must be True or False"),
        ({"budget": 16, "chunk": 0}, "chunk must be an integer >= 1"),
        ({"budget": 16, "chunk": 17}, "chunk=17 is larger than budget=16.*give chunk <= budget"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpectedAttentionCache(tiny_llama(), **kwargs)


def test_a_model_without_one_rotation_per_position_is_refused():
    model = tiny_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="ExpectedAttentionCache averages .* use a policy that reads no rotation"):
        ExpectedAttentionCache(model, budget=16)


def test_spec_and_budget_parameters():
    model = tiny_llama()
    cache = from_spec(model, "expected_attention:budget=64,n_future_positions=128,sinks=2,use_covariance=false,chunk=8")
    assert (cache.budget, cache.n_future_positions, cache.sinks, cache.use_covariance, cache.use_vnorm, cache.chunk) == (
        64, 128, 2, False, True, 8
    )
    assert isinstance(cache.layers[0].retention, ExpectedAttentionRetention)
    assert ExpectedAttentionCache.budget_parameters(256) == {"budget": 256, "sinks": 4}
    assert ExpectedAttentionCache.budget_parameters(8) == {"budget": 8, "sinks": 2}
    assert all(ExpectedAttentionCache(model, **ExpectedAttentionCache.budget_parameters(b)) for b in range(1, 20))


def test_static_steps_hold_the_sinks_in_place_of_finding_them(one_thread):
    """While static decode steps run, where the sinks are is found once (a sink is never evicted and
    nothing is written over it): each step's scores equal those of finding them again."""
    model = tiny_llama()
    ids = random_ids(1, 40, seed=6)
    cache = ExpectedAttentionCache(model, budget=12, sinks=3)
    with torch.no_grad():
        model(ids[:, :30], cache=cache)
        for t in range(30, 40):
            model(ids[:, t : t + 1], cache=cache)
    retention = cache.layers[1].retention
    held = retention.held_sinks
    assert held is not None and torch.equal(held, (retention.positions >= 0) & (retention.positions < 3))
    assert held.sum(dim=-1).eq(3).all()
    retention.held_sinks = None  # the general path: sinks found from the positions, their logits hidden anew
    found = retention._expected_attention(retention.extra, retention.positions, None, None)
    retention.held_sinks = held
    assert torch.equal(found, retention.scores) and found.isinf().sum() == held.sum()
