"""How a scored layer's KV heads hold their tokens: a budget per head, or one budget the heads share.

A scored retention (:class:`~hf_kvpolicies.retention.scored.ScoredRetention`) is given one of
these at construction, as kvpress's ``AdaKVPress`` wraps a press. Both keep the retention's state
in its per-head shape, ``[batch, kv_heads, slots]`` positions and scores, so masks, statistics and
selection smoothing read it alike; they differ in how slots map to storage and what a step frees:

* :class:`PerHead` (``head_budgets="uniform"``): each (row, KV head) has ``budget + 1`` slots of
  its own in ``[batch, kv_heads, slots, dim]`` storage. While the cache fills, tokens append; then
  a decode step writes into the slot freed last and frees the lowest-ranked one of that head.
* :class:`PooledHeads` (``head_budgets="adaptive"``, AdaKV): the heads share ``heads x budget``
  tokens, held in one pooled storage row ``[batch, 1, heads x (budget + 1), dim]`` whose slots each
  belong to one head (its position sits in its owner's row, ``-1`` elsewhere:
  :mod:`~hf_kvpolicies.retention.pooled_heads`). Attention sees the pooled row expanded to every
  head under a per-head mask; a decode step writes each head's token into a free slot of its own
  and frees the ``heads`` slots ranked lowest in the whole layer, whichever heads hold them; every
  multi-token forward attends in full and trims. What is not kept is freed (kvpress masks it).

Both have a static decode step (torch.compile): once a layer's buffer has its final size, a
decode step writes, scores and frees with device indices and fixed shapes.

Each method takes the retention whose state it reads and writes (``r``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..storage import Storage
from ..storage.base import SlotIndex, expand_slots
from .pooled_heads import owned_by_head, pooled_ranking, pooled_victims, take_flat
from .scoring import Attended, Pending

UNUSED = -2
"""Position of a slot that a row's own budget leaves unused: with budgets per row (adaptive layer
budgets rank each row's layers apart) a layer's storage is sized for its largest row, and the
others' extra slots stay empty for good: masked like an empty slot (``-1``), never written."""


