"""Ring retention: the ``sinks`` first tokens plus the ``window`` most recent ones.

With ``sinks=0`` this is a sliding window; with ``sinks>0`` it is the StreamingLLM layout.
The buffer has ``sinks + window + 1`` slots: one more than is kept, so that a decode step
writes its token over the one leaving the window *in place* and still attends to
``sinks + window`` kept tokens plus itself. Slots ``[0, sinks)`` are never overwritten once
filled; slots ``[sinks, capacity)`` form the ring.
"""

from __future__ import annotations

import torch

from ..storage.base import SlotIndex
from .base import Retention


class RingRetention(Retention):
    """Keeps the first ``sinks`` tokens and the last ``window``; O(1) work per decoded token."""

    keeps_by_position = True

    def __init__(self, window: int, sinks: int = 0, banded: bool = False) -> None:
        """``banded``: queries also see only the ``window`` tokens before them inside a
        multi-token forward (the semantics of a model's own sliding-window layers)."""
        super().__init__()
        self.window = window
        self.sinks = sinks
        self.banded = banded
        self.is_sliding = banded
        self._next = 0

    @property
    def ring_capacity(self) -> int:
        return self.sinks + self.window + 1

    def capacity(self, first_chunk: int) -> int:
        return self.ring_capacity

    @property
    def max_length(self) -> int:
        return self.sinks + self.window

    def plan(self, q: int) -> SlotIndex | None:
        if self.live + q <= self.ring_capacity and self._next == self.live:
            return self.live  # still filling: append
        if q == 1:
            return self._next  # overwrite the token leaving the window
        return None

    def select(self, positions: torch.Tensor) -> torch.Tensor:
        count = positions.numel()
        if count <= self.max_length:
            return torch.arange(count)
        return torch.cat([torch.arange(self.sinks), torch.arange(count - self.window, count)])

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        if not self.banded:
            return super().visible(query_pos, key_pos)
        return (query_pos[:, None] - key_pos[None, :]) <= self.window

    def _record(self, slots: SlotIndex, q: int) -> None:
        super()._record(slots, q)
        end = self._end(slots, q)
        self._next = end if end < self.ring_capacity else self.sinks

    def _after_trim(self) -> None:
        self._next = self.live if self.live < self.ring_capacity else self.sinks

    def reset(self) -> None:
        super().reset()
        self._next = 0
