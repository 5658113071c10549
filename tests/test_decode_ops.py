"""A decode step's cost, counted: the aten operations of one layer's step for every registered policy.

Timings on shared cores drift; the operations a step dispatches do not. For each registered
policy at a budget (``budget_parameters``), this counts the aten operations of one decoder layer's
decode step (its attention, MLP and the cache's work for it; views left out), after a prefill past
the budget, at two contexts: a bounded cache's step must dispatch the same operations at any
context (its cost is flat), a scored policy's step at most :data:`SCORED_EXTRA` more than the
sliding window's, and ranking in chunks (``chunk=``) at most :data:`CHUNK_EXTRA` more than the
same policy's single tokens. ``pytest tests/test_decode_ops.py -s`` prints the table.
"""

from __future__ import annotations

import collections
import inspect

import pytest
import torch
from tiny_models import char_tokenizer, random_ids, tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from hf_kvpolicies import available_policies
from hf_kvpolicies.specs import policy_constructor

BUDGET = 32
CONTEXTS = (96, 384)
VIEWS = {
    "view", "_unsafe_view", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "t", "permute",
    "alias", "detach", "as_strided", "reshape", "split", "unbind", "lift_fresh",
}
"""Operations that make a view: no kernel, no memory traffic."""
SCORED_EXTRA = 80
"""Operations a scored policy's step may add to one layer's, beyond the sliding window's: scoring,
choosing the slot to free and writing per-slot state (46 for SnapKV, 58 for Expected Attention)."""
CHUNKED = {"snapkv": 8, "expected_attention": 8}
"""Policies also counted with ``chunk=`` (ChunkKV) at this width."""
CHUNK_EXTRA = 40
"""Operations ranking in chunks may add to a layer's step (a sort, a search, two segment sums: 33)."""


class LayerOps(TorchDispatchMode):
    """Counts the non-view aten operations dispatched while ``layer`` runs."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.inside = False
        self.ops: collections.Counter[str] = collections.Counter()
        self.hooks = [
            layer.register_forward_pre_hook(lambda *args: setattr(self, "inside", True)),
            layer.register_forward_hook(lambda *args: setattr(self, "inside", False)),
        ]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.inside and name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def layer_ops(name: str, context: int, **extra) -> int:
    """Non-view operations of layer 1's decode step under policy ``name`` (with keywords ``extra``),
    after ``context`` tokens."""
    model = tiny_llama(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)  # 3 query heads per KV head
    constructor = policy_constructor(name)
    kwargs = {**(constructor.budget_parameters(BUDGET) or {}), **extra}
    if "tokenizer" in inspect.signature(constructor).parameters:
        kwargs["tokenizer"] = char_tokenizer()
    cache = constructor(model, **kwargs)
    ids = random_ids(1, context + 3)
    model(ids[:, :context], cache=cache)
    model(ids[:, context : context + 1], cache=cache)  # the first step may still fill the buffer's last slot
    model(ids[:, context + 1 : context + 2], cache=cache)
    counter = LayerOps(model.model.layers[1])
    with counter:
        model(ids[:, context + 2 :], cache=cache)
    for hook in counter.hooks:
        hook.remove()
    return sum(counter.ops.values())


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
