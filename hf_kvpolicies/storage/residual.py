"""The native residual: the most recently written tokens of a slot-addressed storage, also held
in the model's own precision (KIVI's residual), so that reads return them exactly.

A ring of native copies, each with the slot it shadows, filled in write order (write recency, not
slot order). A write to slots that the ring already shadows (a re-rotated sink, a ring retention
smaller than the residual) refreshes those copies in place rather than pushing fresher tokens out,
and a :meth:`NativeResidual.note` with ``push=False`` (a rewrite: no new token) only refreshes.

Keys and values are held side by side, ``[batch, kv_heads, size, key_dim + value_dim]``, so each
push, refresh and reorder is one operation for both. A storage that must act on the tokens leaving
the ring (the quantised storage codes their key groups then) asks :meth:`NativeResidual.note` and
:meth:`NativeResidual.write_static` for the entries each push overwrites (:class:`Departed`).

**Rows apart.** In a padded batch each row keeps what it keeps alone: the first write that ranks
its tokens (:meth:`~.base.Storage.write`'s ``ranks``) gives every row and head a ring position of
its own (:meth:`NativeResidual.part_rows`), on the device, and from then on each row pushes only its
real tokens, in rank order, and decides for itself whether a write only refreshes what it shadows.

A read returns the shadowed slots natively, so a storage need not encode a token while the ring
holds it: :class:`PendingTokens` keeps the slots whose encoding waits, and encodes them in one
batch when the first of them leaves the ring (one encoding per ``size + 1`` appends instead of one
per token, each a few dozen small operations per layer and step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cpu_kernels
from .base import SlotIndex, UpcomingSlots, allocated, expand_slots, ranks_per_row, slots_per_row


@dataclass
class Departed:
    """Ring entries a push overwrote: the slot each shadowed (``[batch, heads, n]``, ``-1`` where the
    entry was in no use or was not overwritten) and its native content ``[batch, heads, n, width]``.
    ``host_slots``: the same slots as host ints where every write so far named ``int`` slots."""

    slots: torch.Tensor
    values: torch.Tensor
    host_slots: list[int] | None = None


class NativeResidual:
    """Native copies of the last ``size`` tokens written to one layer's storage.

    Invariant: every entry in use holds the current content of the slot it shadows (entries that
    shadow one slot agree, so a read may scatter them in any order). Which slots are shadowed is
    known on the host while writes name ``int`` slots (then all rows and heads agree); a per-row
    tensor of slots (H2O) stays on the device, and such a write always pushes.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: torch.Tensor | None = None
        """``[batch, heads, size, key_dim + value_dim]`` in the model's dtype: the latest writes."""
        self.slots: torch.Tensor | None = None
        """``long [batch, heads, size]``: the slot each entry shadows (``-1``: an entry in no use)."""
        self.key_dim = 0
        self.held = 0  # entries in use (they fill [0, size) in order)
        self._next = 0  # ring position of the next entry
        self.written_end = 0
        """One past the highest slot ever written: reads that cover it need no filter."""
        self._shadowed: list[int] | None = []
        """Host copy of the slot each entry shadows while every write had ``int`` slots; ``None``
        once a per-row tensor of slots was written."""
        self._ring: torch.Tensor | None = None
        """Static steps: the device copy of ``_next`` (0-d long), advanced in place."""
        self._push_always = False  # static steps: push every write (as after per-row writes)
        self._unshadowed = False
        """Static steps: no write lands on a slot an entry shadows (:meth:`enter_static` proved it),
        so a write neither refreshes nor decides whether to push: it pushes."""
        self._all_in_use = False
        """Static steps: every entry was in use when they began, so every entry stays in use."""
        self._paired: tuple[torch.Tensor, torch.Tensor] | None = None
        """Views of ``slots`` and ``values`` shaped for a paired read's scatter (:meth:`overlay`), made
        once per tensor (keys and values equally wide)."""
        self._paired_grad = False  # the grad mode the views were made in
        self._rows: torch.Tensor | None = None
        """``long [batch, heads]``: each row's and head's next ring position, once rows push apart
        (:meth:`part_rows`); then which entries are in use is known on the device only (slot ``-1``:
        in no use), and :attr:`held` is ``size``."""

    def allocate(self, batch: int, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.key_dim = key_dim
        if self.size:
            what = f"the native residual of {self.size} tokens"
            self.values = allocated((batch, heads, self.size, key_dim + value_dim), dtype, device, what)
            self.slots = allocated((batch, heads, self.size), torch.long, device, what, fill=-1)
        self.held = self._next = self.written_end = 0
        self._shadowed = [-1] * self.size
        self._ring = self._rows = None
        self._pair()

    def _pair(self) -> None:
        """Make the views of :attr:`_paired` for the tensors now held."""
        self._paired = None
        self._paired_grad = torch.is_grad_enabled()
        if self.size and 2 * self.key_dim == self.values.shape[-1]:
            native = self.values.unflatten(-1, (2, self.key_dim))
            self._paired = self.slots[..., None, None].expand_as(native), native

    def _paired_views(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:attr:`_paired`, made again where the grad mode changed since (autograd refuses a view
        made under ``no_grad`` whose base was written in place with grad enabled: a cache
        prefilled under ``torch.no_grad()`` and decoded without it)."""
        if self._paired_grad != torch.is_grad_enabled():
            self._pair()
        return self._paired

    @property
    def host_slots(self) -> list[int] | None:
        """The slot each entry in use shadows, where the host knows it (``None`` otherwise)."""
        return None if self._shadowed is None else self._shadowed[: self.held]

    # --- rows apart -------------------------------------------------------------------------
    @property
    def rows_apart(self) -> bool:
        return self._rows is not None

    def part_rows(self) -> None:
        """From now on each row and head pushes on its own (a padded batch: see the module); the
        entries held so far stay, each row's next push where the shared one was."""
        if not self.size or self._rows is not None:
            return
        self._rows = torch.full(self.slots.shape[:2], self._next, dtype=torch.long, device=self.slots.device)
        self._shadowed = None
        self.held = self.size

    def _note_rows(
        self, slots: SlotIndex, fresh: torch.Tensor, push: bool, departures: bool, ranks: torch.Tensor | None
    ) -> Departed | None:
        """:meth:`note` and :meth:`write_static` with rows apart, on the device: entries shadowing a
        written slot take its content; then each row and head pushes the newest ``size`` of its real
        tokens in rank order (``ranks``: ``-1`` for a pad; every token real where ``None``), unless
        the write names shared slots that row already shadows, every one (a row alone refreshes
        them and pushes nothing), or per-row slots (always pushed, as alone)."""
        batch, heads, q = fresh.shape[:3]
        shared = isinstance(slots, int) or slots.dim() == 1
        written = slots_per_row(slots, fresh)
        if q == 1 and ranks is None:
            return self._note_token(written, fresh, push, departures, shared)
        rank = torch.arange(q, device=fresh.device).expand(batch, heads, q) if ranks is None else ranks_per_row(ranks, fresh)
        real = rank >= 0
        match = self.slots.unsqueeze(-1) == written.unsqueeze(-2)  # [batch, heads, size, q]
        refreshed = fresh.gather(2, expand_slots(match.to(torch.uint8).argmax(dim=-1), fresh))
        self.values.copy_(torch.where(match.any(dim=-1, keepdim=True), refreshed, self.values))
        if not push:
            return None
        count = real.sum(dim=-1)  # [batch, heads]
        if shared:  # a row that shadows every slot it writes only refreshed them
            count = count.masked_fill((match.any(dim=-2) | ~real).all(dim=-1), 0)
        taken = count.clamp(max=self.size)
        order = torch.where(real, rank - q, 0)
        arrival = order.argsort(dim=-1)  # each row's real tokens first, in rank order
        ahead = (torch.arange(self.size, device=fresh.device) - self._rows.unsqueeze(-1)).remainder(self.size)
        pushed = ahead < taken.unsqueeze(-1)  # [batch, heads, size]: the entries this push overwrites
        source = arrival.gather(-1, (count - taken).unsqueeze(-1).add(ahead).clamp(max=q - 1))
        departed = Departed(self.slots.masked_fill(~pushed, -1), self.values.clone()) if departures else None
        self.values.copy_(torch.where(pushed.unsqueeze(-1), fresh.gather(2, expand_slots(source, fresh)), self.values))
        self.slots.copy_(torch.where(pushed, written.gather(-1, source), self.slots))
        self._rows.add_(taken).remainder_(self.size)
        return departed

    def _note_token(
        self, written: torch.Tensor, fresh: torch.Tensor, push: bool, departures: bool, shared: bool
    ) -> Departed | None:
        """:meth:`_note_rows` for one token per row (a decode step): the same rules in a few
        operations, each row's entry at its own ring position."""
        match = self.slots == written  # [batch, heads, size]
        self.values.copy_(torch.where(match.unsqueeze(-1), fresh, self.values))
        if not push:
            return None
        at = self._rows.unsqueeze(-1)  # [batch, heads, 1]
        old_slots, old_values = self.slots.gather(-1, at), self.values.gather(2, expand_slots(at, self.values))
        if shared:  # a row that shadows the slot only refreshed it
            kept = match.any(dim=-1, keepdim=True)
            written = torch.where(kept, old_slots, written)
            fresh = torch.where(kept.unsqueeze(-1), old_values, fresh)
        departed = Departed(old_slots.masked_fill(kept, -1) if shared else old_slots, old_values) if departures else None
        self.values.scatter_(2, expand_slots(at, fresh), fresh)
        self.slots.scatter_(-1, at, written)
        self._rows.add_(~kept.squeeze(-1) if shared else 1).remainder_(self.size)
        return departed

    # --- eager writes --------------------------------------------------------------------
    def departing(self, count: int) -> list[int] | None:
        """The slots shadowed by the entries a push of ``count`` would overwrite (``-1``: an entry in
        no use; none while the ring is not full), where the host knows them (``None`` otherwise)."""
        if self._shadowed is None:
            return None
        if self.held + count <= self.size:
            return []
        return [self._shadowed[(self._next + offset) % self.size] for offset in range(count)]

    def note(
        self,
        slots: SlotIndex,
        fresh: torch.Tensor,
        capacity: int,
        push: bool = True,
        departures: bool = False,
        ranks: torch.Tensor | None = None,
    ) -> Departed | None:
        """Keep native copies of ``fresh`` (``[batch, heads, q, width]``) just written to ``slots``.

        Entries whose slot this write overwrites take the new content first. Then the newest
        ``min(q, size)`` tokens are pushed, unless every slot written was shadowed already (a
        rewrite of shadowed slots refreshes them in place and pushes nothing), or ``push`` is false.
        ``departures``: return the entries the push overwrote (``None`` when nothing was pushed).
        ``ranks``: a padded batch's write (:meth:`~.base.Storage.write`): rows push apart from now on.
        """
        q = fresh.shape[-2]
        start, end = (slots, slots + q) if isinstance(slots, int) else (0, capacity)  # device slots may touch any slot
        unwritten = start >= self.written_end  # an append: no entry can shadow these slots
        self.written_end = max(self.written_end, end)
        if not self.size:
            return None
        if ranks is not None:
            self.part_rows()
        if self._rows is not None:
            return self._note_rows(slots, fresh, push, departures, ranks)
        if self.held and not unwritten:
            if self._shadowed is None or not isinstance(slots, int):  # per-row slots: refresh on the device, always push
                self._refresh(slots, fresh)
            else:  # int slots: which entries they hit is known on the host
                held, written = set(self._shadowed[: self.held]), range(slots, slots + q)
                if not held.isdisjoint(written):
                    self._refresh(slots, fresh)
                if held.issuperset(written):
                    return None
        if not push:
            return None
        count = min(q, self.size)
        departed = None
        if departures and self.held + count > self.size:  # entries in use are overwritten
            host = self.departing(count) if isinstance(slots, int) else None
            ring = (self._next + torch.arange(count, device=fresh.device)) % self.size
            departed = Departed(self.slots.index_select(2, ring), self.values.index_select(2, ring), host)
        if count == 1:
            self.values[:, :, self._next] = fresh[:, :, -1]
            if isinstance(slots, int):
                self.slots.narrow(2, self._next, 1).fill_(slots + q - 1)
            else:
                self.slots[:, :, self._next] = slots[..., -1]
        else:
            if isinstance(slots, int):
                tail = torch.arange(slots + q - count, slots + q, device=fresh.device)
            else:
                tail = slots[..., q - count :]
            ring = (self._next + torch.arange(count, device=fresh.device)) % self.size
            self.values[:, :, ring] = fresh[:, :, q - count :]
            self.slots[:, :, ring] = tail
        if self._shadowed is not None and isinstance(slots, int):
            for offset, slot in enumerate(range(slots + q - count, slots + q)):
                self._shadowed[(self._next + offset) % self.size] = slot
        else:
            self._shadowed = None
        self._next = (self._next + count) % self.size
        self.held = min(self.size, self.held + count)
        return departed

    def _refresh(self, slots: SlotIndex, fresh: torch.Tensor) -> None:
        """Entries whose slot this write overwrites take the new content (no read-back: a select)."""
        held = self.slots[:, :, : self.held]
        match = _shadowing(held, slots, fresh.shape[-2])  # [batch, heads, held, q]
        shadowed = match.any(dim=-1)
        source = match.to(torch.uint8).argmax(dim=-1)
        current = self.values[:, :, : self.held]
        new = fresh.gather(2, expand_slots(source, fresh))
        self.values[:, :, : self.held] = torch.where(shadowed[..., None], new, current)

    # --- reads ---------------------------------------------------------------------------
    def overlay(
        self, keys: torch.Tensor, values: torch.Tensor, length: int, paired: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[0, length)`` decoded by the storage, with the shadowed ones made native.
        ``paired``: ``[batch, heads, length, 2, dim]``, a view of ``keys`` and ``values`` decoded
        into one buffer (equal widths), which then take the entries in one scatter. On the CPU,
        unpaired buffers take them in place through :func:`.cpu_kernels.overlay_entries`."""
        if not self.held:
            return keys, values
        if paired is None and cpu_kernels.overlay_entries(keys, values, self.values, self.slots, self.held):
            return keys, values
        if self._rows is not None:  # rows apart: which entries are in use is on the device
            return self.override(keys, values, torch.arange(length, device=keys.device))
        if length >= self.written_end:  # every entry shadows a slot inside the read
            if self.held < self.size:
                self._scatter(keys, values, paired, self.slots[:, :, : self.held], self.values[:, :, : self.held])
            else:
                self._scatter_every_entry(keys, values, paired)
            return keys, values
        return self.override(keys, values, torch.arange(length, device=keys.device))

    def _scatter_every_entry(self, keys: torch.Tensor, values: torch.Tensor, paired: torch.Tensor | None) -> None:
        """Every entry (all in use) written over the decoded slots; paired, through views made once
        (a step pays for every operation)."""
        if paired is not None and (views := self._paired_views()) is not None:
            paired.scatter_(2, *views)
        else:
            self._scatter(keys, values, paired, self.slots, self.values)

    def _scatter(
        self, keys: torch.Tensor, values: torch.Tensor, paired: torch.Tensor | None, slots: torch.Tensor, native: torch.Tensor
    ) -> None:
        """Entries ``native`` (side by side) written in place over the decoded slots ``slots``."""
        if paired is not None:
            native = native.unflatten(-1, (2, self.key_dim))
            paired.scatter_(2, slots[..., None, None].expand_as(native), native)
            return
        native_keys, native_values = self.split(native)
        keys.scatter_(2, expand_slots(slots, keys), native_keys)
        values.scatter_(2, expand_slots(slots, values), native_values)

    def override(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded ``slots`` (``[n]`` or ``[batch, heads, n]``) with the shadowed ones made native."""
        if not self.held:
            return keys, values
        held = self.slots[:, :, : self.held]
        wanted = slots.view(1, 1, -1) if slots.dim() == 1 else slots
        match = wanted.unsqueeze(-1) == held.unsqueeze(-2)  # [batch, heads, n, held]
        found = match.any(dim=-1, keepdim=True)
        entry = match.to(torch.uint8).argmax(dim=-1)
        residual = self.values[:, :, : self.held]
        native_keys, native_values = self.split(residual.gather(2, expand_slots(entry, residual)))
        return torch.where(found, native_keys, keys), torch.where(found, native_values, values)

    def split(self, side_by_side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return side_by_side[..., : self.key_dim], side_by_side[..., self.key_dim :]

    # --- the static decode step ------------------------------------------------------------
    def enter_static(self, device: torch.device, upcoming: UpcomingSlots | None = None) -> None:
        """Static steps begin; ``upcoming`` (where the retention knows them): the slots its
        static writes take, from which :meth:`_never_shadowed` may spare each write its
        refresh and its push decision."""
        if self._ring is None:
            self._ring = torch.zeros((), dtype=torch.long, device=device)
        self._ring.fill_(self._next)
        self._push_always = self._shadowed is None
        self._all_in_use = bool(self.size) and self.held == self.size
        ahead = upcoming(self.size + 1) if self.size and upcoming is not None else None
        self._unshadowed = ahead is not None and self._never_shadowed(ahead)

    def _never_shadowed(self, upcoming: list[int]) -> bool:
        """Whether static writes to ``upcoming`` (the next ``size + 1`` slots, then on with the same
        period: a ring's or an append's) never meet an entry that shadows their slot.

        Every write pushes (nothing is shadowed), so after a write the ring holds the slots of the
        last ``size`` writes and the entries from before static steps whose turn has not come:
        write ``i`` overwrites the entry ``i`` places past the oldest, after comparing its slot
        with it. A write meets no entry iff it names none of the ``size`` writes before it (the
        first ``size + 1`` slots are distinct: a period above ``size``), and no entry from before
        static steps shadows a slot that a write names at or before that entry's turn."""
        if self._shadowed is None or len(set(upcoming)) != len(upcoming):
            return False
        first: dict[int, int] = {}
        for step, slot in enumerate(upcoming):
            first.setdefault(slot, step)
        entries = (self._shadowed[(self._next + offset) % self.size] for offset in range(self.size))
        return all(first.get(slot, self.size + 1) > offset for offset, slot in enumerate(entries) if slot >= 0)

    def static_tensors(self) -> list[torch.Tensor]:
        if not self.size:
            return [self._ring]
        return [self._ring, self.values, self.slots] + ([self._rows] if self._rows is not None else [])

    def write_static(self, slots: torch.Tensor, fresh: torch.Tensor, push: bool, departures: bool = False) -> Departed | None:
        """The rules of :meth:`note`, decided on the device: entries shadowing a written slot take
        its content; a write of shared slots that were all shadowed already pushes nothing.
        ``departures``: return the entries the push overwrote (slot ``-1`` where none was)."""
        if not self.size:
            return None
        if self._rows is not None:
            return self._note_rows(slots, fresh, push, departures, None)
        q = fresh.shape[-2]
        written = slots.view(1, 1, -1) if slots.dim() == 1 else slots
        unchecked = push and self._unshadowed and q == 1  # one new token on a slot no entry shadows: pushed
        if not unchecked:
            match = self.slots.unsqueeze(-1) == written.unsqueeze(-2)  # [batch, heads, size, q]
            if q == 1:  # every match takes the one token
                self.values.copy_(torch.where(match, fresh, self.values))
            else:
                refreshed = fresh.gather(2, expand_slots(match.to(torch.uint8).argmax(dim=-1), fresh))
                self.values.copy_(torch.where(match.any(dim=-1, keepdim=True), refreshed, self.values))
        if not push:
            return None
        count = min(q, self.size)
        ring = self._ring.view(1) if count == 1 else (self._ring + torch.arange(count, device=fresh.device)) % self.size
        new_values, new_slots = (fresh, written) if count == q else (fresh[:, :, q - count :], written[..., q - count :])
        new_slots = new_slots.expand(*fresh.shape[:2], count)
        departed = None
        if unchecked or self._push_always or slots.dim() > 1:
            if departures:
                departed = Departed(self.slots.index_select(2, ring), self.values.index_select(2, ring))
            advance: int | torch.Tensor = count
        else:  # shared slots, every one shadowed already: refreshed in place, nothing pushed
            old_values, old_slots = self.values.index_select(2, ring), self.slots.index_select(2, ring)
            covered = match.any(dim=-2).all()
            new_values = torch.where(covered, old_values, new_values)
            new_slots = torch.where(covered, old_slots, new_slots)
            advance = (~covered).long() if count == 1 else (~covered).long() * count
            if departures:
                departed = Departed(old_slots.masked_fill(covered, -1), old_values)
        self.values.index_copy_(2, ring, new_values)
        self.slots.index_copy_(2, ring, new_slots)
        self._ring.add_(advance).remainder_(self.size)
        return departed

    def overlay_static(
        self, keys: torch.Tensor, values: torch.Tensor, paired: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every entry scattered into the decoded buffers (``paired`` as in :meth:`overlay`): entries
        in no use (``-1``) repeat entry 0, which every static step's write has filled by the time it
        reads (the first push lands there), and entries that share a slot agree, so they write
        nothing new and no copy of the whole buffer is needed."""
        if not self.size:
            return keys, values
        if paired is None and cpu_kernels.overlay_entries(keys, values, self.values, self.slots, self.size):
            return keys, values
        if self._rows is not None:
            return self.override(keys, values, torch.arange(keys.shape[2], device=keys.device))
        if self._all_in_use:  # as an eager read once the ring is full
            self._scatter_every_entry(keys, values, paired)
            return keys, values
        used = self.slots >= 0
        index = torch.where(used, self.slots, self.slots[..., :1])
        native = torch.where(used.unsqueeze(-1), self.values, self.values[..., :1, :])
        self._scatter(keys, values, paired, index, native)
        return keys, values

    def leave_static(self, capacity: int) -> None:
        """The host bookkeeping from the device (one read, outside decode steps)."""
        if not self.size or self._ring is None or self._rows is not None:
            return
        shadowed = self.slots[0, 0].tolist()
        self.held = sum(slot >= 0 for slot in shadowed)
        self._next = int(self._ring)
        self._shadowed = None if self._push_always else shadowed
        self.written_end = capacity  # static writes may have touched any slot

    # --- rows and bytes --------------------------------------------------------------------
    def reorder(self, batch_index: torch.Tensor) -> None:
        if self.size:
            self.values = self.values.index_select(0, batch_index)
            self.slots = self.slots.index_select(0, batch_index)
            if self._rows is not None:
                self._rows = self._rows.index_select(0, batch_index)
            self._pair()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.values, self.slots, self._rows) if t is not None)

    def bytes_held(self, tokens: int) -> int:
        """The native copies that ``tokens`` kept tokens use (the ring holds at most ``size``)."""
        if self.values is None:
            return 0
        batch, heads, _, width = self.values.shape
        per_entry = width * self.values.element_size() + self.slots.element_size()
        return min(tokens, self.size) * batch * heads * per_entry


def _shadowing(held: torch.Tensor, slots: SlotIndex, q: int) -> torch.Tensor:
    """``[batch, heads, held, q]``: residual entry ``i`` shadows the slot that new token ``j`` is written to."""
    if isinstance(slots, int):
        written = slots if q == 1 else torch.arange(slots, slots + q, device=held.device)
    else:
        written = slots.view(1, 1, 1, -1) if slots.dim() == 1 else slots.unsqueeze(-2)
    return held.unsqueeze(-1) == written


Encoder = Callable[[torch.Tensor, torch.Tensor], None]
"""Writes the codes of ``LongTensor[n]`` slots from their native keys and values side by side."""


class PendingTokens:
    """The slots a storage has written to its residual but not yet encoded, while every write
    names ``int`` slots (``slots`` is ``None`` otherwise, and each write encodes its tokens).

    A read returns such a slot natively, so its encoding can wait until it leaves the residual;
    then every pending slot is encoded in one batch from its native copy (in the residual, or
    among the entries the push just overwrote) by the storage's ``encode(slots, side_by_side)``,
    which writes the codes of ``LongTensor[n]`` slots from their native keys and values."""

    def __init__(self) -> None:
        self.slots: set[int] | None = None

    def allocate(self, residual: int) -> None:
        self.slots = set() if residual else None

    def lazy(self, slots: SlotIndex, ring: NativeResidual) -> bool:
        """Whether a write to ``slots`` may leave its newest tokens to the residual."""
        return isinstance(slots, int) and self.slots is not None and ring.host_slots is not None

    def admit(self, start: int, q: int, push: bool, ring: NativeResidual) -> int:
        """Of a lazy write of ``q`` tokens from slot ``start``, how many of the first must be
        encoded now: all but the newest ``ring.size`` of a push (a write that only refreshes slots
        the residual holds, or a rewrite, pushes nothing and encodes everything)."""
        held = set(ring.host_slots)
        taken = min(q, ring.size) if push and not held.issuperset(range(start, start + q)) else 0
        self.slots.difference_update(range(start, start + q - taken))
        self.slots.update(range(start + q - taken, start + q))
        return q - taken

    def due(self, leaving: list[int] | None) -> bool:
        """Whether a push overwriting the entries that shadow ``leaving`` takes a pending slot."""
        return bool(self.slots) and leaving is not None and not self.slots.isdisjoint(leaving)

    def flush(self, ring: NativeResidual, encode: Encoder, departed: Departed | None = None) -> None:
        """Encode every pending slot from its native copy (departed entries first looked up where
        ``departed`` holds the entries a push just overwrote)."""
        pending, self.slots = self.slots, set()
        sources = [(ring.values, ring.host_slots)]
        if departed is not None:
            sources.append((departed.values, departed.host_slots))
        slots, natives = [], []
        for held, shadowed in sources:
            positions = [p for p, slot in enumerate(shadowed) if slot in pending and slot not in slots]
            if positions:
                slots += [shadowed[p] for p in positions]
                natives.append(held.index_select(2, torch.tensor(positions, device=held.device)))
        if slots:
            encode(torch.tensor(slots, device=natives[0].device), torch.cat(natives, dim=2))

    def settle(self, ring: NativeResidual, encode: Encoder) -> None:
        """Every slot encoded, and no more waiting (before a write the host cannot follow, or static steps)."""
        if self.slots:
            self.flush(ring, encode)
        self.slots = None
