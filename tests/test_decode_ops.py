"""A decode step's cost, counted: the aten operations of one layer's step for every registered policy.

Timings on shared cores drift; the operations a step dispatches do not. For each registered
policy at a budget (``budget_parameters``), this counts the aten operations of one decoder layer's
decode step (its attention, MLP and the cache's work for it; views left out), after a prefill past
the budget, at two contexts: a bounded cache's step must dispatch the same operations at any
context (its cost is flat), a scored policy's step at most :data:`SCORED_EXTRA` more than the
sliding window's, and ranking in chunks (``chunk=``) at most :data:`CHUNK_EXTRA` more than the
same policy's single tokens. ``pytest tests/test_decode_ops.py -s`` prints the table.

Every operation counted, views included, the ring and full retentions, KNorm, TOVA and H2O on native storage
hold :data:`OWN_STEP_BUDGET`: what their work adds to a layer's step beyond ``DynamicCache``'s (on a
GPU, each is a launch paid in every layer at every token).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import char_tokenizer, random_ids, tiny_llama

from transformers import DynamicCache

from hf_kvpolicies import available_policies, from_spec
from hf_kvpolicies.specs import policy_constructor

from eval.benchmarks.ops import OperationCounter

BUDGET = 32
CONTEXTS = (96, 384)
SCORED_EXTRA = 35
"""Operations a scored policy's step may add to one layer's, beyond the sliding window's: scoring,
choosing the slot to free and writing per-slot state (17 for SnapKV, 24 for Expected Attention,
31 for KVzip)."""
CHUNKED = {"snapkv": 8, "expected_attention": 8}
"""Policies also counted with ``chunk=`` (ChunkKV) at this width."""
CHUNK_EXTRA = 22
"""Operations ranking in chunks may add to a layer's step: a search, one segment sum of the scores
and the tokens held, the open chunk's protection, and a sort where the statistic has not sorted
its slots by position already (20 for Expected Attention, 16 for SnapKV, which has)."""


@torch.no_grad()
def layer_ops(name: str, context: int, **extra) -> int:
    """Non-view operations of layer 1's decode step under policy ``name`` (with keywords ``extra``),
    after ``context`` tokens."""
    model = tiny_llama(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)  # 3 query heads per KV head
    constructor = policy_constructor(name)
    kwargs = {**(constructor.budget_parameters(BUDGET) or {}), **extra}
    if "tokenizer" in inspect.signature(constructor).parameters:
        kwargs["tokenizer"] = char_tokenizer()
    return step_ops(model, constructor(model, **kwargs), context, views=False)


def step_ops(model, cache, context: int, views: bool) -> int:
    """Operations of layer 1's third decode step after a ``context``-token prefill (the first step
    may still fill the buffer's last slot), views counted or not."""
    ids = random_ids(1, context + 3)
    model(ids[:, :context], cache=cache)
    model(ids[:, context : context + 1], cache=cache)
    model(ids[:, context + 1 : context + 2], cache=cache)
    counter = OperationCounter(model.model.layers[1], views=views)
    with counter:
        model(ids[:, context + 2 :], cache=cache)
    counter.close()
    return counter.count


@pytest.fixture(scope="module")
def counts() -> dict[str, tuple[int, ...]]:
    table = {name: tuple(layer_ops(name, context) for context in CONTEXTS) for name in available_policies()}
    for name, chunk in CHUNKED.items():
        table[f"{name}:chunk={chunk}"] = tuple(layer_ops(name, context, chunk=chunk) for context in CONTEXTS)
    print("\nnon-view aten operations of one layer's decode step, budget", BUDGET)
    for name, ops in table.items():
        print(f"  {name:28s} " + "  ".join(f"{n} @{c}" for n, c in zip(ops, CONTEXTS)) + f"  ({ops[0] / table['window'][0]:.2f}x window)")
    return table


def test_bounded_steps_are_flat_and_scored_ones_cost_a_few_dozen_operations(counts, one_thread):
    window = counts["window"][0]
    for name, ops in counts.items():
        policy, _, chunked = name.partition(":")
        if policy_constructor(policy).budget_parameters(BUDGET) is None:
            continue  # keeps every token: its step grows with the context
        assert len(set(ops)) == 1, (name, ops)
        single = counts[policy][0]
        assert single <= window + SCORED_EXTRA, (name, ops, window)
        assert not chunked or ops[0] <= single + CHUNK_EXTRA, (name, ops, single)


OWN_STEP_BUDGET = {"window": 8, "full": 8, "sink": 12, "knorm": 25, "tova": 25, "h2o": 25}
"""Every aten operation (views included) a cache's work adds to one layer's decode step beyond
``DynamicCache``'s, on native storage: the sliding window and the full cache (pre-sized, growing,
or growing by blocks) write the token and advance one device counter; the sink retention also re-rotates its sinks' keys
by the evictions so far and writes them (one multiply-add; cos and sin of one angle per dim are
computed by the first layer and reused by the others, as layer 1 here does); KNorm writes the
token, its position and its score (the key's norm) and picks the next slot to free; TOVA and H2O
also take the query's probabilities over the keys (the query as the model rotated it, read
without an operation; H2O adds them to its scores in place, and zeroes the new slot's first)."""


