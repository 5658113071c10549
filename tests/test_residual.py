"""The native residual: its static writes (where the retention's slots never meet a shadowed one,
a ring longer than the residual or appends, each write pushes without the refresh and the push
decision, and gives exactly what the checking write gives), and its rows apart in a padded batch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import prefill_then_decode
from tiny_models import random_ids, tiny_llama

from hf_kvpolicies import from_spec
from hf_kvpolicies.storage import cpu_kernels
from hf_kvpolicies.storage.residual import NativeResidual

OPTIONS = {"fp8": "residual=8", "int4": "residual=8;group_size=8"}
"""A residual of 8 tokens (integer keys are quantised in groups no longer than the residual)."""


@pytest.mark.parametrize("storage", list(OPTIONS))
@pytest.mark.parametrize(
    "spec, unshadowed",
    [
        ("window:window=24", True),  # the ring wraps twice in 50 steps
        ("full:max_length=80", True),
        ("sink:sink_tokens=2,window=22", True),  # the sinks' keys are rewritten at every step
        ("window:window=6", False),  # a ring shorter than the residual: every write lands on a shadowed slot
    ],
)
def test_unchecked_static_writes_equal_checked_ones(spec, unshadowed, storage, monkeypatch, one_thread):
    model = tiny_llama()
    ids = random_ids(1, 70)
    built = f"{spec},storage={storage}:{OPTIONS[storage]}"

    def decode() -> tuple[torch.Tensor, list[bool]]:
        cache = from_spec(model, built)
        with torch.no_grad():
            logits = prefill_then_decode(model, ids, cache, prefill=20)
        return logits, [layer.storage.ring._unshadowed for layer in cache.layers]

    logits, proven = decode()
    assert proven == [unshadowed] * len(proven)
    monkeypatch.setattr(NativeResidual, "_never_shadowed", lambda self, upcoming: False)
    checked, proven = decode()
    assert not any(proven)
    assert torch.equal(logits, checked)


def residual_holding(slots: list[int], size: int = 4) -> NativeResidual:
    """A residual whose entries shadow ``slots`` (written in that order, as int appends)."""
    ring = NativeResidual(size)
    ring.allocate(1, 1, 2, 2, torch.float32, torch.device("cpu"))
    for slot in slots:
        ring.note(slot, torch.zeros(1, 1, 1, 4), capacity=64)
    return ring


@pytest.mark.parametrize(
    "held, upcoming, never",
    [
        ([10, 11, 12, 13], [14, 15, 16, 17, 18], True),  # appends after the shadowed slots
        ([10, 11, 12, 13], [0, 1, 2, 3, 4], True),  # a ring of at least 5 slots that wrapped
        ([10, 11, 12, 13], [0, 1, 2, 3, 0], False),  # a ring of 4 slots: write 4 meets write 0's entry
        ([10, 11, 12, 13], [11, 0, 1, 2, 3], False),  # write 0 meets the entry of slot 11 (overwritten by write 1)
        ([10, 11, 12, 13], [0, 1, 12, 2, 3], False),  # write 2 meets slot 12's entry before its push overwrites it
        ([10, 11, 12, 13], [0, 10, 1, 2, 3], True),  # slot 10's entry was overwritten by write 0
        ([10, 11], [11, 12, 13, 14, 15], False),  # entries in use shadow 10 and 11: write 0 meets 11
        ([10, 11], [12, 13, 14, 15, 16], True),
    ],
)
def test_a_write_is_proven_unshadowed_only_before_it_can_meet_an_entry(held, upcoming, never):
    ring = residual_holding(held)
    assert ring._never_shadowed(upcoming) is never


@pytest.mark.parametrize("spec", ["full:storage=fp8", "window:window=16,storage=fp8:residual=8", "h2o:heavy=8,recent=8,storage=fp8:residual=8"])
def test_a_cache_prefilled_without_grad_decodes_with_grad(spec):
    """The residual's views made under ``torch.no_grad()`` are made again once grad is enabled
    (autograd refuses a no-grad view whose base was written in place with grad enabled)."""
    model = tiny_llama()
    ids = random_ids(1, 60)
    logits = []
    for grad in (False, True):
        cache = from_spec(model, spec)
        with torch.no_grad():
            model(ids[:, :50], cache=cache)
        with torch.set_grad_enabled(grad):
            logits.append(torch.cat([model(ids[:, t : t + 1], cache=cache).logits.detach() for t in range(50, 60)]))
    assert torch.equal(logits[0], logits[1])


def test_rows_apart_push_their_own_real_tokens_and_decide_for_themselves():
    """Once a write ranks its tokens (a padded batch), each row pushes only its real tokens, in
    rank order, onto a ring position of its own, and a shared slot that one row already shadows
    is refreshed there while the other row pushes it; reads and departures follow each row."""
    ring = NativeResidual(4)
    ring.allocate(2, 1, 1, 1, torch.float32, torch.device("cpu"))

    def tokens(*content: float) -> torch.Tensor:  # [2 rows, 1 head, q, key + value], a row's token k = 10 * row + k
        return torch.tensor(content).view(1, 1, -1, 1).repeat(2, 1, 1, 2) + torch.tensor([0.0, 10.0]).view(2, 1, 1, 1)

    ranks = torch.tensor([[0, 1, 2, 3], [-1, -1, 0, 1]])  # row 1: two pads, then two real tokens
    ring.note(0, tokens(0, 1, 2, 3), capacity=8, ranks=ranks)
    assert ring.rows_apart and ring._rows.tolist() == [[0], [2]]
    assert ring.slots[:, 0].tolist() == [[0, 1, 2, 3], [2, 3, -1, -1]]

    ring.note(1, tokens(7), capacity=8)  # row 0 shadows slot 1: refreshed; row 1 does not: pushed
    assert ring.slots[:, 0].tolist() == [[0, 1, 2, 3], [2, 3, 1, -1]]
    assert ring.values[:, 0, :, 0].tolist() == [[0, 7, 2, 3], [12, 13, 17, 0]]
    assert ring._rows.tolist() == [[0], [3]]

    departed = ring.note(4, tokens(8), capacity=8, departures=True)  # row 0's oldest leaves, row 1 fills its last entry
    assert departed.slots[:, 0].tolist() == [[0], [-1]]
    assert ring.slots[:, 0].tolist() == [[4, 1, 2, 3], [2, 3, 1, 4]]

    for path in (contextlib.nullcontext, cpu_kernels.portable):  # the CPU kernel, then the path a GPU takes
        with path():
            keys, _ = ring.overlay(torch.full((2, 1, 5, 1), -1.0), torch.full((2, 1, 5, 1), -1.0), 5)
        assert keys[:, 0, :, 0].tolist() == [[-1, 7, 2, 3, 8], [-1, 17, 12, 13, 18]]
