"""Sink retention: the StreamingLLM layout of :class:`RingRetention`, made exact under RoPE and padding.

Two things a plain ring with ``sinks > 0`` does not do:

* **In-cache positions** (``rotary`` given; the paper's §3.2). Keys are stored rotated at their
  absolute position and queries arrive rotated at theirs, so a sink at position ``i`` would sit
  thousands of positions back. RoPE is relative: rotating the sinks by ``e``, the number of
  tokens the forward's keys leave out (evicted so far), puts sink ``i`` at ``i + e``, just
  before the oldest window token, while every window distance stays true. Each step rotates
  the ``sinks`` keys from a copy taken as they arrived (never a rotated key rotated again, so
  no rounding piles up over a long stream) and writes them through the storage: O(sinks). Every
  layer of a type has seen the same tokens, so a static step's rotation is the same in each: the
  first layer computes its cos and sin and the others reuse them (:class:`SharedRotation`).
* **Padded rows.** The sinks are each row's first ``sinks`` *real* tokens, so a left-padded row
  keeps what it would keep alone. The ring is shared by all rows (it evicts by position, which
  is already right for every row); a row with ``p`` leading pads has pads in its first
  ``min(p, sinks)`` sink slots, and slot ``j`` of that row receives the token at position
  ``j + max(p, sinks)`` (one of the row's sinks) as it arrives. The slot stays masked until that
  token leaves the ring, so no token is ever seen twice. The pad count comes from the first
  forward's padding; rotation offsets are per row (``e - p``, the row's own evictions). Where the
  storage holds each row's tokens apart (:attr:`~hf_kvpolicies.storage.base.Storage.holds_rows_apart`:
  integer codes grouped per channel, a native residual of each row's newest tokens), each displaced
  sink is stored in its sink slot as it arrives, where the row alone writes it, and its copy in
  the ring is hidden: those that come with the prompt are seen there from the next forward on,
  those that come later (a row with fewer real tokens than ``sinks``) at once.
"""

from __future__ import annotations

import torch

from ..rope import Rotary
from ..storage import Storage
from ..storage.base import SlotIndex, expand_slots
from .window import RingRetention


class SharedRotation:
    """A static step's sink rotation (cos and sin of the evictions so far), computed by the first
    sink layer of a layer type (its leader, the first to join) and reused by the later ones in the
    same forward. The leader clears it in every forward that is not a static step, so a later layer
    never reads a rotation from another step."""

    def __init__(self) -> None:
        self.leader: SinkRetention | None = None
        self.cos_sin: tuple[int, torch.Tensor, torch.Tensor] | None = None
        """``(ring capacity, cos, sin)`` of this step, once the leader has taken it."""

    def join(self, retention: SinkRetention) -> bool:
        """Register a layer's retention (in layer order); whether it leads."""
        if self.leader is None:
            self.leader = retention
        return self.leader is retention