@torch.no_grad()
def added_ops(spec: str, context: int = 96) -> int:
    """Operations of layer 1's decode step under ``spec`` beyond ``DynamicCache``'s, views included."""
    model = tiny_llama(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    return step_ops(model, from_spec(model, spec), context, True) - step_ops(model, DynamicCache(config=model.config), context, True)


@pytest.mark.parametrize(
    "spec",
    [
        "window:window=32", "full", "full:max_length=128", "full:block=32", "sink:sink_tokens=4,window=28",
        "knorm:budget=32,recent=8", "tova:budget=32", "h2o:heavy=16,recent=16",
    ],
)
def test_steps_stay_within_their_operation_budget(spec, one_thread):
    name = spec.partition(":")[0]
    assert added_ops(spec) <= OWN_STEP_BUDGET[name], spec


FP8_EXTRA = 25
"""What fp8 storage may add to the growing full cache's decode step beyond native storage's, every
operation counted: an appended token waits natively in the residual and is quantised with the
others as they leave it (one batch per ``residual + 1`` steps), so a step writes the token's native
copy, decodes the payload (keys and values in one pass) and lays the residual over it."""


@torch.no_grad()
def layer_ops_per_step(spec: str, context: int, steps: int) -> list[int]:
    """Operations (views included) of layer 1 in each of ``steps`` decode steps after a ``context``-token prefill."""
    model = tiny_llama(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    cache = DynamicCache(config=model.config) if spec == "dynamic" else from_spec(model, spec)
    ids = random_ids(1, context + steps)
    model(ids[:, :context], cache=cache)
    counts = []
    for step in range(context, context + steps):
        counter = OperationCounter(model.model.layers[1])
        with counter:
            model(ids[:, step : step + 1], cache=cache)
        counter.close()
        counts.append(counter.count)
    return counts


def test_fp8_storage_adds_at_most_its_budget_to_the_full_cache_step(one_thread):
    """Every step but those that quantise a departing batch (one in each cycle of ``residual + 1``
    steps) holds the budget, and so does the mean over two whole cycles. Steps where the full cache
    grows its buffers (native and fp8 alike) are left out."""
    cycle, steps = 33, 66
    native = layer_ops_per_step("full", 96, steps)
    fp8 = layer_ops_per_step("full:storage=fp8", 96, steps)
    steady = max(set(native), key=native.count)
    extra = [f - n for f, n in zip(fp8, native) if n == steady]
    assert len(extra) >= steps - 4, native
    batches = [e for e in extra if e > FP8_EXTRA]
    assert len(batches) <= steps // cycle, extra
    assert sum(extra) / len(extra) <= FP8_EXTRA, extra


STATIC_FP8_EXTRA = 50
"""What fp8 storage may add to a static decode step of a ring or a pre-sized full cache beyond
native storage's, every operation counted: the token quantised and written with its scales, its
native copy pushed into the residual (no refresh and no push decision: those slots are never
shadowed, proven when static steps begin), the payload decoded and the residual laid over it
in one scatter (every entry in use)."""


@pytest.mark.parametrize("spec", ["window:window=32", "full:max_length=128"])
def test_fp8_static_steps_add_at_most_their_budget(spec, one_thread):
    fp8 = added_ops(f"{spec},storage=fp8:residual=8")
    assert fp8 - added_ops(spec) <= STATIC_FP8_EXTRA, (spec, fp8)


STORAGE_EXTRA = {"fp8": 70, "int8": 295, "int4": 330, "int2": 355}
"""What each stored format may add to a registered policy's decode step beyond the same policy on
native storage (budget 32, every operation counted): the token quantised into its slot and pushed
into the native residual, every slot decoded for attention and the residual laid over them; the
integer formats also unpack their planes and, for a token leaving the residual, re-quantise its
key group (per-channel keys span tokens). The sink cache also rewrites its sinks' keys through
the format at every step (:data:`SINK_STORAGE_EXTRA`)."""
SINK_STORAGE_EXTRA = {"fp8": 105, "int8": 525, "int4": 580, "int2": 620}


@pytest.fixture(scope="module")
def storage_counts() -> dict[tuple[str, str], int]:
    """Every operation of layer 1's decode step for every registered policy that takes a storage, per storage."""
    model = tiny_llama(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    table = {}
    for name in available_policies():
        constructor = policy_constructor(name)
        if "storage" not in inspect.signature(constructor).parameters:
            continue
        kwargs = dict(constructor.budget_parameters(BUDGET) or {})
        if "tokenizer" in inspect.signature(constructor).parameters:
            kwargs["tokenizer"] = char_tokenizer()
        for storage in ["native", *STORAGE_EXTRA]:
            table[name, storage] = step_ops(model, constructor(model, **kwargs, storage=storage), CONTEXTS[0], views=True)
    return table


@pytest.mark.parametrize("storage", list(STORAGE_EXTRA))
def test_every_policy_in_every_stored_format_stays_within_its_budget(storage, storage_counts, one_thread):
    names = sorted({name for name, _ in storage_counts})
    assert len(names) >= 10
    for name in names:
        extra = storage_counts[name, storage] - storage_counts[name, "native"]
        budget = (SINK_STORAGE_EXTRA if name == "sink" else STORAGE_EXTRA)[storage]
        assert 0 < extra <= budget, (name, storage, extra)
