"""Full retention: every token stays, appended in order (the baseline of every comparison)."""

from __future__ import annotations

import torch

from ..storage.base import SlotIndex
from .base import Retention

MIN_CAPACITY = 256
"""Slots allocated at the first update at least; the buffer then doubles when full."""


class FullRetention(Retention):
    """Append-only; storage grows geometrically so appends are amortised O(1)."""

    is_croppable = True
    in_position_order = True
    keeps_by_position = True

    def capacity(self, first_chunk: int) -> int:
        return max(MIN_CAPACITY, first_chunk)

    def plan(self, q: int) -> SlotIndex:
        return self.live

    def select(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.arange(positions.numel())

    @property
    def max_length(self) -> int:
        return -1

    def key_positions(self, q: int) -> torch.Tensor:
        return torch.arange(self.seen + q)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove, as DynamicCache does")
        removed = min(-tokens_to_remove, self.live)
        self.live -= removed
        self.seen -= removed
        if self.slot_pos is not None:
            self.slot_pos[self.live :] = -1
