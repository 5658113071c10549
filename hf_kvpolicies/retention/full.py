"""Full retention: every token stays, appended in order (the baseline of every comparison)."""

from __future__ import annotations

import torch

from ..storage import Storage
from ..storage.base import SlotIndex
from .base import Retention, grown_capacity
from .window import RingRetention


class FullRetention(Retention):
    """Append-only; the buffer grows by a quarter when full, so appends are amortised O(1) and the
    capacity never exceeds 1.25x the tokens held after the first decode step."""

    is_croppable = True
    in_position_order = True
    keeps_by_position = True

    def capacity(self, first_chunk: int) -> int:
        return grown_capacity(first_chunk)

    def plan(self, q: int) -> SlotIndex:
        return self.live

    def select(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.arange(positions.numel())

    @property
    def max_length(self) -> int:
        return -1

    def within_model_window(self, sliding_window: int) -> Retention:
        """Every token the model's window shows: exactly transformers' ``DynamicSlidingWindowLayer``."""
        return RingRetention.model_window(sliding_window)

    def key_positions(self, q: int) -> torch.Tensor:
        return torch.arange(self.seen + q)

    def crop(self, storage: Storage, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove, as DynamicCache does")
        removed = min(-tokens_to_remove, self.live)
        self.live -= removed
        self.seen -= removed
        if self.slot_pos is not None:
            self.slot_pos[self.live :] = -1
