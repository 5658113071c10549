"""Scored retention: the machinery every score-based eviction policy shares.

A policy is its statistic: a subclass sets :attr:`ScoredRetention.needs_queries` and implements
:meth:`ScoredRetention.score` (and, if it smooths scores before a trim, ``selection_scores``);
everything else lives here, once (the way kvpress separates a press's ``score()`` from its top-k).

Layout, per row and KV head: ``budget + 1`` slots holding their own set of positions, so
positions and scores are ``[batch, kv_heads, slots]`` and writes address
``LongTensor[batch, kv_heads, 1]`` slots. While the cache fills, tokens append. Once ``budget``
tokens are kept, a decode step writes its token *in place* into the free slot, attention reads
every slot (the kept tokens and the new one), the statistic updates the scores, and the token
ranked lowest (by ``selection_scores``, the scores unless the statistic smooths them) outside the
``protected`` newest positions is evicted: its slot becomes the free slot of the next step. All of this stays on the device; the host keeps only plain ints.

A multi-token forward that does not fit (a prompt longer than the budget, a later chunk) is
attended in full (kept tokens, then the new ones, under causal attention), scored (in query
chunks) and trimmed to the protected tokens plus the best-scoring others.

**Finishing a prefill at the cache level** (adaptive layer budgets, KVzip). When
:attr:`defers_trim` is true, such a forward scores but does not trim: the layer keeps a
:class:`Pending` (every key, value, position and score of the forward) until the cache calls
:meth:`finish` with the layer's budget. :class:`~hf_kvpolicies.policies.scored.ScoredCache` does
that from a forward hook on the decoder, once every layer has scored: its ``finish_prefill``
first calls ``rescore(pending)`` (a subclass may replace each layer's ``pending.scores``, e.g. by
a reconstruction pass run over ``pending.keys``/``pending.values``), then sets the layer budgets,
then trims every layer. Each layer's storage is allocated at its first trim (or first append) with
``budget + 1`` slots, so it is sized to that layer's own budget.

**Head-wise budgets** (``head_budgets="adaptive"``, set by the cache): the layer's KV heads
share ``heads x budget`` kept tokens, held in one pooled storage row whose slots each belong to
one head (:mod:`~hf_kvpolicies.retention.pooled_heads`). The state keeps its per-head shape
``[batch, kv_heads, slots]`` (a slot's position only in its owner's row), every forward's
attention gets a per-head mask, and a decode step writes each head's token into a free slot of
its own (the append while the slots fill), then frees the ``heads`` slots ranked lowest in the
whole layer: a head whose tokens rank low shrinks, one whose tokens rank high grows. A
multi-token forward always attends in full and trims (the first one too, prompt fitting or not).

Padded batches: each forward of a padded batch hands ``update`` its 2-D padding; pad tokens get position ``-1`` (an empty slot: masked by position, scored ``-inf``, evicted first)
and their queries score nothing, so a left-padded row keeps what it keeps alone.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..storage import Storage
from ..storage.base import SlotIndex, expand_slots
from ..hooks import ALL_QUERIES
from .base import Retention
from .pooled_heads import owned_by_head, pooled_ranking, pooled_victims, take_flat

HEAD_BUDGETS = ("uniform", "adaptive")
UNUSED = -2
"""Position of a slot that a row's own budget leaves unused: with budgets per row (adaptive layer
budgets rank each row's layers apart) a layer's storage is sized for its largest row, and the
others' extra slots stay empty for good: masked like an empty slot (``-1``), never written."""


@dataclass
class Attended:
    """What one forward attends to, handed to :meth:`ScoredRetention.score`.

    ``keys`` are the keys attention sees (``[batch, kv_heads, k, head_dim]``); query ``i`` of the
    ``q`` new ones sits at key index ``first_new + i`` for causality; ``new_keys`` are the
    incoming keys as the model computed them (before any storage rounding), held at ``new_slots``
    of ``keys`` (a start index, or ``[batch, kv_heads, 1]`` for a decode step written in place);
    ``query`` holds the new queries (only the last ``query_rows`` where the statistic sets it),
    ``None`` for statistics that need no queries.
    ``key_mask``/``query_mask`` mark real tokens (``None``: every key and query is real).
    """

    keys: torch.Tensor
    new_keys: torch.Tensor
    first_new: int
    new_slots: SlotIndex
    query: torch.Tensor | None = None
    scaling: float = 1.0
    key_mask: torch.Tensor | None = None
    query_mask: torch.Tensor | None = None

    @property
    def q(self) -> int:
        return self.keys.shape[-2] - self.first_new


