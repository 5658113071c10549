"""What a statistic scores: the keys one forward attends to, and a forward waiting for its trim;
and how a statistic makes copies of one token score alike (:func:`rounded`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..storage.base import SlotIndex


@dataclass
class Attended:
    """What one forward attends to, handed to :meth:`ScoredRetention.score`.

    ``keys`` are the keys attention sees (``[batch, kv_heads, k, head_dim]``); query ``i`` of the
    ``q`` new ones sits at key index ``first_new + i`` for causality; ``new_keys`` are the
    incoming keys as the model computed them (before any storage rounding), held at ``new_slots``
    of ``keys`` (a start index, or ``[batch, kv_heads, 1]`` for a decode step written in place);
    ``query`` holds the new queries (only the last ``query_rows`` where the statistic sets it),
    ``None`` for statistics that need no queries (before their rotation where the statistic sets
    ``queries_before_rope``).
    ``key_mask``/``query_mask`` mark real tokens (``None``: every key and query is real);
    ``positions`` ``[batch, kv_heads, k]`` is the position each key holds (``-1``: none);
    ``new_values`` are the incoming values as the model computed them, beside ``new_keys``.
    ``first_position``: the position of the first new token (all rows share it; a device count in
    a static step, whose host count is frozen when compiled).
    ``values`` and ``output``: where the cache asks a statistic that computes every query's
    probabilities over ``keys`` (:meth:`ScoredRetention.computes_attention`) for attention's
    output too, the values attention sees and the buffer the statistic writes that output into
    (:func:`~hf_kvpolicies.attention_scores.new_attention_output`); ``None`` otherwise.
    """

    keys: torch.Tensor
    new_keys: torch.Tensor
    first_new: int
    new_slots: SlotIndex
    query: torch.Tensor | None = None
    scaling: float = 1.0
    key_mask: torch.Tensor | None = None
    query_mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    new_values: torch.Tensor | None = None
    values: torch.Tensor | None = None
    output: torch.Tensor | None = None
    first_position: int | torch.Tensor = 0

    @property
    def q(self) -> int:
        return self.keys.shape[-2] - self.first_new

    def new_positions(self) -> torch.Tensor:
        """``[batch, kv_heads, q]`` positions of the new keys (``-1`` for pads)."""
        if isinstance(self.new_slots, int):
            return self.positions[..., self.new_slots : self.new_slots + self.q]
        return self.positions.gather(-1, self.new_slots)

    def write_new(self, target: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``target`` ``[batch, kv_heads, ..., k]`` (scores or per-slot state over the keys seen) with
        the new keys' ``values`` ``[batch, kv_heads, ..., q]`` written at their slots, in place."""
        if isinstance(self.new_slots, int):
            target[..., self.new_slots : self.new_slots + values.shape[-1]] = values
            return target
        return target.scatter_(-1, slot_index(self.new_slots, target), values)


def out_for(scores: torch.Tensor) -> torch.Tensor | None:
    """``scores`` as the ``out=`` of a statistic that replaces them (a decode step then writes the
    layer's scores in place instead of copying them there), or ``None`` in a forward that takes
    gradients (``out=`` takes no part in autograd)."""
    return None if torch.is_grad_enabled() else scores


def slot_index(slots: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``slots`` (``[batch, kv_heads, n]``) as the last-axis scatter index of ``target``
    (``[batch, kv_heads, ..., k]``: scores, positions or per-slot state); for per-slot tensors the
    slots themselves (a decode step pays for every view)."""
    if slots.shape[:-1] == target.shape[:-1]:
        return slots
    index = slots.view(*slots.shape[:2], *[1] * (target.dim() - 3), -1)
    return index.expand(*target.shape[:-1], index.shape[-1])


@dataclass
class Pending:
    """A scored forward waiting for its trim: every key it attended to (as the storage will hold
    them), with positions and scores, and the same keys as they arrived, which the trim stores."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    arrived: tuple[torch.Tensor, torch.Tensor] | None = None
    """Keys and values to store where they differ from what attention saw (``None``: the same)."""

    @property
    def to_store(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.arrived if self.arrived is not None else (self.keys, self.values)


SCORE_BITS = 12
"""Significant bits of a rounded score: a relative step of 2**-12 (2.4e-4), far above fp32's noise
(a few units of 2**-24) and far below the spread of distinct keys' statistics."""


def rounded(scores: torch.Tensor, bits: int = SCORE_BITS, out: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` rounded to ``bits`` significant bits (half away from zero), exactly, in their own
    dtype; a format with no more significant bits is returned as it is.

    A statistic of a key alone (its norm, its direction) is the same for copies of one token in
    exact arithmetic (a generation loop repeats a token; the first layer's keys are a projection
    of the token's embedding, rotated), but in fp32 it differs in the last bits with the
    position's rotation and the batch's shape (a projection of 3 rows rounds differently from one
    of 1). Unrounded, such ties are broken by that noise, so a row of a padded batch would keep
    other copies than the row alone; rounded, they are exact ties, which the shared rule breaks by
    age (the oldest copy goes first).

    Two integer operations on the bits (half a unit of the last kept bit added, the bits below it
    cleared; a carry into the exponent is the round up to the next power of two): a decode step
    pays for every operation. Subnormal scores keep fewer significant bits. ``out``: where to
    write them (of ``scores``' dtype; ``scores`` itself rounds them in place)."""
    drop = round(-math.log2(torch.finfo(scores.dtype).eps)) + 1 - bits  # significant bits beyond ``bits``
    if drop <= 0:
        return scores if out is None else out.copy_(scores)
    as_int = _SAME_WIDTH_INT[scores.element_size()]
    if out is scores:  # the statistic wrote them there: round in place
        scores.view(as_int).add_(1 << (drop - 1)).bitwise_and_(-(1 << drop))
        return scores
    if out is not None:
        torch.bitwise_and(scores.view(as_int) + (1 << (drop - 1)), -(1 << drop), out=out.view(as_int))
        return out
    return ((scores.view(as_int) + (1 << (drop - 1))) & -(1 << drop)).view(scores.dtype)


_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
