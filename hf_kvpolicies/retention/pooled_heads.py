"""Head-wise budgets: the KV heads of a layer share its budget, with the memory really freed.

With ``head_budgets="adaptive"`` a layer's ``heads x budget`` kept tokens go to whichever of its
KV heads' tokens rank best (AdaKV, Feng et al., 2024; KVzip's head-level ranking), so one head
may keep 500 tokens and another 30. Holding that in ``[batch, heads, slots, dim]`` would cost the
busiest head's count for every head (kvpress masks instead, and frees nothing). So the layer's
storage is *pooled*: one tensor ``[batch, 1, heads x (budget + 1), dim]``, each slot owned by
one head. The retention keeps per-head views of its state, ``[batch, heads, slots]``, where a
slot holds a position only in its owner's row (``-1`` elsewhere), so every per-head rule
(masks, scores, selection smoothing) reads it unchanged. Attention sees the pooled slots
expanded to every head (a view, no copy) under a per-head mask that shows each head its own.

This module holds the two decisions that differ from the per-head layout, as pure functions of
``positions`` and ranking scores ``[batch, heads, k]`` (``-inf``: no token, ``+inf``: protected):
which tokens a trim keeps, best first (:func:`pooled_ranking`) and which slots a decode step frees
(:func:`pooled_victims`). Ties go as in the per-head layout: a trim keeps the newest, an eviction
takes the oldest, and among copies of one position the lower head index stays (trim) or goes
(eviction) first.
"""

from __future__ import annotations

import functools

import torch


def pooled_ranking(positions: torch.Tensor, ranked: torch.Tensor) -> torch.Tensor:
    """``[batch, heads x k]`` indices into the flattened candidates in the order a trim keeps them:
    the best ranks of every head together, the newest position, then the lower head index among ties."""
    flat_positions, flat_ranked = positions.flatten(1), ranked.flatten(1)
    order = flat_positions.argsort(dim=-1, descending=True, stable=True)  # head-major, so lower heads first
    return order.gather(-1, flat_ranked.gather(-1, order).argsort(dim=-1, descending=True, stable=True))



def pooled_victims(positions: torch.Tensor, ranked: torch.Tensor, count: int) -> torch.Tensor:
    """``[batch, count]`` pooled slots to free: empty slots first, then the lowest rank of any
    head, the oldest position, the lower head index among ties. ``positions``/``ranked`` are the
    per-head views of the pooled slots (a slot is owned by the head whose row holds a position;
    ``ranked`` is ``-inf`` wherever ``positions`` is ``-1``, as ``_evictable`` leaves it)."""
    heads = positions.shape[1]
    head = _head_numbers(heads, positions.device)
    # one row owns a slot, the others hold -1 there: the largest over heads is the owner's
    # (position * heads + head + 1) and rank; a slot nobody owns gets key 0 and rank -inf
    slot_key = (positions * heads).add_(head).amax(dim=1)
    # (rank, position, head) as one int64 per slot, so that one top-k orders them: the fp32 rank's
    # bits made monotone (a negative float's magnitude bits flipped by its sign, shifted out to
    # all ones; + 0.0 turns -0.0 into 0.0) above the slot key (in place where the tensor is ours:
    # a decode step pays for every operation)
    bits = ranked.amax(dim=1).add_(0.0).view(torch.int32)
    monotone = bits.bitwise_xor((bits >> 31).bitwise_and_(0x7FFFFFFF)).to(torch.int64)
    return monotone.mul_(2**32).add_(slot_key).topk(count, dim=-1, largest=False).indices


@functools.lru_cache(maxsize=16)
def _head_numbers(heads: int, device: torch.device) -> torch.Tensor:
    """``[1, heads, 1]``: 1, ..., heads (made once per device: a decode step pays for every operation)."""
    return torch.arange(1, heads + 1, device=device).view(1, heads, 1)


def owned_by_head(values: torch.Tensor, head: torch.Tensor, heads: int, fill: float | int) -> torch.Tensor:
    """Per-head view ``[batch, heads, *middle, n]`` of pooled ``values`` ``[batch, *middle, n]``
    whose slot ``j`` belongs to ``head[:, j]``: the value in the owner's row, ``fill`` elsewhere."""
    batch, n = head.shape
    middle = values.shape[1:-1]
    out = values.new_full((batch, heads, *middle, n), fill)
    index = head.view(batch, 1, *[1] * len(middle), n).expand(batch, 1, *middle, n)
    return out.scatter_(1, index, values.unsqueeze(1))


def take_flat(source: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``source`` ``[batch, heads, *middle, k]`` at the flattened ``heads x k`` indices ``chosen``
    ``[batch, n]``: ``[batch, *middle, n]``."""
    batch, n = chosen.shape
    flat = source.movedim(1, -2).flatten(-2)  # [batch, *middle, heads * k]
    middle = flat.shape[1:-1]
    return flat.gather(-1, chosen.view(batch, *[1] * len(middle), n).expand(batch, *middle, n))