@dataclass
class Pending:
    """A scored forward waiting for its trim: every key it attended to (as the storage will hold
    them), with positions and scores, and the same keys as they arrived, which the trim stores."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    arrived: tuple[torch.Tensor, torch.Tensor] | None = None
    """Keys and values to store where they differ from what attention saw (``None``: the same)."""

    @property
    def to_store(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.arrived if self.arrived is not None else (self.keys, self.values)


class ScoredRetention(Retention):
    """Per-(row, KV head) slots, positions and scores; one in-place eviction per decoded token."""

    needs_queries = True
    """True when :meth:`score` reads the queries (the q_proj hook then hands them over)."""
    query_rows: int | None = None
    """How many of a forward's last queries :meth:`score` reads (``None``: all): the hook rotates
    only those, so a statistic of the last queries costs a long prompt nothing for the others."""

    def __init__(self, budget: int, protected: int = 0) -> None:
        super().__init__()
        self.requested = (budget, protected)
        self.budget: int | None = None
        self.protected: int | None = None
        """Tokens kept per (row, head), and how many of the newest are never evicted; fixed at the
        first update (:meth:`resolve`), or by the cache (:meth:`finish`) for adaptive budgets."""
        self.row_budgets: list[int] | None = None
        """Each row's own budget where the rows' differ (adaptive layer budgets; fractions of rows of
        different lengths); ``budget`` is then the largest, which sizes the storage, and every other
        row leaves its extra slots ``UNUSED``."""
        self.position_limit: int | None = None
        """The model's positions, where the budget would exceed them (:meth:`limit_to`)."""
        self.row_protected: torch.Tensor | None = None
        """``[batch, 1, 1]`` each row's ``protected`` where the rows' differ (``protected``: the largest)."""
        self.protected_from = 0
        """The first position the protection covers: a statistic whose prompt scores must rank every
        prompt token (KVzip's reconstruction) sets it past the prompt, so only later tokens are protected."""
        self.layer_budget: Callable[[int, int], int] | None = None
        """Set by the cache: maps ``(uniform budget, protected)`` to this layer's budget (pyramid)."""
        self.defers_trim = False
        """Set by the cache: an over-budget forward waits for :meth:`finish` instead of trimming."""
        self.pooled = False
        """Set by the cache (``head_budgets="adaptive"``): the KV heads share the layer's budget."""
        self.pending: Pending | None = None
        self.positions: torch.Tensor | None = None
        """``[batch, kv_heads, slots]`` absolute position held by each slot (``-1``: no token)."""
        self.scores: torch.Tensor | None = None
        """``[batch, kv_heads, slots]`` fp32 score of each slot's token (higher stays)."""
        self.extra: dict[str, torch.Tensor] = {}
        """The statistic's own per-slot state, each ``[batch, kv_heads, ..., slots]``."""
        self.free: torch.Tensor | None = None
        """``[batch, kv_heads, 1]`` slot of the token evicted last, written by the next decode step."""
        self.has_free = False
        self.padded = False
        self.live_t: torch.Tensor | None = None
        """Static steps: ``live`` on the device (0-d long)."""

    # --- what a statistic decides ------------------------------------------------------
    @abstractmethod
    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scores ``[batch, kv_heads, k]`` of the keys ``seen`` after this forward.

        ``scores`` holds the kept keys' scores (zeros for the new ones) and ``extra`` the
        statistic's state, both over the same ``k`` keys; ``extra`` may be updated in place.
        """

    def extra_state(self, batch: int, heads: int, slots: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Per-slot state the statistic keeps beside the scores (none by default)."""
        return {}

    def selection_scores(
        self, positions: torch.Tensor, scores: torch.Tensor, seen: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """What evictions and trims rank by (the scores themselves unless the statistic smooths them);
        ``seen``: tokens seen after this forward (a device tensor in static steps; ``self.seen`` by default)."""
        return scores

    def resolve(self, prompt: int) -> tuple[int, int]:
        """``(budget, protected)`` in tokens for a first forward of ``prompt`` tokens."""
        return self.requested

    # --- the Retention interface --------------------------------------------------------
    def capacity(self, first_chunk: int) -> int:
        return self.budget + 1

    @property
    def max_length(self) -> int:
        return -1 if self.budget is None else self.budget

    def plan(self, q: int) -> SlotIndex | None:
        if self.budget is None:
            return None
        if self.pooled:  # one decoded token per head into free slots; anything else attends, then trims
            return self.free if q == 1 and self.positions is not None else None
        if self.has_free:
            return self.free if q == 1 else None
        if self.row_budgets is not None and self.positions is None:
            return None  # a first forward of rows with their own budgets: each row trims to its own
        return self.live if self.live + q <= self.budget + 1 else None

    def select(self, positions: torch.Tensor) -> torch.Tensor:
        """Not used: a scored layout trims by score per row and head (:meth:`_keep`)."""
        raise NotImplementedError(f"{type(self).__name__} trims by score per row and head")

    def query_rows_wanted(self) -> int | None:
        if not self.needs_queries:
            return None
        return ALL_QUERIES if self.query_rows is None else self.query_rows

    @property
    def stored(self) -> int:
        if self.pooled:  # tokens per head, on average: the pooled slots in use over the heads
            return 0 if self.positions is None else self._kept_count() // self.positions.shape[1]
        return self.live if self.budget is None else min(self.live, self.budget)

    @property
    def held_slots(self) -> int:
        if self.pooled:
            return 0 if self.positions is None else self._kept_count()
        return self.stored

    def returned_length(self, q: int) -> int:
        slots = self.plan(q)
        if self.pooled and self.positions is not None:  # every slot in use, freed ones included
            return self.live + q if slots is None else self._pooled_live_after()
        if slots is None:
            return self._kept_count() + q
        return self.live if self.has_free else max(self.live, slots + q)

    def key_positions(self, q: int) -> torch.Tensor:
        """``[batch, kv_heads, k]`` positions of the keys the next update returns, in that order."""
        if self.positions is None:
            return torch.arange(self.seen, self.seen + q).view(1, 1, q)
        slots = self.plan(q)
        if slots is not None and self.pooled:
            return self.positions.scatter(-1, self.free, self.seen)[..., : self._pooled_live_after()]
        if slots is not None and self.has_free:
            return self.positions.scatter(-1, self.free, self.seen)
        new = torch.arange(self.seen, self.seen + q, device=self.positions.device)
        if slots is None:
            kept = self._kept_state()[2]
            return torch.cat([kept, new.expand(*kept.shape[:2], q)], dim=-1)
        held = self.positions[..., : self.live]
        return torch.cat([held, new.expand(*held.shape[:2], q)], dim=-1)

    def real_keys(self, padding: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, k]``: slots that hold a real token (pads and empty slots hold ``-1``)."""
        if key_pos.dim() < 3:
            return super().real_keys(padding, key_pos)
        batch = padding.shape[0]
        flat = key_pos.expand(batch, *key_pos.shape[1:]).reshape(batch, -1)
        return (flat >= 0).view(batch, *key_pos.shape[1:]) & padding.gather(1, flat.clamp(min=0)).view(
            batch, *key_pos.shape[1:]
        )

    def kept_slots(self) -> torch.Tensor:
        """``[batch, kv_heads, kept]`` slots of the kept tokens, in slot order (for iteration); with
        pooled heads, each head's in position order, its row padded in front with slots it does
        not own where it keeps fewer than the busiest (row, head) (``kept_positions`` marks them)."""
        if self.pooled:
            positions = self.positions[..., : self.live]
            busiest = int((positions >= 0).sum(dim=-1).max()) if positions.numel() else 0
            return positions.sort(dim=-1).indices[..., positions.shape[-1] - busiest :]
        index = self._kept_index()
        return torch.arange(self.live) if index is None else index

    def kept_tokens(self, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
        """With pooled heads, ``[batch, kv_heads, busiest, dim]``: each head's kept tokens in position
        order, right-aligned, zeros in front where a head keeps fewer than the busiest (the ``-1``
        of :meth:`kept_positions`, whose last ``busiest`` columns line up with these)."""
        if not self.pooled:
            return super().kept_tokens(storage)
        slots = self.kept_slots().to(storage.device)
        owned = self.positions.gather(-1, slots) >= 0
        batch, heads = slots.shape[:2]
        return tuple(
            torch.where(owned[..., None], pooled.expand(batch, heads, -1, -1).gather(2, expand_slots(slots, pooled.expand(batch, heads, -1, -1))), 0)
            for pooled in storage.read(self.live)
        )

    def kept_positions(self) -> torch.Tensor:
        """``[batch, kv_heads, kept]`` positions currently kept, ascending (pads as ``-1``, first;
        with pooled heads, a head's row is padded with ``-1`` to the slots of the layer)."""
        return self._kept_state()[2].sort(dim=-1).values

    @property
    def state_nbytes(self) -> int:
        tensors = [self.positions, self.scores, self.free, *self.extra.values()]
        return sum(t.nbytes for t in tensors if t is not None)

    def reorder(self, batch_index: torch.Tensor) -> None:
        batch_index = batch_index.to(self.scores.device)
        self.positions = self.positions.index_select(0, batch_index)
        self.scores = self.scores.index_select(0, batch_index)
        self.free = self.free.index_select(0, batch_index)
        self.extra = {name: t.index_select(0, batch_index) for name, t in self.extra.items()}
        if self.row_budgets is not None:
            self.row_budgets = [self.row_budgets[i] for i in batch_index.tolist()]
        if self.row_protected is not None:
            self.row_protected = self.row_protected.index_select(0, batch_index)

    def reset(self) -> None:
        super().reset()
        self.budget = self.protected = self.row_budgets = self.row_protected = None
        self.protected_from = 0
        self.positions = self.scores = self.free = self.live_t = None
        self.extra = {}
        self.pending = None
        self.has_free = self.padded = False

    # --- one update ------------------------------------------------------------------------
    def update(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, padding=None, query=None) -> tuple[torch.Tensor, torch.Tensor]:
        q = keys.shape[-2]
        if q == 0:
            return keys, values  # lazy initialisation: nothing arrives, nothing to score
        if self.pending is not None:
            raise RuntimeError(
                f"{type(self).__name__}: a forward arrived before the last one was trimmed; use the cache only with "
                "the model it was built for (its constructor installs the hook that finishes each forward)"
            )
        query, scaling = self._checked_query(query, q)
        if padding is not None:
            self.padded = True
        new_positions = self._new_positions(keys, q, padding)
        if self.budget is None:
            real = [q] * keys.shape[0] if isinstance(new_positions, int) else (new_positions[:, 0] >= 0).sum(-1).tolist()
            self._resolve_rows(real, keys.device)
        slots = self.plan(q)
        if slots is None:
            return self._attend_then_score(storage, keys, values, new_positions, query, scaling)
        if self.pooled:
            return self._pooled_step(storage, keys, values, new_positions, query, scaling)
        if not storage.is_allocated:
            self._allocate(storage, keys, self.budget + 1, value_dim=values.shape[-1])
        storage.write(slots, keys, values)
        self._record(slots, new_positions, q)
        all_keys, all_values = storage.read(self.live)
        positions = self.positions[..., : self.live]
        seen = self._attended(all_keys, keys, slots, query, scaling, positions)
        extra = {name: t[..., : self.live] for name, t in self.extra.items()}
        self.scores[..., : self.live] = self.score(seen, self.scores[..., : self.live], extra)
        if self.live > self.budget:
            self.free = self._lowest(self.positions, self.selection_scores(self.positions, self.scores))
            self.has_free = True
        return all_keys, all_values

    def finish(self, storage: Storage, budget: int | list[int] | None = None) -> None:
        """Trim the pending forward to ``budget`` (the layer's own, set by the cache; one per row
        where the rows' differ) or the current one."""
        pending, self.pending = self.pending, None
        if isinstance(budget, list):
            self.budget = max(budget)
            self.row_budgets = budget if len(set(budget)) > 1 else None
        elif budget is not None:
            self.budget = budget
        self._trim(storage, pending)

    def limit_to(self, positions: int) -> bool:
        """Budgets are fixed at the first forward (fractions of the prompt), capped there; a budget
        in tokens is known now, and reported now."""
        self.position_limit = positions
        budget = self.token_budget()
        return budget is not None and budget > positions

    def token_budget(self) -> int | None:
        """The budget in tokens where it is given so (``None``: fixed by the first forward)."""
        return self.requested[0]

    def _resolve_rows(self, lengths: list[int], device: torch.device) -> None:
        """``budget`` and ``protected`` from the first forward: each row's from its own tokens (a
        budget given as a fraction of the prompt is a fraction of the row's, pads left out), so
        that a row of a padded batch keeps what it keeps alone; the largest sizes the storage."""
        resolved = []
        for length in lengths:
            budget, protected = self.resolve(length)
            if self.layer_budget is not None:
                budget = self.layer_budget(budget, protected)
            if self.position_limit is not None and budget > self.position_limit:  # each layer's own, capped
                budget, protected = self.position_limit, min(protected, self.position_limit)
            resolved.append((budget, protected))
        budgets, protected = (list(values) for values in zip(*resolved))
        self.budget, self.protected = max(budgets), max(protected)
        if len(set(resolved)) > 1:
            self.row_budgets = budgets
            self.row_protected = torch.tensor(protected, device=device).view(-1, 1, 1)

    def real_lengths(self) -> list[int]:
        """Tokens of each row in the pending forward (pads and empty slots left out)."""
        return (self.pending.positions[:, 0] >= 0).sum(dim=-1).tolist()

    # --- the static decode step (unpadded batches, uniform budgets) -------------------------------
    compileable = True

    def static_ready(self, storage: Storage) -> bool:
        return (
            self.budget is not None and self.pending is None and not self.padded and not self.pooled
            and storage.is_allocated and storage.capacity == self.budget + 1
        )

    def _enter_static(self, storage: Storage) -> list[torch.Tensor]:
        self.live_t = torch.full((), self.live, dtype=torch.long, device=storage.device)
        if not self.has_free:
            self.free.fill_(self.live)  # while the slots fill, the next one is the append
        return [self.live_t, self.positions, self.scores, self.free, *self.extra.values()]

    def static_step(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, query=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The token goes to ``free`` (the append while the slots fill, then the slot evicted last);
        the statistic sees every slot, unfilled ones masked; once every slot is in use the lowest
        is chosen as the next ``free``, all on the device."""
        query, scaling = self._checked_query(query, 1)
        slot, slots = self.free, self.positions.shape[-1]
        storage.write_static(slot, keys, values)
        self.positions.scatter_(-1, slot, self.seen_t.expand_as(slot))
        self.scores.scatter_(-1, slot, 0.0)
        for t in self.extra.values():
            t.scatter_(-1, slot.view(*slot.shape[:2], *[1] * (t.dim() - 3), 1).expand(*t.shape[:-1], 1), 0.0)
        self.live_t.copy_((self.live_t + 1).clamp(max=slots))
        all_keys, all_values = storage.read_static()
        # eagerly, the host count says when every slot holds a token (the new one fills the last):
        # then no key needs masking; compiled, the count is frozen, so the mask stays
        filled = not torch.compiler.is_compiling() and not self.stale and self.live + 1 >= slots
        key_mask = None if filled else self.positions >= 0
        seen = Attended(all_keys, keys, slots - 1, slot, query, scaling, key_mask=key_mask)
        self.scores.copy_(self.score(seen, self.scores, self.extra))
        # the lowest is used only once every slot is in use (before, the next slot is the append),
        # so no empty slot needs ranking last
        ranked = self.selection_scores(self.positions, self.scores, self.seen_t + 1)
        lowest = self._lowest(self.positions, ranked, self.seen_t + 1, every_slot_held=True)
        self.free.copy_(torch.where(self.live_t >= slots, lowest, self.live_t))
        self._static_done(storage)
        if not torch.compiler.is_compiling():
            self.has_free = self.live > self.budget
        return all_keys, all_values

    def _leave_static(self, storage: Storage, steps: int) -> None:
        self.has_free = self.live > self.budget

    # --- internals --------------------------------------------------------------------------
    def _checked_query(self, query: tuple[torch.Tensor, float] | None, q: int) -> tuple[torch.Tensor | None, float]:
        """The forward's queries where the statistic reads them, refusing keys that came without."""
        if not self.needs_queries:
            return None, 1.0
        if query is None or query[0].shape[-2] != min(q, self.query_rows or q):
            raise RuntimeError(
                f"{type(self).__name__} received keys without the queries of the same forward: use the cache only "
                "with the model it was built for (its constructor installs the hook that sees the queries)"
            )
        return query

    def _new_positions(self, keys: torch.Tensor, q: int, padding: torch.Tensor | None) -> torch.Tensor | int:
        """``[batch, kv_heads, q]`` positions of the new tokens, ``-1`` for pads; for one token
        that is real in every row, its position as an int (a decode step builds no tensor)."""
        batch, heads = keys.shape[:2]
        padded = padding is not None and padding.shape[-1] == self.seen + q
        if q == 1 and not padded:
            return self.seen
        positions = torch.arange(self.seen, self.seen + q, device=keys.device).expand(batch, heads, q)
        if not padded:
            return positions
        real = padding[:, self.seen :].to(keys.device)
        return positions.masked_fill(~real[:, None, :], -1)

    def _attended(self, keys, new_keys, slots, query, scaling, positions) -> Attended:
        q = new_keys.shape[-2]
        first_new = keys.shape[-2] - q
        if not self.padded and not self.pooled and self.row_budgets is None:  # else some slots hold no token of a head or row
            return Attended(keys, new_keys, first_new, slots, query, scaling)
        query_mask = (positions[:, 0, first_new:] >= 0) if isinstance(slots, int) else None
        return Attended(keys, new_keys, first_new, slots, query, scaling, positions >= 0, query_mask)

    def _allocate(
        self, storage: Storage, like: torch.Tensor, capacity: int, heads: int | None = None, value_dim: int | None = None
    ) -> None:
        """Storage shaped like ``like`` (values ``value_dim`` wide where they differ from the keys)
        and per-head state; ``heads`` where the state has more heads than the storage (pooled: one
        storage row, a state row per head)."""
        storage.allocate(like, capacity, value_dim=value_dim)
        batch, heads = like.shape[0], heads or like.shape[1]
        shape = (batch, heads, storage.capacity)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=like.device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=like.device)
        self.free = torch.zeros(batch, heads, 1, dtype=torch.long, device=like.device)
        self.extra = self.extra_state(batch, heads, storage.capacity, like.device)

    def _record(self, slots: SlotIndex, new_positions: torch.Tensor | int, q: int) -> None:
        if isinstance(slots, int):
            end = slots + q
            self.positions[..., slots:end] = new_positions
            self.scores[..., slots:end] = 0
            for t in self.extra.values():
                t[..., slots:end] = 0
            self.live = max(self.live, end)
        else:
            self.positions.scatter_(-1, slots, new_positions)
            self.scores.scatter_(-1, slots, 0.0)
            for t in self.extra.values():
                index = slots.view(*slots.shape[:2], *[1] * (t.dim() - 3), 1).expand(*t.shape[:-1], 1)
                t.scatter_(-1, index, 0.0)
        self.seen += q

    def _kept_count(self) -> int:
        if self.pooled and self.positions is not None:  # freed slots hold no position; free ones to fill lie past live
            return self.live - self.positions.shape[1] if self.has_free else self.live
        return self.live - 1 if self.has_free else self.live

    def _kept_index(self) -> torch.Tensor | None:
        """``[batch, kv_heads, kept]`` slots of kept tokens, or ``None`` when they are ``[0, live)``."""
        if not self.has_free:
            return None
        slots = torch.arange(self.live - 1, device=self.free.device)
        return slots + (slots >= self.free)

    def _kept_state(self, storage: Storage | None = None):
        """Keys, values (when ``storage`` is given), positions, scores and extra of the kept tokens."""
        if self.positions is None:
            return None, None, torch.empty(1, 1, 0, dtype=torch.long), None, {}
        if self.pooled:  # every slot in use, each head's row showing its own
            batch, heads = self.positions.shape[:2]
            keys, values = (
                (t.expand(batch, heads, -1, -1) for t in storage.read(self.live)) if storage is not None else (None, None)
            )
            take = lambda t: t[..., : self.live]  # noqa: E731
            return keys, values, take(self.positions), take(self.scores), {n: take(t) for n, t in self.extra.items()}
        index = self._kept_index()
        if index is None:
            keys, values = storage.read(self.live) if storage is not None else (None, None)
            take = lambda t: t[..., : self.live]  # noqa: E731
        else:
            keys, values = storage.gather(index) if storage is not None else (None, None)
            take = lambda t: t.gather(-1, index.view(*index.shape[:2], *[1] * (t.dim() - 3), -1).expand(*t.shape[:-1], -1))  # noqa: E731
        return keys, values, take(self.positions), take(self.scores), {n: take(t) for n, t in self.extra.items()}

    def _attend_then_score(self, storage, keys, values, new_positions, query, scaling):
        batch, heads, q = keys.shape[:3]
        if isinstance(new_positions, int):
            new_positions = torch.full((batch, heads, q), new_positions, device=keys.device)
        # attention sees the new tokens as the storage will hold them (a write then a read: fp8
        # rounds all but its residual), as a forward written in place does; the trim stores them as they came
        seen_keys, seen_values = storage.as_written(keys, values)
        arrived = None
        if storage.is_allocated:
            old_keys, old_values, old_positions, old_scores, old_extra = self._kept_state(storage)
            all_keys = torch.cat([old_keys, seen_keys], dim=-2)
            all_values = torch.cat([old_values, seen_values], dim=-2)
            if seen_keys is not keys:
                arrived = (torch.cat([old_keys, keys], dim=-2), torch.cat([old_values, values], dim=-2))
            positions = torch.cat([old_positions, new_positions], dim=-1)
            scores = torch.cat([old_scores, old_scores.new_zeros(batch, heads, q)], dim=-1)
            extra = {n: torch.cat([t, t.new_zeros(*t.shape[:-1], q)], dim=-1) for n, t in old_extra.items()}
        else:  # contiguous as a cache's own buffers are: attention and scoring run faster on them
            all_keys, all_values, positions = seen_keys.contiguous(), seen_values.contiguous(), new_positions
            if seen_keys is not keys:
                arrived = (keys, values)
            scores = torch.zeros(batch, heads, q, dtype=torch.float32, device=keys.device)
            extra = self.extra_state(batch, heads, q, keys.device)
        seen = self._attended(all_keys, keys, all_keys.shape[-2] - q, query, scaling, positions)
        scores = self.score(seen, scores, extra)
        self.seen += q
        self.pending = Pending(all_keys, all_values, positions, scores, extra, arrived)
        if not self.defers_trim:
            self.finish(storage)
        return all_keys, all_values

    def _trim(self, storage: Storage, pending: Pending) -> None:
        if self.pooled:
            self._pooled_trim(storage, pending)
            return
        count = min(self.budget, pending.positions.shape[-1])
        ranked = self.selection_scores(pending.positions, pending.scores)
        stay, unused = self._per_row(self._best_first(pending.positions, ranked)[..., :count], pending.positions.shape[-1])
        keys, values = pending.to_store
        if not storage.is_allocated:
            self._allocate(storage, keys, self.budget + 1, value_dim=values.shape[-1])
        storage.write(0, keys.gather(2, expand_slots(stay, keys)), values.gather(2, expand_slots(stay, values)))
        self.positions[..., :count] = pending.positions.gather(-1, stay)
        if unused is not None:
            self.positions[..., :count].masked_fill_(unused, UNUSED)
        self.positions[..., count:] = -1
        self.scores[..., :count] = pending.scores.gather(-1, stay)
        for name, t in self.extra.items():
            source = pending.extra[name]
            t[..., :count] = source.gather(-1, stay.view(*stay.shape[:2], *[1] * (t.dim() - 3), -1).expand(*source.shape[:-1], -1))
        self.live = count
        self.has_free = False

    # --- pooled heads (head_budgets="adaptive") ------------------------------------------------
    def _pooled_trim(self, storage: Storage, pending: Pending) -> None:
        """Keep the best ``heads x budget`` of every head's tokens together, in one pooled row."""
        batch, heads, k = pending.positions.shape
        count = min(self.budget * heads, heads * k)
        ranked = self._evictable(pending.positions, self.selection_scores(pending.positions, pending.scores))
        chosen, unused = self._per_row(pooled_ranking(pending.positions, ranked)[..., :count], heads * k, per_row=heads)
        capacity = heads * (self.budget + 1)
        if not storage.is_allocated or storage.capacity != capacity:
            self._allocate(storage, pending.keys[:, :1], capacity, heads, value_dim=pending.values.shape[-1])
        keys, values = (take_flat(t.movedim(-1, -2), chosen).movedim(-2, -1) for t in pending.to_store)
        storage.write(0, keys[:, None], values[:, None])
        head = chosen // k
        self.positions[..., :count] = owned_by_head(take_flat(pending.positions, chosen), head, heads, -1)
        if unused is not None:  # a slot no row of its own budget uses belongs to no head
            self.positions[..., :count].masked_fill_(unused[:, None], UNUSED)
        self.positions[..., count:] = -1
        self.scores[..., :count] = owned_by_head(take_flat(pending.scores, chosen), head, heads, 0.0)
        for name, t in self.extra.items():
            t[..., :count] = owned_by_head(take_flat(pending.extra[name], chosen), head, heads, 0)
            t[..., count:] = 0
        self.live, self.has_free = count, False
        self.free = (count + torch.arange(heads, device=chosen.device)).view(1, heads, 1).repeat(batch, 1, 1)

    def _pooled_step(self, storage, keys, values, new_positions, query, scaling):
        """One decoded token per head into its free slot, scored with every slot the head owns;
        when the pool is full, the ``heads`` slots ranked lowest in the layer become free."""
        batch, heads = keys.shape[:2]
        slots = self.free
        storage.write(slots.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        self._record(slots, new_positions, 1)
        self.live = self._pooled_live_after()
        all_keys, all_values = (t.expand(batch, heads, -1, -1) for t in storage.read(self.live))
        query_mask = None if isinstance(new_positions, int) else new_positions[:, 0] >= 0
        if self.live < storage.capacity:  # the pool fills: slots past live are not attended yet
            positions = self.positions[..., : self.live]
            seen = Attended(all_keys, keys, self.live - 1, slots, query, scaling, positions >= 0, query_mask)
            extra = {name: t[..., : self.live] for name, t in self.extra.items()}
            self.scores[..., : self.live] = self.score(seen, self.scores[..., : self.live], extra)
            self.free = slots + heads  # the next append
            return all_keys, all_values
        real = self.positions >= 0  # every slot is attended: whole tensors, no slices or copies
        seen = Attended(all_keys, keys, self.live - 1, slots, query, scaling, real, query_mask)
        self.scores = self.score(seen, self.scores, self.extra)
        ranked = self._evictable(self.positions, self.selection_scores(self.positions, self.scores), real=real)
        if self.row_budgets is not None:  # a row's unused slots are never freed, so never written
            ranked = ranked.masked_fill(self.positions == UNUSED, float("inf"))
        victims = pooled_victims(self.positions, ranked, heads)  # victim i becomes head i's free slot
        self.free = victims.unsqueeze(-1)
        # the freed slots hold no token for any head (scores and state are reset when written)
        self.positions.scatter_(-1, victims.unsqueeze(1).expand(batch, heads, heads), -1)
        self.has_free = True
        return all_keys, all_values

    def _pooled_live_after(self) -> int:
        """Slots in use after the next decode step: ``heads`` more while the pool fills."""
        return self.live if self.has_free else min(self.live + self.positions.shape[1], self.positions.shape[-1])

    def _lowest(
        self, positions: torch.Tensor, scores: torch.Tensor, seen: int | torch.Tensor | None = None, every_slot_held: bool = False
    ) -> torch.Tensor:
        """``[batch, kv_heads, 1]`` slot to evict: the lowest score, the oldest position among ties."""
        ranked = self._evictable(positions, scores, seen, every_slot_held=every_slot_held)
        if self.row_budgets is not None:  # a row's unused slots never take a token
            ranked = ranked.masked_fill(positions == UNUSED, float("inf"))
        lowest = ranked == ranked.amin(dim=-1, keepdim=True)
        return torch.where(lowest, positions, torch.iinfo(positions.dtype).max).argmin(dim=-1, keepdim=True)

    def _best_first(self, positions: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Indices of the tokens in the order they stay: the protected ones, then the best scores,
        the newest position among ties (ties are common after max pooling)."""
        newest_first = positions.argsort(dim=-1, descending=True, stable=True)
        ranked = self._evictable(positions, scores).gather(-1, newest_first)
        return newest_first.gather(-1, ranked.sort(dim=-1, descending=True, stable=True).indices)

    def _per_row(self, best: torch.Tensor, width: int, per_row: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ``best`` indices (best first, ``[batch, ..., count]``) that stay, ascending, and where
        rows keep fewer than ``count`` (their own budgets, ``per_row`` slots per token of budget),
        which of the returned slots each row leaves unused; ``None`` when every row keeps them all.
        Unused slots come first, so that each row's kept tokens end the write as they do when the
        row is alone (storage that treats the last writes apart, fp8's residual, then holds the
        same tokens). ``width``: one past the largest index."""
        if self.row_budgets is None:
            return best.sort(dim=-1).values, None
        kept = torch.tensor(self.row_budgets, device=best.device).mul_(per_row).view(-1, *[1] * (best.dim() - 1))
        unused = torch.arange(best.shape[-1], device=best.device) >= kept
        order = (best + (~unused) * width).sort(dim=-1).indices
        return best.gather(-1, order), unused.expand_as(best).gather(-1, order)

    def _evictable(
        self,
        positions: torch.Tensor,
        scores: torch.Tensor,
        seen: int | torch.Tensor | None = None,
        real: torch.Tensor | None = None,
        every_slot_held: bool = False,
    ) -> torch.Tensor:
        """``scores`` with the protected newest positions at +inf (never evicted), empty slots at -inf
        (``seen``: tokens seen, the host count unless a static step gives the device one; ``real``:
        ``positions >= 0`` where the caller has it; ``every_slot_held``: no slot is empty). Each
        step skips what cannot change the ranking: a decode step pays for every operation."""
        seen = self.seen if seen is None else seen
        ranked = scores
        if self.protected:  # no position lies past seen - 1: with nothing protected, nothing to raise
            protected = self.protected if self.row_protected is None else self.row_protected
            oldest = seen - protected  # the oldest protected position, never below protected_from
            if self.protected_from:
                oldest = oldest.clamp(min=self.protected_from) if isinstance(oldest, torch.Tensor) else max(oldest, self.protected_from)
            ranked = ranked.masked_fill(positions >= oldest, float("inf"))
        if every_slot_held:
            return ranked
        if real is not None:
            return torch.where(real, ranked, float("-inf"))
        return ranked.masked_fill(positions < 0, float("-inf"))

    def candidate_scores(self) -> torch.Tensor:
        """The pending forward's ranking scores with protected tokens and pads at ``-inf``: what
        an adaptive allocation compares across layers."""
        pending = self.pending
        ranked = self._evictable(pending.positions, self.selection_scores(pending.positions, pending.scores))
        return ranked.masked_fill(ranked == float("inf"), float("-inf"))
