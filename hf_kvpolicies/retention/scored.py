"""Scored retention: the mechanism every score-based eviction policy shares.

A policy is its statistic: a subclass sets :attr:`ScoredRetention.needs_queries` and implements
:meth:`ScoredRetention.score` (and, if it smooths scores before a trim, ``selection_scores``);
everything else lives here, once (the way kvpress separates a press's ``score()`` from its top-k).

State, per row and KV head: positions and fp32 scores ``[batch, kv_heads, slots]`` (and the
statistic's own per-slot state), whatever the head layout
(:mod:`~hf_kvpolicies.retention.head_layouts`: a budget per head, or one the heads share). While
the cache fills, tokens append. Once ``budget`` tokens are kept, a decode step writes its token
*in place* into the free slot, attention reads every slot (the kept tokens and the new one), the
statistic updates the scores, and the token ranked lowest (by ``selection_scores``, the scores
unless the statistic smooths them) outside the ``protected`` newest positions is evicted: its slot
becomes the free slot of the next step. All of this stays on the device; the host keeps only
plain ints. With ``chunk`` > 1 (ChunkKV) the ranking is of whole chunks of neighbouring positions
(:mod:`~hf_kvpolicies.retention.chunks`), for every statistic alike.

A multi-token forward that does not fit (a prompt longer than the budget, a later chunk) is
attended in full (kept tokens, then the new ones, under causal attention), scored (in query
chunks) and trimmed to the protected tokens plus the best-scoring others.

**Waiting for the cache** (``waits_for_cache``: adaptive layer budgets, KVzip). The first such
forward scores but does not trim: the layer keeps a :class:`~hf_kvpolicies.retention.scoring.Pending`
(every key, value, position and score of the forward) until the cache calls :meth:`finish` with
the layer's budget, once every layer has scored
(:meth:`~hf_kvpolicies.policies.scored.ScoredCache.finish_prefill`: a rescoring pass such as
KVzip's reconstruction, then the layer budgets, then every layer's trim). Each layer's storage is
allocated at its first trim (or first append) for its own budget.

**Budgets per row.** A budget given as a fraction of the prompt is a fraction of each row's own
tokens, and adaptive layer budgets rank each row's layers apart, so rows may keep different
numbers of tokens in a layer: the storage is sized for the largest row and the others leave
slots ``UNUSED``. Padded batches: each forward of a padded batch hands ``update`` its 2-D padding;
pad tokens get position ``-1`` (an empty slot: masked by position, scored ``-inf``, evicted
first) and their queries score nothing, so a left-padded row keeps what it keeps alone.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import torch

from ..attention_scores import new_attention_output
from ..hooks import ALL_QUERIES
from ..storage import Storage
from ..storage.base import SlotIndex, real_ranks
from .base import Retention
from .chunks import chunk_ranking
from .head_layouts import UNUSED, HeadLayout, PerHead
from .scoring import Attended, Pending, slot_index

LayerBudget = Callable[[int, int], int]
"""Maps ``(uniform budget, protected)`` to a layer's own budget (PyramidKV's shares)."""


class ScoredRetention(Retention):
    """Per-(row, KV head) positions and scores; one in-place eviction per decoded token."""

    needs_queries = True
    """True when :meth:`score` reads the queries (the query hooks then hand them over)."""
    query_rows: int | None = None
    """How many of a forward's last queries :meth:`score` reads (``None``: all): the hook rotates
    only those, so a statistic of the last queries costs a long prompt nothing for the others."""
    sets_new_state = False
    """True when :meth:`score` sets the new tokens' scores and per-slot state itself (a statistic
    that replaces rather than accumulates): a decode step then does not zero them first."""

    def __init__(
        self,
        budget: int,
        protected: int = 0,
        *,
        layout: HeadLayout | None = None,
        waits_for_cache: bool = False,
        layer_budget: LayerBudget | None = None,
        chunk: int = 1,
    ) -> None:
        """``layout``: how the KV heads hold their tokens (default :class:`PerHead`);
        ``waits_for_cache``: the first forward over the budget waits for the cache's
        :meth:`finish` instead of trimming; ``layer_budget``: this layer's share of a uniform budget;
        ``chunk``: rank whole chunks of that many neighbouring positions (1: single tokens)."""
        super().__init__()
        self.requested = (budget, protected)
        self.layout = layout or PerHead()
        self.waits_for_cache = waits_for_cache
        self.layer_budget = layer_budget
        self.chunk = chunk
        self.waiting = waits_for_cache
        """Until the first forward over the budget (or the cache's rescoring) has been finished."""
        self.budget: int | None = None
        self.protected: int | None = None
        """Tokens kept per (row, head), and how many of the newest are never evicted; fixed at the
        first update (:meth:`resolve`), or by the cache (:meth:`finish`) for adaptive budgets."""
        self.row_budgets: list[int] | None = None
        """Each row's own budget where the rows' differ (adaptive layer budgets; fractions of rows of
        different lengths); ``budget`` is then the largest, which sizes the storage, and every other
        row leaves its extra slots ``UNUSED``."""
        self.row_protected: torch.Tensor | None = None
        """``[batch, 1, 1]`` each row's ``protected`` where the rows' differ (``protected``: the largest)."""
        self.position_limit: int | None = None
        """The model's positions, where the budget would exceed them (:meth:`limit_to`)."""
        self.row_start: torch.Tensor | None = None
        """``[batch, 1, 1]`` each row's first real position (its pads come before it): where its
        chunks begin, and where a statistic counts a row's positions from."""
        self.protected_from = 0
        """The first position the protection covers: a statistic whose prompt scores must rank every
        prompt token (KVzip's reconstruction) sets it past the prompt, so only later tokens are protected."""
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
        self.output_wanted = False
        """Set by the cache before one forward's update, which reads and clears it: the model's
        attention will return the output this forward's statistic computes (:meth:`computes_attention`;
        it then passes ``seen.values`` and ``seen.output`` to its statistic) instead of its own."""
        self.attention_output: torch.Tensor | None = None
        """That output (a :func:`~hf_kvpolicies.attention_scores.new_attention_output` buffer), until
        the model's attention takes it."""

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
        """The statistic's ranking of single tokens (the scores themselves unless it smooths them);
        ``seen``: tokens seen after this forward (a device tensor in static steps; ``self.seen`` by default)."""
        return scores

    def ranking(
        self, positions: torch.Tensor, scores: torch.Tensor, seen: int | torch.Tensor | None = None, every_slot_held: bool = False
    ) -> torch.Tensor:
        """What evictions and trims rank by: the statistic's :meth:`selection_scores`, of whole
        chunks where ``chunk`` > 1 (:func:`~hf_kvpolicies.retention.chunks.chunk_ranking`;
        ``every_slot_held``: no slot is empty)."""
        ranked = self.selection_scores(positions, scores, seen)
        if self.chunk == 1:
            return ranked
        seen = self.seen if seen is None else seen
        return chunk_ranking(positions, ranked, self.row_start, seen, self.chunk, every_slot_held=every_slot_held)

    def resolve(self, prompt: int) -> tuple[int, int]:
        """``(budget, protected)`` in tokens for a first forward of ``prompt`` tokens."""
        return self.requested

    def token_budget(self) -> int | None:
        """The budget in tokens where it is given so (``None``: fixed by the first forward)."""
        return self.requested[0]

    # --- the Retention interface --------------------------------------------------------
    def capacity(self, first_chunk: int) -> int:
        return self.budget + 1

    @property
    def max_length(self) -> int:
        return -1 if self.budget is None else self.budget

    def plan(self, q: int) -> SlotIndex | None:
        return None if self.budget is None else self.layout.plan(self, q)

    def select(self, positions: torch.Tensor) -> torch.Tensor:
        """Not used: a scored layout trims by score per row and head (its layout's ``trim``)."""
        raise NotImplementedError(f"{type(self).__name__} trims by score per row and head")

    def query_rows_wanted(self) -> int | None:
        if not self.needs_queries:
            return None
        return ALL_QUERIES if self.query_rows is None else self.query_rows

    @property
    def kept(self) -> int:
        return self.layout.kept_per_head(self)

    @property
    def held_slots(self) -> int:
        return 0 if self.positions is None else self.layout.kept_count(self) if self.layout.pooled else self.kept

    def returned_length(self, q: int) -> int:
        return self.layout.returned_length(self, q)

    def key_positions(self, q: int) -> torch.Tensor:
        """``[batch, kv_heads, k]`` positions of the keys the next update returns, in that order."""
        if self.positions is None:
            return torch.arange(self.seen, self.seen + q).view(1, 1, q)
        if self.plan(q) is not None:
            return self.layout.positions_in_place(self, q)
        kept = self.layout.kept_state(self)[2]
        new = torch.arange(self.seen, self.seen + q, device=kept.device)
        return torch.cat([kept, new.expand(*kept.shape[:2], q)], dim=-1)

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
        """``[batch, kv_heads, kept]`` slots of the kept tokens (for iteration; see the layout)."""
        return self.layout.kept_slots(self)

    def kept_keys_values(self, storage: Storage) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layout.kept_keys_values(self, storage)

    def kept_positions(self) -> torch.Tensor:
        """``[batch, kv_heads, kept]`` positions currently kept, ascending (pads as ``-1``, first;
        with pooled heads, a head's row is padded with ``-1`` to the slots of the layer)."""
        if self.positions is None:
            return torch.empty(1, 1, 0, dtype=torch.long)
        return self.layout.kept_state(self)[2].sort(dim=-1).values

    @property
    def state_nbytes(self) -> int:
        tensors = [self.positions, self.scores, self.free, self.row_start, *self.extra.values()]
        return sum(t.nbytes for t in tensors if t is not None)

    def reorder(self, batch_index: torch.Tensor) -> None:
        batch_index = batch_index.to(self.scores.device)
        self.positions = self.positions.index_select(0, batch_index)
        self.scores = self.scores.index_select(0, batch_index)
        self.free = self.free.index_select(0, batch_index)
        self.row_start = self.row_start.index_select(0, batch_index)
        self.extra = {name: t.index_select(0, batch_index) for name, t in self.extra.items()}
        if self.row_budgets is not None:
            self.row_budgets = [self.row_budgets[i] for i in batch_index.tolist()]
        if self.row_protected is not None:
            self.row_protected = self.row_protected.index_select(0, batch_index)

    def reset(self) -> None:
        super().reset()
        self.budget = self.protected = self.row_budgets = self.row_protected = None
        self.protected_from = 0
        self.positions = self.scores = self.free = self.live_t = self.row_start = None
        self.extra = {}
        self.pending = None
        self.has_free = self.padded = self.output_wanted = False
        self.attention_output = None
        self.waiting = self.waits_for_cache

    def limit_to(self, positions: int) -> bool:
        """Budgets are fixed at the first forward (fractions of the prompt), capped there; a budget
        in tokens is known now, and reported now."""
        self.position_limit = positions
        budget = self.token_budget()
        return budget is not None and budget > positions

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
        if self.row_start is None or (padding is not None and q > 1):  # a row's first real token may come late
            self.row_start = self._first_real(padding, keys)
        if self.budget is None:
            real = [q] * keys.shape[0] if isinstance(new_positions, int) else (new_positions[:, 0] >= 0).sum(-1).tolist()
            self._resolve_rows(real, keys.device)
        if self.plan(q) is None:
            return self._attend_then_score(storage, keys, values, new_positions, query, scaling)
        return self.layout.step(self, storage, keys, values, new_positions, query, scaling)

    def finish(self, storage: Storage, budget: int | list[int] | None = None) -> None:
        """Trim the pending forward to ``budget`` (the layer's own, set by the cache; one per row
        where the rows' differ) or the current one. Later forwards over the budget trim at once."""
        pending, self.pending = self.pending, None
        if isinstance(budget, list):
            self.budget = max(budget)
            self.row_budgets = budget if len(set(budget)) > 1 else None
        elif budget is not None:
            self.budget = budget
        self.waiting = False
        self.layout.trim(self, storage, pending)

    def real_lengths(self) -> list[int]:
        """Tokens of each row in the pending forward (pads and empty slots left out)."""
        return (self.pending.positions[:, 0] >= 0).sum(dim=-1).tolist()

    def kept_unranked(self) -> list[int]:
        """Per row, the most tokens of one head that the pending forward's trim keeps whatever their
        scores (ranked ``+inf``: the protected newest, sinks, an open chunk)."""
        pending = self.pending
        ranked = self.evictable(pending.positions, self.ranking(pending.positions, pending.scores))
        return (ranked == float("inf")).sum(dim=-1).amax(dim=-1).tolist()

    def candidate_scores(self) -> torch.Tensor:
        """The pending forward's ranking scores with protected tokens and pads at ``-inf``: what
        an adaptive allocation compares across layers."""
        pending = self.pending
        ranked = self.evictable(pending.positions, self.ranking(pending.positions, pending.scores))
        return ranked.masked_fill(ranked == float("inf"), float("-inf"))

    # --- the static decode step (unpadded batches whose rows share the layer's budget) ------------
    compileable = True

    def static_ready(self, storage: Storage) -> bool:
        return (
            self.budget is not None and self.pending is None and not self.padded
            and self.row_budgets is None and self.positions is not None and storage.is_allocated
            and storage.capacity == self.layout.static_capacity(self)
        )

    @property
    def slots_per_step(self) -> int:
        return self.positions.shape[1] if self.layout.pooled and self.positions is not None else 1

    def static_visible(self) -> torch.Tensor:
        """Every slot holding a token, and the free ones this step writes (a freed slot holds ``-1``
        until then)."""
        return (self.positions >= 0).scatter_(-1, self.free, True)

    def _enter_static(self, storage: Storage) -> list[torch.Tensor]:
        storage.prepare_row_writes()
        self.live_t = torch.full((), self.live, dtype=torch.long, device=storage.device)
        if not self.has_free and not self.layout.pooled:
            self.free.fill_(self.live)  # while the slots fill, the next one is the append
        return [self.live_t, self.positions, self.scores, self.free, *self.extra.values()]

    def zero_new_state(self, slot: torch.Tensor) -> None:
        """Zero the scores and per-slot state at ``slot`` (``[batch, kv_heads, n]``) for the new
        tokens, unless the statistic sets them itself."""
        if not self.sets_new_state:
            self._zero_state(slot)

    def _zero_state(self, slots: torch.Tensor) -> None:
        """Scores and per-slot state zeroed at ``slots`` (``[batch, kv_heads, n]``)."""
        for t in (self.scores, *self.extra.values()):
            t.scatter_(-1, slot_index(slots, t), 0.0)

    def static_step(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, query=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layout's static step (:meth:`HeadLayout.static_step`, which advances the counts)."""
        query, scaling = self._checked_query(query, 1)
        returned = self.layout.static_step(self, storage, keys, values, query, scaling)
        if not torch.compiler.is_compiling():
            self.has_free = self.live >= storage.capacity
        return returned

    def _leave_static(self, storage: Storage, steps: int) -> None:
        self.has_free = self.live >= storage.capacity

    # --- what the head layouts share ----------------------------------------------------------
    def attended(self, keys, new_keys, new_values, slots, query, scaling, positions, values, first_position) -> Attended:
        """What a forward attends to (``values``: the values it sees beside ``keys``; its first new
        token at ``first_position``), with key and query masks where some slots hold no token of a
        row or head (padded batches, pooled heads, rows with their own budgets), and the buffer for
        attention's output where the cache wants it."""
        q = new_keys.shape[-2]
        first_new = keys.shape[-2] - q
        given = dict(positions=positions, new_values=new_values, first_position=first_position)
        wanted, self.output_wanted = self.output_wanted, False  # asked for this forward only
        self.attention_output = None
        if wanted and query is not None and query.shape[-2] == q:
            self.attention_output = new_attention_output(query, values)
            given.update(values=values, output=self.attention_output)
        if not self.padded and not self.layout.pooled and self.row_budgets is None:
            return Attended(keys, new_keys, first_new, slots, query, scaling, **given)
        query_mask = (positions[:, 0, first_new:] >= 0) if isinstance(slots, int) else None
        return Attended(keys, new_keys, first_new, slots, query, scaling, positions >= 0, query_mask, **given)

    def allocate(
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

    def record(self, slots: SlotIndex, new_positions: torch.Tensor | int, q: int) -> None:
        """New tokens at ``slots``: their positions, zero scores and state; ``seen`` advances."""
        if isinstance(slots, int):
            end = slots + q
            self.positions[..., slots:end] = new_positions
            self.scores[..., slots:end] = 0
            for t in self.extra.values():
                t[..., slots:end] = 0
            self.live = max(self.live, end)
        else:
            self.positions.scatter_(-1, slots, new_positions)
            self._zero_state(slots)
        self.seen += q

    def next_free(
        self,
        positions: torch.Tensor,
        scores: torch.Tensor,
        seen: int | torch.Tensor | None = None,
        every_slot_held: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[batch, kv_heads, 1]`` the slot a decode step frees: the lowest :meth:`ranking` of
        ``scores``, the oldest among ties (a statistic that ranks in position order chooses there)."""
        return self.lowest(positions, self.ranking(positions, scores, seen, every_slot_held), seen, every_slot_held, out)

    def lowest(
        self,
        positions: torch.Tensor,
        scores: torch.Tensor,
        seen: int | torch.Tensor | None = None,
        every_slot_held: bool = False,
        out: torch.Tensor | None = None,
        ascending: bool = False,
        newest: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[batch, kv_heads, 1]`` slot to evict: the lowest score, the oldest position among ties
        (written into ``out`` where given; ``ascending``: ``positions`` ascend along the last axis,
        empty slots first in slot order, so the first of the lowest is the one; ``newest``:
        :meth:`protected_newest` where the caller has it)."""
        ranked = self.evictable(positions, scores, seen, every_slot_held=every_slot_held, newest=newest)
        if self.row_budgets is not None:  # a row's unused slots never take a token
            ranked = ranked.masked_fill(positions == UNUSED, float("inf"))
        if ascending:
            return torch.argmin(ranked, dim=-1, keepdim=True, out=out)
        above = ranked != ranked.amin(dim=-1, keepdim=True)
        return torch.argmin(positions.masked_fill(above, torch.iinfo(positions.dtype).max), dim=-1, keepdim=True, out=out)

    def best_first(self, positions: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Indices of the tokens in the order they stay: the protected ones, then the best scores,
        the newest position among ties (ties are common after max pooling)."""
        newest_first = positions.argsort(dim=-1, descending=True, stable=True)
        ranked = self.evictable(positions, scores).gather(-1, newest_first)
        return newest_first.gather(-1, ranked.sort(dim=-1, descending=True, stable=True).indices)

    def per_row(self, best: torch.Tensor, width: int, per_row: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
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

    def evictable(
        self,
        positions: torch.Tensor,
        scores: torch.Tensor,
        seen: int | torch.Tensor | None = None,
        real: torch.Tensor | None = None,
        every_slot_held: bool = False,
        newest: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``scores`` with the protected newest positions at +inf (never evicted), empty slots at -inf
        (``seen``: tokens seen, the host count unless a static step gives the device one; ``real``:
        ``positions >= 0`` where the caller has it; ``every_slot_held``: no slot is empty;
        ``newest``: :meth:`protected_newest` where the caller has it). Each step skips what cannot
        change the ranking: a decode step pays for every operation."""
        newest = self.protected_newest(positions, seen) if newest is None else newest
        ranked = scores if newest is None else scores.masked_fill(newest, float("inf"))
        if every_slot_held:
            return ranked
        if real is not None:
            return torch.where(real, ranked, float("-inf"))
        return ranked.masked_fill(positions < 0, float("-inf"))

    def protected_newest(self, positions: torch.Tensor, seen: int | torch.Tensor | None = None) -> torch.Tensor | None:
        """Where ``positions`` are among the protected newest of their row (never evicted; none
        before ``protected_from``); ``None`` where nothing is protected (no position lies past
        ``seen - 1``, so with nothing protected nothing is raised)."""
        if not self.protected:
            return None
        seen = self.seen if seen is None else seen
        protected = self.protected if self.row_protected is None else self.row_protected
        oldest = seen - protected
        if self.protected_from:
            oldest = oldest.clamp(min=self.protected_from) if isinstance(oldest, torch.Tensor) else max(oldest, self.protected_from)
        return positions >= oldest

    # --- internals --------------------------------------------------------------------------
    def _resolve_rows(self, lengths: list[int], device: torch.device) -> None:
        """``budget`` and ``protected`` from the first forward: each row's from its own tokens (a
        budget given as a fraction of the prompt is a fraction of the row's, pads left out), so
        that a row of a padded batch keeps what it keeps alone; the largest sizes the storage."""
        resolved = []
        for length in lengths:
            budget, protected = self.resolve(length)
            if self.chunk > budget:  # a budget given as a fraction of the prompt is known only now
                raise ValueError(
                    f"chunk={self.chunk} is larger than the budget of {budget} tokens that this {length}-token prompt "
                    "gives: a chunk is kept or evicted whole, so give chunk <= the budget (or a larger fraction)"
                )
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

    @staticmethod
    def _first_real(padding: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
        """``[batch, 1, 1]`` each row's first real position (0 where unpadded): its first ``True``."""
        if padding is None:
            return torch.zeros(keys.shape[0], 1, 1, dtype=torch.long, device=keys.device)
        return padding.to(keys.device, torch.int8).argmax(dim=-1).view(-1, 1, 1)

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

    def ranks_among(self, positions: torch.Tensor | int, uneven: bool = False) -> torch.Tensor | None:
        """:meth:`~hf_kvpolicies.storage.base.Storage.write`'s ``ranks`` for tokens written together
        at ``positions`` (``[batch, heads, q]``; below 0: pads, unused slots), in the order written;
        ``None`` for one decoded token (always real), or an unpadded batch whose rows keep alike
        (``uneven``: some leave slots unused, and arrange the others as they do alone)."""
        if isinstance(positions, int) or not (self.padded or uneven) or positions.shape[-1] == 1 and not uneven:
            return None
        return real_ranks(positions >= 0)

    def _attend_then_score(self, storage, keys, values, new_positions, query, scaling):
        batch, heads, q = keys.shape[:3]
        if isinstance(new_positions, int):
            new_positions = torch.full((batch, heads, q), new_positions, device=keys.device)
        # attention sees the new tokens as the storage will hold them (a write then a read: fp8
        # rounds all but its residual), as a forward written in place does; the trim stores them as they came
        seen_keys, seen_values = storage.as_written(keys, values, ranks=self.ranks_among(new_positions))
        arrived = None
        if storage.is_allocated:
            old_keys, old_values, old_positions, old_scores, old_extra = self.layout.kept_state(self, storage)
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
        seen = self.attended(all_keys, keys, values, all_keys.shape[-2] - q, query, scaling, positions, all_values, self.seen)
        scores = self.score(seen, scores, extra)
        self.seen += q
        self.pending = Pending(all_keys, all_values, positions, scores, extra, arrived)
        if not self.waiting:
            self.finish(storage)
        return all_keys, all_values