class SinkRetention(RingRetention):
    """``sinks`` first real tokens per row plus the ``window`` most recent, optionally re-rotated."""

    def __init__(self, window: int, sinks: int, rotary: Rotary | None = None, shared: SharedRotation | None = None) -> None:
        """``rotary``: re-rotate the sinks to in-cache positions with it; ``None`` keeps absolute
        positions. ``shared``: the rotation shared with the other layers of this type."""
        super().__init__(window, sinks=sinks)
        self.rotary = rotary
        self.shared = shared or SharedRotation()
        self.leads = self.shared.join(self)
        self.pads: torch.Tensor | None = None
        """Leading pads per row (``LongTensor[batch]`` on the CPU), once a padded batch was seen."""
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        """The sinks of every row as they arrived (``[batch, heads, sinks, head_dim]``)."""
        self._padded = False
        self._pins_end = 0  # positions below which every row's displaced sinks have arrived
        self._stale = False  # sink copies changed since they were last written to the storage
        self._offset: int | torch.Tensor = 0  # rotation the stored sinks carry
        self._sink_turned: torch.Tensor | None = None  # static steps: rotate_half of the sinks as they arrived
        self._attend_first = False
        """A padded batch's prompt, where displaced sinks are stored on arrival: each row's are
        stored in its sink slots with the prompt, where the row alone holds them, so the prompt is
        attended as it came, then stored (:meth:`plan`)."""
        self._on_arrival = False
        """Displaced sinks go to their sink slots as they arrive (a padded batch in a storage that
        holds rows apart): see the module."""

    @property
    def keeps_by_position(self) -> bool:
        """Re-rotated sinks are not kept as they arrived."""
        return self.rotary is None

    @property
    def _tracking(self) -> bool:
        return self.sinks > 0 and (self.rotary is not None or self._padded)

    def update(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, padding=None, query=None) -> tuple[torch.Tensor, torch.Tensor]:
        if padding is not None and self.pads is None:  # the first forward of a padded batch
            self.pads = (padding.cumsum(-1) == 0).sum(-1).cpu()
            self._padded = bool(self.pads.any())
            self._pins_end = int(self.pads.max()) + self.sinks  # a row's displaced sinks end at pads + sinks
        if self.leads:
            self.shared.cos_sin = None  # not a static step: no layer reuses a rotation in this forward
        if not self._tracking:
            return super().update(storage, keys, values, padding, query)
        q = keys.shape[-2]
        if self.seen == 0:
            self._on_arrival = self._padded and storage.holds_rows_apart
        late = self._on_arrival and self.seen > 0 and bool(self._arriving(q).any())
        if late and q > 1:
            raise ValueError(
                f"a multi-token forward brings sinks of a padded row that had fewer than sink_tokens={self.sinks} real "
                "tokens before it, and this storage holds each row's tokens apart (a native residual, keys grouped "
                "per channel): its queries would see those sinks before they arrive. Prefill the padded batch in "
                "one forward (or in chunks that reach every row's first sink_tokens real tokens), or decode one "
                "token per forward until then"
            )
        self._capture(keys, values)
        if late:
            self._store_arrivals(storage)
        # tokens this forward's keys leave out: the sinks must sit just before the oldest kept one
        evicted = self.seen + q - self.returned_length(q)
        self._write_sinks(storage, evicted)  # before the read or gather that attention uses
        self._attend_first = self._on_arrival and self.seen == 0 and q > self.sinks
        if self._attend_first:
            keys, values = self._sinks_in_place(keys, values)
        try:
            out = super().update(storage, keys, values, padding, query)
        finally:
            self._attend_first = False
        if self._stale:  # displaced sinks that arrived before all sink slots were filled
            self._write_sinks(storage, evicted)
        return out

    # --- the static decode step (unpadded batches) ---------------------------------------------
    def static_ready(self, storage: Storage) -> bool:
        return super().static_ready(storage) and not self._padded and not self._stale

    def _enter_static(self, storage: Storage) -> list[torch.Tensor]:
        self._sink_slots = torch.arange(self.sinks, device=storage.device)
        if self.rotary is not None:
            self.rotary.prepare_cos_sin(storage.device, self.sink_keys.shape[-1])
            self._sink_turned = self.rotary.turned(self.sink_keys)
        return super()._enter_static(storage)

    def static_step(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, query=None) -> tuple[torch.Tensor, torch.Tensor]:
        """In-cache positions: the sinks' keys are rewritten every step, rotated by the evictions so
        far (a device offset: cos and sin built on the device, or taken from the layer type's
        leader, applied elementwise to the sinks as they arrived and their ``rotate_half``, taken
        once when static steps began); their values stay as they are."""
        if self.rotary is not None:
            cos, sin = self._step_rotation()
            sink_keys = torch.addcmul(self.sink_keys * cos, self._sink_turned, sin).to(self.sink_values.dtype)
            storage.rewrite_keys_static(self._sink_slots, sink_keys, self.sink_values)
        return super().static_step(storage, keys, values, query)

    def _step_rotation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos and sin of this static step's rotation: the leader's where it has taken one for a
        ring of this size, else computed (and, by the leader, shared)."""
        shared = self.shared.cos_sin
        if not self.leads and shared is not None and shared[0] == self.ring_capacity:
            return shared[1], shared[2]
        evicted = (self.seen_t + (1 - self.ring_capacity)).clamp_(min=0)
        cos, sin = self.rotary.cos_sin(evicted, self.sink_keys.shape[-1])
        if self.leads:
            self.shared.cos_sin = (self.ring_capacity, cos, sin)
        return cos, sin

    def _leave_static(self, storage: Storage, steps: int) -> None:
        super()._leave_static(storage, steps)
        if self.rotary is not None and steps:
            self._offset = max(0, self.seen - self.ring_capacity)  # the last step's rotation

    def plan(self, q: int) -> SlotIndex | None:
        return None if self._attend_first else super().plan(q)

    @property
    def ranks_each_token(self) -> bool:
        """While displaced sinks still arrive one token at a time, their ring copies are ranked out."""
        return self._on_arrival and self.seen < self._pins_end

    def write_ranks(self, padding: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
        """A padded row's tokens in the order the row alone writes them: its sinks first, in its own
        order (sink slot ``j`` holds the row's sink ``(j - min(p, sinks)) mod sinks``), then the
        ring's tokens by position, leaving out pads and the ring's copies of displaced sinks (a row
        alone holds each sink once, in its sink slot)."""
        if padding is None or not self._padded:
            return super().write_ranks(padding, positions)
        device, sinks = padding.device, self.sinks
        pads = self.pads.to(device).view(-1, 1)
        position = positions.to(device).view(1, -1)
        real = padding[:, positions.to(device)].to(torch.bool)
        displaced_from = pads.clamp(min=sinks)  # where a row's sinks beyond the sink slots begin
        placed = int(positions.max()) + 1 if self._on_arrival else 0  # sinks arrived by this write's end
        in_sink_slot = position < sinks
        placed_with_prompt = (position < pads) & (position + displaced_from < placed)
        ring_copy = (position >= displaced_from) & (position < pads + sinks) & (position < placed)
        held = torch.where(in_sink_slot, real | placed_with_prompt, real & ~ring_copy)
        order = torch.where(in_sink_slot, (position - pads.clamp(max=sinks)).remainder(sinks), sinks + position)
        rank = order.masked_fill(~held, sinks + int(positions.max()) + 1).argsort(dim=-1).argsort(dim=-1)
        return rank.masked_fill(~held, -1)

    def real_keys(self, padding: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """A padded row's displaced sinks are seen once each: those stored with the prompt in its
        sink slots (where the row alone holds them), their copies in the ring hidden; any later
        one in the ring while it stays there, then in its sink slot."""
        real = super().real_keys(padding, key_pos)
        if not self._padded or key_pos.numel() <= self.sinks:
            return real
        sinks, pads = self.sinks, self.pads[:, None]
        displaced_from = pads.clamp(min=sinks)
        slot = torch.arange(sinks)
        received = displaced_from + slot
        ring = key_pos[sinks:]
        floor = int(ring[ring >= 0].min())
        placed = int(key_pos.max()) + 1 if self._on_arrival else 0  # stored on arrival: by this forward's end
        shown = (slot < pads) & torch.where(received < placed, True, received < floor)
        copies = (ring >= displaced_from) & (ring < pads + sinks) & (ring < placed)
        real[:, :sinks] |= shown.to(real.device)
        real[:, sinks:] &= ~copies.to(real.device)
        return real

    def reorder(self, batch_index: torch.Tensor) -> None:
        super().reorder(batch_index)
        if self.sink_keys is not None:
            index = batch_index.to(self.sink_keys.device)
            self.sink_keys = self.sink_keys.index_select(0, index)
            self.sink_values = self.sink_values.index_select(0, index)
        if self.pads is not None:
            self.pads = self.pads.index_select(0, batch_index.cpu())
            if isinstance(self._offset, torch.Tensor):
                self._offset = self._offset.index_select(0, batch_index.cpu())

    def reset(self) -> None:
        super().reset()
        if self.leads:
            self.shared.cos_sin = None
        self.pads = self.sink_keys = self.sink_values = self._sink_turned = None
        self._padded, self._pins_end, self._stale, self._offset, self._on_arrival = False, 0, False, 0, False

    @property
    def state_nbytes(self) -> int:
        held = [self.sink_keys, self.sink_values, self.pads, self._sink_turned]
        return super().state_nbytes + sum(t.nbytes for t in held if t is not None)

    # --- internals ---------------------------------------------------------------------
    def _arriving(self, q: int) -> torch.Tensor:
        """``bool [batch, sinks]``: the displaced sinks that this forward's ``q`` tokens bring."""
        slot = torch.arange(self.sinks)
        position = self.pads.clamp(min=self.sinks)[:, None] + slot
        return (slot < self.pads[:, None]) & (position >= self.seen) & (position < self.seen + q)

    def _capture(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy the arriving tokens that are sinks: positions ``< sinks``, and displaced ones."""
        start, q, sinks = self.seen, keys.shape[-2], self.sinks
        if self.sink_keys is None:
            batch, heads, _, head_dim = keys.shape
            # at least float32, so the per-step rotation needs no conversion of its input
            dtype = torch.promote_types(keys.dtype, torch.float32)
            self.sink_keys = keys.new_zeros(batch, heads, sinks, head_dim, dtype=dtype)
            self.sink_values = values.new_zeros(batch, heads, sinks, values.shape[-1])
        if start < sinks:
            count = min(sinks, start + q) - start
            self.sink_keys[:, :, start : start + count] = keys[:, :, :count]
            self.sink_values[:, :, start : start + count] = values[:, :, :count]
        if not self._padded or start >= self._pins_end:
            return
        arriving = self._arriving(q)
        if arriving.any():
            rows, slots = arriving.nonzero(as_tuple=True)
            source = (self.pads[rows].clamp(min=sinks) + slots - start).to(keys.device)
            rows, slots = rows.to(keys.device), slots.to(keys.device)
            self.sink_keys[rows, :, slots] = keys[rows, :, source].to(self.sink_keys.dtype)  # kept in >= fp32
            self.sink_values[rows, :, slots] = values[rows, :, source]
            self._stale = True

    def _sinks_in_place(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A padded batch's first forward: each row's displaced sinks that have arrived take its sink
        slots' places in what is stored (those slots are masked while the sinks' own copies stay in
        the ring, and the prompt's attention reads the forward's keys), so the storage holds them
        from the first write, unrotated, as a row alone holds its sinks then."""
        sinks = self.sinks
        self._stale = False  # the others are stored as they arrive
        shown = self._arriving(keys.shape[-2]).to(keys.device)[:, None, :, None]
        sink_keys = torch.where(shown, self.sink_keys.to(keys.dtype), keys[:, :, :sinks])
        sink_values = torch.where(shown, self.sink_values, values[:, :, :sinks])
        return torch.cat([sink_keys, keys[:, :, sinks:]], dim=-2), torch.cat([sink_values, values[:, :, sinks:]], dim=-2)

    def _store_arrivals(self, storage: Storage) -> None:
        """A one-token forward's displaced sink goes to its sink slot now, as the row alone writes
        it: pushed into its residual and placed in its key groups (``ranks`` 0), while every other
        row rewrites its first sink slot as it holds it (``ranks`` -1: nothing moves)."""
        arriving = self._arriving(1)  # [batch, sinks]: at most one slot per row
        batch, heads = self.sink_values.shape[:2]
        slot = arriving.long().argmax(dim=-1).to(self.sink_values.device)  # slot 0 for the other rows
        index = slot.view(batch, 1, 1).expand(batch, heads, 1)
        held = self.sink_keys if self.rotary is None else self.rotary.rotate(self.sink_keys, self._offset)
        keys = held.gather(2, expand_slots(index, held)).to(self.sink_values.dtype)
        values = self.sink_values.gather(2, expand_slots(index, self.sink_values))
        ranks = arriving.any(dim=-1).long().sub(1).view(batch, 1, 1)
        storage.write(index, keys, values, ranks=ranks)
        self._stale = False

    def _write_sinks(self, storage: Storage, evicted: int) -> None:
        """Write the sinks, rotated by each row's own evictions, unless the storage has them already."""
        if self.seen < self.sinks:
            return  # the sink slots are still being filled by ordinary writes
        if self.rotary is None:
            offset: int | torch.Tensor = 0
        elif self._padded:
            offset = (evicted - self.pads).clamp(min=0)
        else:
            offset = max(0, evicted)
        if not self._stale and _same(offset, self._offset):
            return
        keys = self.sink_keys if self.rotary is None else self.rotary.rotate(self.sink_keys, offset)
        if keys.dtype != self.sink_values.dtype:
            keys = keys.to(self.sink_values.dtype)
        storage.rewrite(0, keys, self.sink_values)
        self._offset, self._stale = offset, False


def _same(a: int | torch.Tensor, b: int | torch.Tensor) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