class HeadLayout(ABC):
    """The decisions that differ between a budget per head and a budget the heads share."""

    name: str
    pooled: bool
    """Whether the heads share one storage row (every forward then needs a per-head mask)."""

    @abstractmethod
    def plan(self, r, q: int) -> SlotIndex | None:
        """Slots where ``q`` new tokens are written in place, or ``None`` to attend in full and trim."""

    @abstractmethod
    def kept_count(self, r) -> int:
        """Storage slots holding kept tokens."""

    @abstractmethod
    def kept_per_head(self, r) -> int:
        """Tokens kept per (row, head) (on average, where heads share the budget)."""

    @abstractmethod
    def returned_length(self, r, q: int) -> int:
        """Keys the next update of ``q`` tokens returns."""

    @abstractmethod
    def positions_in_place(self, r, q: int) -> torch.Tensor:
        """``[batch, kv_heads, k]`` positions of the keys an in-place update returns."""

    @abstractmethod
    def kept_slots(self, r) -> torch.Tensor:
        """``[batch, kv_heads, kept]`` slots of the kept tokens (for iteration)."""

    @abstractmethod
    def kept_keys_values(self, r, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the kept tokens, ``[batch, kv_heads, kept, dim]``."""

    @abstractmethod
    def kept_state(self, r, storage: Storage | None = None):
        """Keys, values (when ``storage`` is given), positions, scores and extra of the kept tokens."""

    @abstractmethod
    def step(self, r, storage: Storage, keys, values, new_positions, query, scaling) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens in place at :meth:`plan`'s slots, score, choose what to free."""

    @abstractmethod
    def trim(self, r, storage: Storage, pending: Pending) -> None:
        """Keep the best of a forward that attended in full, within the layer's budget."""

    @abstractmethod
    def static_capacity(self, r) -> int:
        """The storage slots a layer has once it holds its budget (static decode steps need them all)."""

    @abstractmethod
    def static_step(self, r, storage: Storage, keys, values, query, scaling) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` with fixed shapes and no host state; it advances the retention's counts
        (``_static_done``) once the step is scored, so that ranking reads the advanced device count."""

    def __repr__(self) -> str:
        return self.name


class PerHead(HeadLayout):
    """``budget + 1`` slots per (row, KV head); one in-place eviction per decoded token."""

    name, pooled = "PerHead", False

    def static_capacity(self, r) -> int:
        return r.budget + 1

    def static_step(self, r, storage: Storage, keys, values, query, scaling) -> tuple[torch.Tensor, torch.Tensor]:
        """The token goes to ``free`` (the append while the slots fill, then the slot evicted last);
        the statistic sees every slot, unfilled ones masked; once every slot is in use the lowest
        is chosen as the next ``free``, all on the device."""
        slot, slots = r.free, r.positions.shape[-1]
        storage.write_static(slot, keys, values)
        r.positions.scatter_(-1, slot, r.seen_t.expand_as(slot))
        r.zero_new_state(slot)
        # eagerly, the host count says when every slot holds a token (the new one fills the last):
        # then no key needs masking and the next free slot is the lowest; compiled, the count is
        # frozen, so both are decided on the device
        host = not torch.compiler.is_compiling() and not r.stale
        filled = host and r.live + 1 >= slots
        if not (host and r.live >= slots):  # the device count stops at every slot
            r.live_t.add_(1).clamp_(max=slots)
        all_keys, all_values = storage.read_static()
        key_mask = None if filled else r.positions >= 0
        seen = Attended(
            all_keys, keys, slots - 1, slot, query, scaling, key_mask=key_mask, positions=r.positions, new_values=values,
            first_position=r.seen_t,
        )
        scores = r.score(seen, r.scores, r.extra)
        if scores is not r.scores:  # a statistic that updated them in place returns them
            r.scores.copy_(scores)
        # the lowest is used only once every slot is in use (before, the next slot is the append),
        # so no empty slot needs ranking last
        r._static_done(storage)
        following = r.seen_t  # the device count, advanced: tokens seen after this step
        if filled:
            r.next_free(r.positions, r.scores, following, every_slot_held=True, out=r.free)
        else:
            lowest = r.next_free(r.positions, r.scores, following, every_slot_held=True)
            r.free.copy_(torch.where(r.live_t >= slots, lowest, r.live_t))
        return all_keys, all_values

    def plan(self, r, q: int) -> SlotIndex | None:
        if r.has_free:
            return r.free if q == 1 else None
        if r.row_budgets is not None and r.positions is None:
            return None  # a first forward of rows with their own budgets: each row trims to its own
        return r.live if r.live + q <= r.budget + 1 else None

    def kept_count(self, r) -> int:
        return r.live - 1 if r.has_free else r.live

    def kept_per_head(self, r) -> int:
        return r.live if r.budget is None else min(r.live, r.budget)

    def returned_length(self, r, q: int) -> int:
        slots = r.plan(q)
        if slots is None:
            return self.kept_count(r) + q
        return r.live if r.has_free else max(r.live, slots + q)

    def positions_in_place(self, r, q: int) -> torch.Tensor:
        if r.has_free:
            return r.positions.scatter(-1, r.free, r.seen)
        held = r.positions[..., : r.live]
        new = torch.arange(r.seen, r.seen + q, device=held.device)
        return torch.cat([held, new.expand(*held.shape[:2], q)], dim=-1)

    def kept_slots(self, r) -> torch.Tensor:
        index = self._kept_index(r)
        return torch.arange(r.live) if index is None else index

    def kept_keys_values(self, r, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
        return storage.gather(self.kept_slots(r).to(storage.device))

    def kept_state(self, r, storage: Storage | None = None):
        index = self._kept_index(r)
        if index is None:
            keys, values = storage.read(r.live) if storage is not None else (None, None)
            take = lambda t: t[..., : r.live]  # noqa: E731
        else:
            keys, values = storage.gather(index) if storage is not None else (None, None)
            take = lambda t: t.gather(-1, index.view(*index.shape[:2], *[1] * (t.dim() - 3), -1).expand(*t.shape[:-1], -1))  # noqa: E731
        return keys, values, take(r.positions), take(r.scores), {n: take(t) for n, t in r.extra.items()}

    def step(self, r, storage: Storage, keys, values, new_positions, query, scaling) -> tuple[torch.Tensor, torch.Tensor]:
        slots = r.plan(keys.shape[-2])
        if not storage.is_allocated:
            r.allocate(storage, keys, r.budget + 1, value_dim=values.shape[-1])
        storage.write(slots, keys, values, ranks=r.ranks_among(new_positions))
        r.record(slots, new_positions, keys.shape[-2])
        all_keys, all_values = storage.read(r.live)
        positions = r.positions[..., : r.live]
        seen = r.attended(all_keys, keys, values, slots, query, scaling, positions, all_values, r.seen - keys.shape[-2])
        extra = {name: t[..., : r.live] for name, t in r.extra.items()}
        r.scores[..., : r.live] = r.score(seen, r.scores[..., : r.live], extra)
        if r.live > r.budget:
            r.free = r.next_free(r.positions, r.scores)
            r.has_free = True
        return all_keys, all_values

    def trim(self, r, storage: Storage, pending: Pending) -> None:
        count = min(r.budget, pending.positions.shape[-1])
        ranked = r.ranking(pending.positions, pending.scores)
        stay, unused = r.per_row(r.best_first(pending.positions, ranked)[..., :count], pending.positions.shape[-1])
        keys, values = pending.to_store
        if not storage.is_allocated:
            r.allocate(storage, keys, r.budget + 1, value_dim=values.shape[-1])
        kept = pending.positions.gather(-1, stay)
        ranks = r.ranks_among(kept if unused is None else kept.masked_fill(unused, UNUSED), uneven=unused is not None)
        storage.write(0, keys.gather(2, expand_slots(stay, keys)), values.gather(2, expand_slots(stay, values)), ranks=ranks)
        r.positions[..., :count] = kept
        if unused is not None:
            r.positions[..., :count].masked_fill_(unused, UNUSED)
        r.positions[..., count:] = -1
        r.scores[..., :count] = pending.scores.gather(-1, stay)
        for name, t in r.extra.items():
            source = pending.extra[name]
            t[..., :count] = source.gather(-1, stay.view(*stay.shape[:2], *[1] * (t.dim() - 3), -1).expand(*source.shape[:-1], -1))
        r.live = count
        r.has_free = False

    @staticmethod
    def _kept_index(r) -> torch.Tensor | None:
        """``[batch, kv_heads, kept]`` slots of kept tokens, or ``None`` when they are ``[0, live)``."""
        if not r.has_free:
            return None
        slots = torch.arange(r.live - 1, device=r.free.device)
        return slots + (slots >= r.free)


class PooledHeads(HeadLayout):
    """The heads share ``heads x budget`` tokens in one pooled storage row (AdaKV)."""

    name, pooled = "PooledHeads", True

    def static_capacity(self, r) -> int:
        return r.positions.shape[1] * (r.budget + 1)

    def plan(self, r, q: int) -> SlotIndex | None:
        """One decoded token per head into free slots; anything else attends in full, then trims."""
        return r.free if q == 1 and r.positions is not None else None

    def kept_count(self, r) -> int:  # freed slots hold no position; free ones to fill lie past live
        if r.positions is None:
            return r.live
        return r.live - r.positions.shape[1] if r.has_free else r.live

    def kept_per_head(self, r) -> int:  # on average: the pooled slots in use over the heads
        return 0 if r.positions is None else self.kept_count(r) // r.positions.shape[1]

    def returned_length(self, r, q: int) -> int:
        if r.positions is None:
            return q
        return r.live + q if r.plan(q) is None else self._live_after(r)  # every slot in use, freed ones too

    def positions_in_place(self, r, q: int) -> torch.Tensor:
        return r.positions.scatter(-1, r.free, r.seen)[..., : self._live_after(r)]

    def kept_slots(self, r) -> torch.Tensor:
        """Each head's slots in position order, its row padded in front with slots it does not own
        where it keeps fewer than the busiest (row, head) (``kept_positions`` marks them ``-1``)."""
        positions = r.positions[..., : r.live]
        busiest = int((positions >= 0).sum(dim=-1).max()) if positions.numel() else 0
        return positions.sort(dim=-1).indices[..., positions.shape[-1] - busiest :]

    def kept_keys_values(self, r, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, kv_heads, busiest, dim]``: each head's kept tokens in position order,
        right-aligned, zeros in front where a head keeps fewer than the busiest (the ``-1`` of
        ``kept_positions``, whose last ``busiest`` columns line up with these)."""
        slots = self.kept_slots(r).to(storage.device)
        owned = r.positions.gather(-1, slots) >= 0
        batch, heads = slots.shape[:2]
        out = []
        for pooled in storage.read(r.live):
            every_head = pooled.expand(batch, heads, -1, -1)
            out.append(torch.where(owned[..., None], every_head.gather(2, expand_slots(slots, every_head)), 0))
        return out[0], out[1]

    def kept_state(self, r, storage: Storage | None = None):
        """Every slot in use, each head's row showing its own."""
        batch, heads = r.positions.shape[:2]
        keys, values = (t.expand(batch, heads, -1, -1) for t in storage.read(r.live)) if storage is not None else (None, None)
        take = lambda t: t[..., : r.live]  # noqa: E731
        return keys, values, take(r.positions), take(r.scores), {n: take(t) for n, t in r.extra.items()}

    def step(self, r, storage: Storage, keys, values, new_positions, query, scaling) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoded token per head into its free slot, scored with every slot the head owns;
        when the pool is full, the ``heads`` slots ranked lowest in the layer become free."""
        batch, heads = keys.shape[:2]
        slots = r.free
        storage.write(slots.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        r.record(slots, new_positions, 1)
        r.live = self._live_after(r)
        all_keys, all_values = (t.expand(batch, heads, -1, -1) for t in storage.read(r.live))
        query_mask = None if isinstance(new_positions, int) else new_positions[:, 0] >= 0
        given = dict(new_values=values, first_position=r.seen - 1)
        if r.live < storage.capacity:  # the pool fills: slots past live are not attended yet
            positions = r.positions[..., : r.live]
            seen = Attended(all_keys, keys, r.live - 1, slots, query, scaling, positions >= 0, query_mask, positions, **given)
            extra = {name: t[..., : r.live] for name, t in r.extra.items()}
            r.scores[..., : r.live] = r.score(seen, r.scores[..., : r.live], extra)
            r.free = slots + heads  # the next append
            return all_keys, all_values
        real = r.positions >= 0  # every slot is attended: whole tensors, no slices or copies
        seen = Attended(all_keys, keys, r.live - 1, slots, query, scaling, real, query_mask, r.positions, **given)
        r.scores = r.score(seen, r.scores, r.extra)
        ranked = r.evictable(r.positions, r.ranking(r.positions, r.scores), real=real)
        if r.row_budgets is not None:  # a row's unused slots are never freed, so never written
            ranked = ranked.masked_fill(r.positions == UNUSED, float("inf"))
        victims = pooled_victims(r.positions, ranked, heads)  # victim i becomes head i's free slot
        r.free = victims.unsqueeze(-1)
        # the freed slots hold no token for any head (scores and state are reset when written)
        r.positions.scatter_(-1, victims.unsqueeze(1).expand(batch, heads, heads), -1)
        r.has_free = True
        return all_keys, all_values

    def static_step(self, r, storage: Storage, keys, values, query, scaling) -> tuple[torch.Tensor, torch.Tensor]:
        """Every pooled slot is returned and scored, unfilled ones masked (the cache hands the
        attention module each head's slots,
        :meth:`~hf_kvpolicies.retention.scored.ScoredRetention.static_visible`); while the pool
        fills, each head's next slot is the append, then the ``heads`` slots ranked lowest in the
        layer are freed, all on the device."""
        batch, heads = keys.shape[:2]
        slots, capacity = r.free, r.positions.shape[-1]
        storage.write_static(slots.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        r.positions.scatter_(-1, slots, r.seen_t.expand_as(slots))
        r.zero_new_state(slots)
        # eagerly the host count says when the pool is full after this step; compiled it is
        # frozen, so that is decided on the device
        host = not torch.compiler.is_compiling() and not r.stale
        filled = host and r.live + heads >= capacity
        if not (host and r.live >= capacity):
            r.live_t.add_(heads).clamp_(max=capacity)
        all_keys, all_values = (t.expand(batch, heads, -1, -1) for t in storage.read_static())
        real = r.positions >= 0
        seen = Attended(
            all_keys, keys, capacity - 1, slots, query, scaling, real, None, r.positions, new_values=values, first_position=r.seen_t
        )
        scores = r.score(seen, r.scores, r.extra)
        if scores is not r.scores:  # a statistic that updated them in place returns them
            r.scores.copy_(scores)
        r._static_done(storage)
        following = r.seen_t  # the device count, advanced: tokens seen after this step
        ranked = r.evictable(r.positions, r.ranking(r.positions, r.scores, following), following, real=real)
        victims = pooled_victims(r.positions, ranked, heads).unsqueeze(-1)  # victim i: head i's next slot
        freeing = victims.view(batch, 1, heads).expand(batch, heads, heads)
        if filled:  # the freed slots hold no token for any head
            r.positions.scatter_(-1, freeing, -1)
            r.free.copy_(victims)
        else:
            full = r.live_t >= capacity
            freed = r.positions.scatter(-1, freeing, -1)
            r.positions.copy_(torch.where(full, freed, r.positions))
            r.free.copy_(torch.where(full, victims, slots + heads))
        return all_keys, all_values

    def trim(self, r, storage: Storage, pending: Pending) -> None:
        """Keep the best ``heads x budget`` of every head's tokens together, in one pooled row."""
        batch, heads, k = pending.positions.shape
        count = min(r.budget * heads, heads * k)
        ranked = r.evictable(pending.positions, r.ranking(pending.positions, pending.scores))
        chosen, unused = r.per_row(pooled_ranking(pending.positions, ranked)[..., :count], heads * k, per_row=heads)
        capacity = heads * (r.budget + 1)
        if not storage.is_allocated or storage.capacity != capacity:
            r.allocate(storage, pending.keys[:, :1], capacity, heads, value_dim=pending.values.shape[-1])
        keys, values = (take_flat(t.movedim(-1, -2), chosen).movedim(-2, -1) for t in pending.to_store)
        kept = take_flat(pending.positions, chosen)
        ranks = r.ranks_among(kept if unused is None else kept.masked_fill(unused, UNUSED), uneven=unused is not None)
        storage.write(0, keys[:, None], values[:, None], ranks=ranks)
        head = chosen // k
        r.positions[..., :count] = owned_by_head(kept, head, heads, -1)
        if unused is not None:  # a slot no row of its own budget uses belongs to no head
            r.positions[..., :count].masked_fill_(unused[:, None], UNUSED)
        r.positions[..., count:] = -1
        r.scores[..., :count] = owned_by_head(take_flat(pending.scores, chosen), head, heads, 0.0)
        for name, t in r.extra.items():
            t[..., :count] = owned_by_head(take_flat(pending.extra[name], chosen), head, heads, 0)
            t[..., count:] = 0
        r.live, r.has_free = count, False
        r.free = (count + torch.arange(heads, device=chosen.device)).view(1, heads, 1).repeat(batch, 1, 1)

    @staticmethod
    def _live_after(r) -> int:
        """Slots in use after the next decode step: ``heads`` more while the pool fills."""
        return r.live if r.has_free else min(r.live + r.positions.shape[1], r.positions.shape[-1])


HEAD_LAYOUTS: dict[str, HeadLayout] = {"uniform": PerHead(), "adaptive": PooledHeads()}
"""``head_budgets=`` names: a budget per head, or one the heads share."""
