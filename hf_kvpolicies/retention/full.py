"""Full retention: every token stays, appended in order (the baseline of every comparison)."""

from __future__ import annotations

import torch

from ..storage import Storage
from ..storage.base import SlotIndex
from ..validation import check_int
from .base import Retention
from .window import RingRetention


def checked_sizes(max_length: int | None, block: int | None) -> tuple[int | None, int | None]:
    """``max_length`` and ``block`` of a full cache, checked: each at least 1, at most one given."""
    if max_length is not None:
        max_length = check_int("max_length", max_length, minimum=1)
    if block is not None:
        block = check_int("block", block, minimum=1)
        if max_length is not None:
            raise ValueError(
                f"a full cache takes max_length (a fixed buffer) or block (a buffer that grows by blocks), not both; "
                f"got max_length={max_length} and block={block}"
            )
    return max_length, block


class FullRetention(Retention):
    """Append-only; the buffer grows by a quarter when full, so appends are amortised O(1) and the
    capacity never exceeds 1.25x the tokens held after the first decode step.

    Pre-sized (``max_length`` given, as transformers' ``StaticCache``): the buffer holds
    ``max_length`` slots from the first update and never grows, so decode steps are static
    (compile-able); a forward that would go past it is refused with ``ValueError``.

    In blocks (``block`` given): the buffer holds whole blocks of ``block`` slots and grows by
    whole blocks, before a forward's masks are built (:meth:`make_room`), where the next tokens
    would not fit: decode steps between growths are static (compile-able), and a compiled step is
    captured again for each new size. The host counts follow compiled steps (one recompile makes
    them symbolic), so deciding to grow reads nothing back from the device."""

    is_croppable = True
    in_position_order = True
    keeps_by_position = True

    def __init__(self, max_length: int | None = None, block: int | None = None) -> None:
        super().__init__()
        self.limit = max_length
        self.block = block
        self.counts.follow_compiled = block is not None

    @property
    def compileable(self) -> bool:
        return self.limit is not None or self.block is not None

    @property
    def grows_between_steps(self) -> bool:
        return self.block is not None

    def limit_to(self, positions: int) -> bool:
        """A pre-sized buffer holds at most ``positions`` slots (a growing one grows as tokens come)."""
        if self.limit is None or self.limit <= positions:
            return False
        self.limit = positions
        return True

    def capacity(self, first_chunk: int) -> int:
        """Exactly the first chunk (a prompt costs what ``DynamicCache`` pays; the first decode
        step grows the buffer by a quarter), ``max_length``, or the blocks the chunk fills."""
        if self.limit is not None:
            return self.limit
        return max(1, first_chunk) if self.block is None else self._blocks(first_chunk)

    def _blocks(self, tokens: int) -> int:
        """Slots of the whole blocks that hold ``tokens`` (one block at least)."""
        return max(1, -(-tokens // self.block)) * self.block

    def _grown_capacity(self, capacity: int, end: int) -> int:
        return super()._grown_capacity(capacity, end) if self.block is None else self._blocks(end)

    def make_room(self, storage: Storage, tokens: int) -> None:
        """Grow by whole blocks where the next ``tokens`` would not fit (eagerly: ``generate()`` asks
        for a compiled step's masks before the step); inside a compiled step nothing can grow."""
        if self.block is None or self.live + tokens <= storage.capacity:
            return
        if torch.compiler.is_compiling():
            raise ValueError(
                f"this FullCache(block={self.block}) holds {storage.capacity} slots, all in use, and grows only between "
                "compiled steps: decode with generate() (it grows the cache before each step), or build it with "
                "max_length=... for a compiled loop of your own"
            )
        self._ensure_capacity(storage, self.live, tokens)
        storage.mark_static_tensors()

    def _ensure_capacity(self, storage: Storage, slots: SlotIndex, q: int) -> None:
        if self.limit is not None and self._end(slots, q) > self.limit:
            raise ValueError(
                f"this cache was built with max_length={self.limit} and this forward would bring it to "
                f"{self._end(slots, q)} tokens: build it with a larger max_length (or without one, to grow)"
            )
        super()._ensure_capacity(storage, slots, q)

    def static_ready(self, storage: Storage) -> bool:
        return self.compileable and storage.is_allocated

    def static_write_slots(self, steps: int) -> list[int]:
        """Appends: the slots after the last token."""
        return list(range(self.seen, self.seen + steps))

    def static_step(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, query=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The token goes to slot ``seen``, as in ``StaticCache``."""
        if self.block is not None:
            self.make_room(storage, 1)  # (done already where masks were built)
        elif not torch.compiler.is_compiling() and self.live >= self.limit:
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
