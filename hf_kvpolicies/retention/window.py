"""Ring retention: the ``sinks`` first tokens plus the ``window`` most recent ones.

With ``sinks=0`` this is a sliding window; with ``sinks>0`` it is the StreamingLLM layout.
The buffer has ``sinks + window + 1`` slots: one more than is kept, so that a decode step
writes its token over the one leaving the window *in place* and still attends to
``sinks + window`` kept tokens plus itself. Slots ``[0, sinks)`` are never overwritten once
filled; slots ``[sinks, capacity)`` form the ring.

On a model's own sliding-window layers (``band`` set: the model masks each query to the
``band`` tokens before it) a ring that keeps the whole band (``window == band``, no sinks) is
transformers' ``DynamicSlidingWindowLayer`` and rolls back as it does: while past recording is
on (assisted decoding, prompt lookup) it appends without evicting, in position order, and
:meth:`RingRetention.crop` drops the rejected tokens and restricts it to the band again.
"""

from __future__ import annotations

import torch

from ..storage import Storage
from ..storage.base import SlotIndex
from .base import Retention


class RingRetention(Retention):
    """Keeps the first ``sinks`` tokens and the last ``window``; O(1) work per decoded token."""

    keeps_by_position = True

    def __init__(self, window: int, sinks: int = 0, band: int | None = None) -> None:
        """``band``: on a model's sliding-window layer, the tokens before it that a query may see
        (the model's ``sliding_window - 1``), inside multi-token forwards too."""
        super().__init__()
        self.window = window
        self.sinks = sinks
        self.band = band
        self.is_sliding = band is not None
        self.counts.follow_compiled = self.is_sliding
        self._next = 0
        self._slot_t: torch.Tensor | None = None  # static steps: ``_next`` on the device (``[1]`` long)

    @classmethod
    def model_window(cls, sliding_window: int) -> RingRetention:
        """What transformers keeps on a sliding layer of a model trained with ``sliding_window``."""
        return cls(sliding_window - 1, band=sliding_window - 1)

    def within_model_window(self, sliding_window: int) -> Retention | None:
        """The window, capped to what the model's window shows; sinks lie outside it (``None``)."""
        if self.sinks:
            return None
        return RingRetention(min(self.window, sliding_window - 1), band=sliding_window - 1)

    def limit_to(self, positions: int) -> bool:
        if self.sinks + self.window <= positions:
            return False
        self.window = max(1, positions - self.sinks)
        return True

    @property
    def is_croppable(self) -> bool:
        return self.band is not None and self.sinks == 0 and self.window == self.band

    @property
    def ring_capacity(self) -> int:
        return self.sinks + self.window + 1

    def capacity(self, first_chunk: int) -> int:
        return self.ring_capacity

    @property
    def max_length(self) -> int:
        return self.sinks + self.window

    def plan(self, q: int) -> SlotIndex | None:
        if self.record_past:
            return self.live  # in position order, evicting nothing until the next crop
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
        if self.band is None:
            return super().visible(query_pos, key_pos)
        return (query_pos[:, None] - key_pos[None, :]) <= self.band

    def start_recording(self, storage: Storage) -> None:
        """Put the kept tokens in position order first: recorded forwards append after them."""
        super().start_recording(storage)
        if storage.is_allocated:
            self._restrict(storage)

    def update(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, padding=None, query=None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.record_past and self.live > self.ring_capacity:
            self._restrict(storage)  # recording was switched off (transformers does so after generate)
        return super().update(storage, keys, values, padding, query)

    def crop(self, storage: Storage, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens, then keep the band again, as
        ``DynamicSlidingWindowLayer.crop`` does (so ``crop(0)`` may free memory)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove, as DynamicCache does")
        if not self.is_croppable:
            super().crop(storage, tokens_to_remove)
        if not self.record_past and self.seen > self.window and tokens_to_remove < 0:
            raise NotImplementedError(
                "this sliding-window layer has evicted tokens and was not recording them: call "
                "cache.activate_past_recording() before the forwards to roll back (generate() does so "
                "for assisted decoding and prompt lookup)"
            )
        removed = min(-tokens_to_remove, self.live)
        self.live -= removed
        self.seen -= removed
        if self.slot_pos is not None:
            self.slot_pos[self.live :] = -1
            self._restrict(storage)

    def reset(self) -> None:
        super().reset()
        self._next = 0
        self._slot_t = None

    # --- the static decode step -------------------------------------------------------------
    compileable = True
    """On a model's own sliding layer too: once the ring holds ``capacity`` tokens they are the last
    ``capacity`` positions, which transformers' sliding mask shows (see ``PolicyLayer.get_mask_sizes``)."""

    def static_ready(self, storage: Storage) -> bool:
        return storage.is_allocated and not self.record_past and self.seen >= self.sinks and self.live <= self.ring_capacity

    def _enter_static(self, storage: Storage) -> list[torch.Tensor]:
        if self._slot_t is None or self._slot_t.device != storage.device:
            self._slot_t = torch.zeros(1, dtype=torch.long, device=storage.device)
        self._slot_t.fill_(self._next)
        self._entry_next = self._next
        return [self._slot_t]

    def static_write_slots(self, steps: int) -> list[int]:
        """From ``_next`` on, wrapping to the first ring slot after the last (as :meth:`static_step`)."""
        ring = self.ring_capacity - self.sinks
        return [self.sinks + (self._next - self.sinks + step) % ring for step in range(steps)]

    def static_step(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, query=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The token goes to ``_next`` (an append while the ring fills, then the slot of the token
        leaving the window), which then moves on in place, wrapping to the first ring slot."""
        slot = self._slot_t
        storage.write_static(slot, keys, values)
        # the next ring slot, in place: ``sinks + (slot + 1 - sinks) % ring`` (two or three operations)
        slot.add_(1 - self.sinks).remainder_(self.ring_capacity - self.sinks)
        if self.sinks:
            slot.add_(self.sinks)
        self._static_done(storage)
        return storage.read_static()

    def _leave_static(self, storage: Storage, steps: int) -> None:
        """Replay the slots the steps took (only the last ring's worth can still hold their token)."""
        ring = self.ring_capacity - self.sinks
        recent = torch.arange(max(0, steps - ring), steps)
        start = self._entry_next - self.sinks
        self.slot_pos[self.sinks + (start + recent) % ring] = self.counts.entry[0] + recent
        self._next = self.sinks + (start + steps) % ring

    # --- internals ---------------------------------------------------------------------
    def _record(self, slots: SlotIndex, q: int) -> None:
        super()._record(slots, q)
        end = self._end(slots, q)
        self._next = end if end < self.ring_capacity else self.sinks

    def _after_trim(self) -> None:
        self._next = self.live if self.live < self.ring_capacity else self.sinks

    def _restrict(self, storage: Storage) -> None:
        """Keep the last ``window`` tokens, in position order, in a buffer of ``ring_capacity`` slots."""
        kept = self.kept_slots()
        if self.live <= self.ring_capacity and torch.equal(kept, torch.arange(self.live)):
            return  # already in position order and within the ring: nothing to move
        keys, values = storage.gather(kept.to(storage.device))
        positions = self.slot_pos[kept]
        storage.allocate(keys, self.ring_capacity, value_dim=values.shape[-1])
        storage.write(0, keys, values)
        self.slot_pos = torch.full((storage.capacity,), -1, dtype=torch.long)
        self.slot_pos[: kept.numel()] = positions
        self.live = kept.numel()
        self._after_trim()
