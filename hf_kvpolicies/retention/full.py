"""Full retention: every token stays, appended in order (the baseline of every comparison)."""

from __future__ import annotations

import torch

from ..storage import Storage
from ..storage.base import SlotIndex
from .base import Retention
from .window import RingRetention


class FullRetention(Retention):
    """Append-only; the buffer grows by a quarter when full, so appends are amortised O(1) and the
    capacity never exceeds 1.25x the tokens held after the first decode step.

    Pre-sized (``max_length`` given, as transformers' ``StaticCache``): the buffer holds
    ``max_length`` slots from the first update and never grows, so decode steps are static
    (compile-able); a forward that would go past it is refused with ``ValueError``."""

    is_croppable = True
    in_position_order = True
    keeps_by_position = True

    def __init__(self, max_length: int | None = None) -> None:
        super().__init__()
        self.limit = max_length

    @property
    def compileable(self) -> bool:
        return self.limit is not None

    def limit_to(self, positions: int) -> bool:
        """A pre-sized buffer holds at most ``positions`` slots (a growing one grows as tokens come)."""
        if self.limit is None or self.limit <= positions:
            return False
        self.limit = positions
        return True

    def capacity(self, first_chunk: int) -> int:
        """Exactly the first chunk (a prompt costs what ``DynamicCache`` pays); the first decode
        step grows the buffer by a quarter."""
        return max(1, first_chunk) if self.limit is None else self.limit

    def _ensure_capacity(self, storage: Storage, slots: SlotIndex, q: int) -> None:
        if self.limit is not None and self._end(slots, q) > self.limit:
            raise ValueError(
                f"this cache was built with max_length={self.limit} and this forward would bring it to "
                f"{self._end(slots, q)} tokens: build it with a larger max_length (or without one, to grow)"
            )
        super()._ensure_capacity(storage, slots, q)

    def static_ready(self, storage: Storage) -> bool:
        return self.limit is not None and storage.is_allocated

    writes_shared_slots = True

    def static_write_slots(self, steps: int) -> list[int]:
        """Appends: the slots after the last token."""
        return list(range(self.seen, self.seen + steps))

    def static_step(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, query=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The token goes to slot ``seen``, as in ``StaticCache``."""
        if not torch.compiler.is_compiling() and self.live >= self.limit:
            self._ensure_capacity(storage, self.live, 1)  # refused with the reason
        storage.write_static(self.seen_t.view(1), keys, values)
        self._static_done(storage)
        return storage.read_static()

    def _leave_static(self, storage: Storage, steps: int) -> None:
        self.slot_pos[: self.live] = torch.arange(self.live)

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
