"""The retention axis: which token occupies which slot of one layer.

A retention owns the bookkeeping (tokens seen, slots in use, the position held by each slot)
and tells its storage where to write; it never touches the tensors' layout or dtype.

Every ``update`` goes one of two ways:

* **in place**: the new tokens are written into slots chosen by :meth:`Retention.plan`
  (an append, or the slot of the token being evicted) and attention reads slots
  ``[0, live)``. Decoding always takes this path for the built-in policies: O(1) work per
  token, no concatenation.
* **concatenate, then trim**: when ``plan`` returns ``None`` (several tokens arrive at a
  bounded cache that cannot take them without evicting tokens that those very queries still
  attend to), attention gets the kept tokens in positional order followed by the new ones,
  under ordinary causal attention, and :meth:`Retention.select` then decides which of them stay.
  The new ones are seen as the storage would return them once written
  (:meth:`~hf_kvpolicies.storage.base.Storage.as_written`: fp8 quantises all but the newest
  ``residual``), as the in-place path sees them: both paths attend to what the storage holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..storage import Storage
from ..storage.base import SlotIndex, real_ranks
from .counts import Counts


GROWTH = 1.25
"""Factor by which a growing buffer enlarges: appends stay amortised O(1) (geometric growth) and a
buffer never holds more than 1.25x the slots in use once it has grown (2x would pay for up to twice
the tokens held, where ``DynamicCache`` holds just them)."""


def grown_capacity(held: int) -> int:
    """Slots for a buffer that holds ``held`` tokens and takes more: a quarter more, at least one."""
    return max(held + 1, int(held * GROWTH))


class Retention(ABC):
    """Per-layer slot bookkeeping; subclasses decide placement and what survives a trim."""

    is_sliding = False
    """True only on a model's own sliding-window layers (transformers builds their mask apart)."""
    is_croppable = False
    in_position_order = False
    """True when slot ``j`` always holds position ``j``: transformers' own masks are then exact."""
    keeps_by_position = False
    """True when what is kept of the past depends on positions alone and keys are kept as they
    arrived: a banded mask per chunk (``eval.stream``) then reproduces token-by-token streaming."""
    compileable = False
    """True when decode steps can take :meth:`static_step` (torch.compile, CUDA graphs)."""
    queries_before_rope = False
    """True when the policy reads a forward's queries before their rotation, ``q_norm(q_proj(x))``
    (a statistic of the queries, no attention probabilities: any attention kernel serves it)."""

    def __init__(self) -> None:
        self.counts = Counts()
        """Tokens seen and slots in use, on the host and during static steps on the device."""
        self.slot_pos: torch.Tensor | None = None
        """Absolute position (index in the stream) held by each slot, ``-1`` when empty."""
        self.record_past = False
        """Set while generate() may roll back (assisted decoding): a croppable retention then keeps
        what a :meth:`crop` needs to restore."""

    @property
    def seen(self) -> int:
        """Tokens seen so far, kept or not: drives positions and masks."""
        return self.counts.seen

    @seen.setter
    def seen(self, value: int) -> None:
        self.counts.seen = value

    @property
    def live(self) -> int:
        """Slots ``[0, live)`` hold tokens that a decode step attends to."""
        return self.counts.live

    @live.setter
    def live(self, value: int) -> None:
        self.counts.live = value

    @property
    def static(self) -> bool:
        """True while decode steps take :meth:`static_step` (:class:`Counts`)."""
        return self.counts.static

    @property
    def stale(self) -> bool:
        return self.counts.stale

    @property
    def seen_t(self) -> torch.Tensor | None:
        return self.counts.seen_t

    # --- what subclasses decide -------------------------------------------------------
    @abstractmethod
    def capacity(self, first_chunk: int) -> int:
        """Slots to allocate at the first update (``first_chunk`` tokens arriving)."""

    @abstractmethod
    def plan(self, q: int) -> SlotIndex | None:
        """Slots where ``q`` new tokens can be written in place, or ``None`` to concatenate."""

    @abstractmethod
    def select(self, positions: torch.Tensor) -> torch.Tensor:
        """Indices into ``positions`` (ascending, kept + new) of the tokens that stay after a trim."""

    @property
    @abstractmethod
    def max_length(self) -> int:
        """Most tokens kept at once; ``-1`` when unbounded."""

    def limit_to(self, positions: int) -> bool:
        """Keep at most ``positions`` tokens (the model's positions: a budget beyond them only
        allocates memory no forward can use); whether that lowered the budget."""
        return False

    def within_model_window(self, sliding_window: int) -> Retention | None:
        """This policy on a layer the model itself masks to its last ``sliding_window`` tokens
        (models whose every layer slides, such as Mistral-7B-v0.1): a retention that chooses only
        among the tokens that window shows, or ``None`` when the policy cannot serve such a layer
        (the cache then refuses the model at construction)."""
        return None

    # --- the shared mechanics ---------------------------------------------------------
    @property
    def kept(self) -> int:
        """Tokens currently kept (what a memory or quality comparison should quote)."""
        return self.live if self.max_length < 0 else min(self.live, self.max_length)

    @property
    def held_slots(self) -> int:
        """Storage slots that hold kept tokens (what their bytes are counted from): ``kept``,
        unless the storage is laid out otherwise (pooled heads: ``kept`` times the heads)."""
        return self.kept

    def kept_slots(self) -> torch.Tensor:
        """Slots holding kept tokens, in ascending position order."""
        positions = self.slot_pos[: self.live]
        order = torch.argsort(positions)
        return order[self.select(positions[order])]

    def kept_keys_values(self, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the kept tokens, ``[batch, heads, kept, dim]``, in position order."""
        return storage.gather(self.kept_slots().to(storage.device))

    def query_rows_wanted(self) -> int | None:
        """How many of a forward's last queries the policy reads (``0``: all; ``None``: none)."""
        return None

    def computes_attention(self) -> bool:
        """Whether this forward's statistic computes the softmax probabilities of every query over
        every key attention sees, and so can compute attention's output from them too (a scored
        retention's ``output_wanted`` then asks it to). None does by default."""
        return False

    def update(
        self,
        storage: Storage,
        keys: torch.Tensor,
        values: torch.Tensor,
        padding: torch.Tensor | None = None,
        query: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens and return what attention should see in this forward (``padding``:
        the batch's 2-D bool padding where it is padded; ``query``: the forward's queries and their
        scaling, for a policy that reads them)."""
        q = keys.shape[-2]
        if not storage.is_allocated:
            storage.allocate(keys, self.capacity(q), value_dim=values.shape[-1])
            self.slot_pos = torch.full((storage.capacity,), -1, dtype=torch.long)
        slots = self.plan(q)
        if slots is not None:
            self._ensure_capacity(storage, slots, q)
            ranked = padding is not None and (q > 1 or self.ranks_each_token)
            ranks = self.write_ranks(padding, torch.arange(self.seen, self.seen + q)) if ranked else None
            storage.write(slots, keys, values, ranks=ranks)
            self._record(slots, q)
            return storage.read(self.live)
        kept = self.kept_slots()
        old_keys, old_values = storage.gather(kept.to(storage.device))
        all_keys = torch.cat([old_keys, keys], dim=-2)
        all_values = torch.cat([old_values, values], dim=-2)
        positions = torch.cat([self.slot_pos[kept], torch.arange(self.seen, self.seen + q)])
        stay = self.select(positions)
        stay_dev = stay.to(storage.device)
        # store the new tokens as they came (fp8's residual keeps the newest natively) ...
        ranks = self.write_ranks(padding, positions[stay])
        storage.write(0, all_keys.index_select(2, stay_dev), all_values.index_select(2, stay_dev), ranks=ranks)
        # ... but attend to them as the storage holds them, as a write then a read would give
        new_ranks = None if padding is None else real_ranks(padding[:, self.seen : self.seen + q].to(torch.bool))
        seen_keys, seen_values = storage.as_written(keys, values, ranks=new_ranks)
        if seen_keys is not keys:
            all_keys = torch.cat([old_keys, seen_keys], dim=-2)
            all_values = torch.cat([old_values, seen_values], dim=-2)
        self.slot_pos.fill_(-1)
        self.slot_pos[: stay.numel()] = positions[stay]
        self.live = stay.numel()
        self.seen += q
        self._after_trim()
        return all_keys, all_values

    ranks_each_token = False
    """Whether a padded batch's one-token writes carry ``ranks`` too (by default a single new token
    is each row's next real one, so none are needed)."""

    def write_ranks(self, padding: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
        """:meth:`~hf_kvpolicies.storage.base.Storage.write`'s ``ranks`` for tokens at ``positions``
        (host, in the order written) of a padded batch: its real tokens in that order (``None``
        for an unpadded batch)."""
        if padding is None:
            return None
        return real_ranks(padding[:, positions.to(padding.device)].to(torch.bool))

    def returned_length(self, q: int) -> int:
        """Number of keys the next ``update`` with ``q`` tokens returns (``get_mask_sizes``)."""
        slots = self.plan(q)
        if slots is None:
            return self.kept + q
        return max(self.live, self._end(slots, q))

    def key_positions(self, q: int) -> torch.Tensor:
        """Absolute positions of the keys the next ``update`` returns, in the order returned."""
        new = torch.arange(self.seen, self.seen + q)
        slots = self.plan(q)
        if slots is None:
            kept = self.kept_slots() if self.slot_pos is not None else torch.empty(0, dtype=torch.long)
            return torch.cat([self.slot_pos[kept] if kept.numel() else kept, new])
        length = max(self.live, self._end(slots, q))
        positions = torch.full((length,), -1, dtype=torch.long)
        if self.slot_pos is not None:
            held = min(self.live, self.slot_pos.numel())
            positions[:held] = self.slot_pos[:held]
        positions[self._as_index(slots, q)] = new
        return positions

    @property
    def state_nbytes(self) -> int:
        """Bytes of the retention's own persistent tensors (slot positions, scores)."""
        return 0 if self.slot_pos is None else self.slot_pos.nbytes

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Which keys each query may attend to, beyond causality (all kept ones by default)."""
        return torch.ones(query_pos.numel(), key_pos.numel(), dtype=torch.bool)

    def real_keys(self, padding: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """``[batch, kv]`` bool: which keys of the next update hold a real token in each row.

        ``padding`` is the bool 2-D mask (on the model's device), ``key_pos`` comes from
        :meth:`key_positions` (host). By default a key is real where the padding is at its
        position; a layout that puts different tokens of different rows in one slot refines this.
        """
        return padding[:, key_pos.clamp(min=0).to(padding.device)]

    def reorder(self, batch_index: torch.Tensor) -> None:
        """Per-row state to reorder with the storage (nothing for layouts shared by all rows)."""

    def reset(self) -> None:
        self.counts.reset()
        self.slot_pos = None
        self.record_past = False

    def start_recording(self, storage: Storage) -> None:
        """Past recording begins (before a forward that may be rolled back)."""
        self.record_past = True

    def crop(self, storage: Storage, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (only croppable retentions can)."""
        raise NotImplementedError(f"{type(self).__name__} evicts tokens and cannot roll back")

    # --- the static decode step (torch.compile) ---------------------------------------
    def static_ready(self, storage: Storage) -> bool:
        """Whether the next decode steps can be static: the buffer has its final size (host state only)."""
        return False

    def enter_static(self, storage: Storage) -> None:
        """Copy the host state to the device (eagerly, never inside a compiled region) and give
        every tensor a static step mutates a fixed address."""
        seen_t = self.counts.enter(storage.device)
        for tensor in [seen_t, *self._enter_static(storage)]:
            torch._dynamo.mark_static_address(tensor)
        storage.enter_static(self.static_write_slots)

    def static_step(
        self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, query: tuple[torch.Tensor, float] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoded token with fixed shapes and no host state: returns every slot, and
        ``get_mask_sizes`` shows slot ``j`` to the query while ``j <= seen`` (unfilled slots hidden)."""
        raise NotImplementedError(f"{type(self).__name__} has no static decode step")

    def leave_static(self, storage: Storage) -> None:
        """Back to host bookkeeping (before any host-side use of the layout; may read the device)."""
        self._leave_static(storage, self.counts.sync(storage.capacity, self.slots_per_step))
        storage.leave_static()

    @property
    def slots_per_step(self) -> int:
        """Slots a static step takes while the buffer fills (one token each, by default)."""
        return 1

    grows_between_steps = False
    """Whether static steps need room made before each forward (:meth:`make_room`)."""

    def make_room(self, storage: Storage, tokens: int) -> None:
        """Before a static step's masks are built: make room for the next ``tokens`` (nothing to do
        for a buffer of fixed size)."""

    def static_write_slots(self, steps: int) -> list[int] | None:
        """The slots the next ``steps`` static steps write, where every row and head shares one slot
        a step (an append's, a ring's); ``None`` where each step chooses its slots per row and head."""
        return None

    def static_visible(self) -> torch.Tensor | None:
        """``[batch, kv_heads, slots]``: the slots the next static step shows its query, where the
        layer needs its own mask (``None``: the mask transformers builds from ``get_mask_sizes``)."""
        return None

    def _enter_static(self, storage: Storage) -> list[torch.Tensor]:
        """The subclass's device state, filled from the host; returns the tensors static steps mutate."""
        return []

    def _leave_static(self, storage: Storage, steps: int) -> None:
        """Host bookkeeping after ``steps`` static steps (``seen`` and ``live`` are current)."""

    def _static_done(self, storage: Storage) -> None:
        """After a static step: the counts advance (:meth:`Counts.advance`)."""
        self.counts.advance(storage.capacity, self.slots_per_step)

    # --- helpers for subclasses -------------------------------------------------------
    def _after_trim(self) -> None:
        """Called after a concatenate-then-trim update (for state tied to the layout)."""

    def _end(self, slots: SlotIndex, q: int) -> int:
        """One past the last slot written. A tensor of slots (chosen per row and head, on the
        model's device) overwrites slots in use, so it ends at ``live``: nothing is read back."""
        return slots + q if isinstance(slots, int) else self.live

    @staticmethod
    def _as_index(slots: SlotIndex, q: int) -> torch.Tensor | slice:
        return slice(slots, slots + q) if isinstance(slots, int) else slots.cpu()

    def _ensure_capacity(self, storage: Storage, slots: SlotIndex, q: int) -> None:
        end = self._end(slots, q)
        if end > storage.capacity:
            new_capacity = self._grown_capacity(storage.capacity, end)
            storage.grow(new_capacity)
            grown = torch.full((new_capacity,), -1, dtype=torch.long)
            grown[: self.slot_pos.numel()] = self.slot_pos
            self.slot_pos = grown

    def _grown_capacity(self, capacity: int, end: int) -> int:
        """Slots for a buffer of ``capacity`` that must reach slot ``end``: a quarter more, at least ``end``."""
        return max(end, grown_capacity(capacity))

    def _record(self, slots: SlotIndex, q: int) -> None:
        if isinstance(slots, int) and q == 1:  # the decode step: a host write through numpy dispatches no operation
            self.slot_pos.numpy()[slots] = self.seen
        else:
            self.slot_pos[self._as_index(slots, q)] = torch.arange(self.seen, self.seen + q)
        self.live = max(self.live, self._end(slots, q))
        self.seen += q
