"""H2O retention: per row and KV head, the ``recent`` newest tokens plus the ``heavy`` heaviest hitters.

The statistic is the paper's (Zhang et al., NeurIPS 2023): a token's score is the sum of the
softmax probabilities it has received from every query so far (its own included), summed over
the query heads that share its KV head. It is local and greedy: no look-ahead.

Layout: ``heavy + recent + 1`` slots per (row, head). While the cache fills, tokens append. Once
``heavy + recent`` tokens are kept, a decode step writes its token *in place* into the free slot,
attention reads every slot (the kept tokens and the new one), the step's probabilities are added
to the scores, and the lowest-scoring token outside the recent window (the ``recent`` newest
positions, the new token included) is evicted: its slot becomes the free slot of the next step.
So each (row, head) holds its own set of positions: positions and scores are ``[batch, kv_heads,
slots]`` and writes address ``LongTensor[batch, kv_heads, 1]`` slots.

A multi-token forward that does not fit (a prompt longer than the budget, a later chunk) is
attended in full, kept tokens followed by the new ones under ordinary causal attention, scored in
query chunks, and trimmed to the budget: the recent window plus the ``heavy`` best-scoring others.

Scores are computed inside :meth:`H2ORetention.update` from the queries that
:mod:`hf_kvpolicies.attention_scores` hands over just before (``receive_query``), so they are
known before attention runs; the evicted token's slot is only overwritten at the next step.
"""

from __future__ import annotations

import torch

from ..attention_scores import accumulated_attention, sees_every_key
from ..storage import Storage
from ..storage.base import SlotIndex, expand_slots
from .base import Retention

PADDING_UNSUPPORTED = (
    "H2OCache does not support padded batches: every row and head keeps its own set of positions, "
    "which one attention mask per layer type cannot describe. Batch sequences of equal length "
    "without an attention mask, or run padded rows one at a time"
)


def tokens(value: int | float, prompt: int) -> int:
    """A budget in tokens: integers are counts, floats fractions of the prompt length."""
    return value if isinstance(value, int) else int(value * prompt)


class H2ORetention(Retention):
    """Heavy hitters + recent window per (row, KV head); one eviction per decoded token, in place."""

    def __init__(self, heavy: int | float, recent: int | float) -> None:
        super().__init__()
        self.requested = (heavy, recent)
        self.heavy: int | None = None
        self.recent: int | None = None
        """Budgets in tokens, fixed at the first update (fractions are of that prompt's length)."""
        self.positions: torch.Tensor | None = None
        """``[batch, kv_heads, slots]`` absolute position held by each slot."""
        self.scores: torch.Tensor | None = None
        """``[batch, kv_heads, slots]`` fp32 attention accumulated by each slot's token."""
        self.free: torch.Tensor | None = None
        """``[batch, kv_heads, 1]`` slot of the token evicted last, written by the next decode step."""
        self.has_free = False
        self._query: tuple[torch.Tensor, float] | None = None

    @property
    def budget(self) -> int:
        return self.heavy + self.recent

    def capacity(self, first_chunk: int) -> int:
        return self.budget + 1

    @property
    def max_length(self) -> int:
        return -1 if self.heavy is None else self.budget

    def plan(self, q: int) -> SlotIndex | None:
        if self.scores is None:
            return None  # the budget is fixed at the first update
        if self.has_free:
            return self.free if q == 1 else None
        return self.live if self.live + q <= self.scores.shape[-1] else None

    def select(self, positions: torch.Tensor) -> torch.Tensor:
        """Not used: H2O trims by score, per row and head (:meth:`_keep`), not by shared positions."""
        raise NotImplementedError("H2ORetention trims by score per row and head")

    def observe_padding(self, padding: torch.Tensor) -> None:
        """A padded batch (seen by the exact-mask hook before any forward, prefill included)."""
        raise NotImplementedError(PADDING_UNSUPPORTED)

    def receive_query(self, query: torch.Tensor, scaling: float, attention_mask: torch.Tensor | None) -> None:
        """The queries of the forward about to call :meth:`update` (handed over by the q_proj hook).

        The scores assume that every kept key is visible to every query (causality aside): a mask
        hiding keys from the last query (a custom 4-D mask, padding) is refused here too.
        """
        if attention_mask is not None and not sees_every_key(attention_mask):
            raise NotImplementedError(PADDING_UNSUPPORTED)
        self._query = (query, scaling)

    def update(self, storage: Storage, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = keys.shape[-2]
        if q == 0:
            return keys, values  # lazy initialisation: nothing arrives, nothing to score
        query, scaling = self._take_query(q)
        if not storage.is_allocated:
            self._allocate(storage, keys)
        slots = self.plan(q)
        if slots is None:
            return self._attend_then_trim(storage, keys, values, query, scaling)
        storage.write(slots, keys, values)
        self._record(slots, q)
        all_keys, all_values = storage.read(self.live)
        self.scores[..., : self.live] += accumulated_attention(query, all_keys, scaling, first_new=self.live - q)
        if self.live > self.budget:
            self._evict_one()
        return all_keys, all_values

    def kept_positions(self) -> torch.Tensor:
        """``[batch, kv_heads, kept]`` positions currently kept, ascending (for inspection and tests)."""
        index = self._kept_index()
        positions = self.positions[..., : self.live] if index is None else self.positions.gather(-1, index)
        return positions.sort(dim=-1).values

    def kept_slots(self) -> torch.Tensor:
        """``[batch, kv_heads, kept]`` slots of the kept tokens, in slot order (for iteration)."""
        index = self._kept_index()
        return torch.arange(self.live) if index is None else index

    def key_positions(self, q: int) -> torch.Tensor:
        """Positions differ per row and head; only padded batches would need them, and H2O rejects those."""
        raise NotImplementedError(PADDING_UNSUPPORTED)

    @property
    def state_nbytes(self) -> int:
        return sum(t.nbytes for t in (self.positions, self.scores, self.free) if t is not None)

    def reorder(self, batch_index: torch.Tensor) -> None:
        batch_index = batch_index.to(self.scores.device)
        self.positions = self.positions.index_select(0, batch_index)
        self.scores = self.scores.index_select(0, batch_index)
        self.free = self.free.index_select(0, batch_index)

    def reset(self) -> None:
        super().reset()
        self.heavy = self.recent = None
        self.positions = self.scores = self.free = None
        self.has_free = False
        self._query = None

    # --- internals --------------------------------------------------------------------
    def _take_query(self, q: int) -> tuple[torch.Tensor, float]:
        pending, self._query = self._query, None
        if pending is None or pending[0].shape[-2] != q:
            raise RuntimeError(
                "an H2O layer received keys without the queries of the same forward: use the cache only "
                "with the model it was built for (H2OCache(model) installs the hook that sees the queries)"
            )
        return pending

    def _allocate(self, storage: Storage, keys: torch.Tensor) -> None:
        prompt = keys.shape[-2]
        self.heavy, self.recent = (tokens(value, prompt) for value in self.requested)
        if self.budget < 1:
            heavy, recent = self.requested
            raise ValueError(
                f"heavy={heavy}, recent={recent} keep {self.budget} tokens of this {prompt}-token prompt: "
                "heavy + recent must come to at least 1 token; give larger fractions or token counts"
            )
        storage.allocate(keys, self.capacity(prompt))
        batch, heads = keys.shape[:2]
        shape = (batch, heads, storage.capacity)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=keys.device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=keys.device)
        self.free = torch.zeros(batch, heads, 1, dtype=torch.long, device=keys.device)

    def _record(self, slots: SlotIndex, q: int) -> None:
        if isinstance(slots, int):
            end = slots + q
            self.positions[..., slots:end] = torch.arange(self.seen, self.seen + q, device=self.positions.device)
            self.scores[..., slots:end] = 0
            self.live = max(self.live, end)
        else:
            self.positions.scatter_(-1, slots, self.seen)
            self.scores.scatter_(-1, slots, 0.0)
        self.seen += q

    def _evict_one(self) -> None:
        """Free the lowest-scoring slot outside the recent window (all slots are live here)."""
        self.free = self._evictable(self.positions, self.scores).argmin(dim=-1, keepdim=True)
        self.has_free = True

    def _kept_index(self) -> torch.Tensor | None:
        """``[batch, kv_heads, kept]`` slots of kept tokens, or ``None`` when they are ``[0, live)``."""
        if not self.has_free:
            return None
        slots = torch.arange(self.live - 1, device=self.free.device)
        return slots + (slots >= self.free)

    def _attend_then_trim(
        self, storage: Storage, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._kept_index()
        if index is None:
            old_keys, old_values = storage.read(self.live)
            old_positions, old_scores = self.positions[..., : self.live], self.scores[..., : self.live]
        else:
            old_keys, old_values = storage.gather(index)
            old_positions, old_scores = self.positions.gather(-1, index), self.scores.gather(-1, index)
        batch, heads, q = keys.shape[:3]
        new_positions = torch.arange(self.seen, self.seen + q, device=keys.device).expand(batch, heads, q)
        all_keys = torch.cat([old_keys, keys], dim=-2)
        all_values = torch.cat([old_values, values], dim=-2)
        positions = torch.cat([old_positions, new_positions], dim=-1)
        scores = torch.cat([old_scores, old_scores.new_zeros(batch, heads, q)], dim=-1)
        scores += accumulated_attention(query, all_keys, scaling, first_new=old_positions.shape[-1])
        self.seen += q
        stay = self._keep(positions, scores)
        index = expand_slots(stay, all_keys)
        storage.write(0, all_keys.gather(2, index), all_values.gather(2, index))
        self.positions[..., : self.budget] = positions.gather(-1, stay)
        self.scores[..., : self.budget] = scores.gather(-1, stay)
        self.live = self.budget
        self.has_free = False
        return all_keys, all_values

    def _keep(self, positions: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Indices (ascending) of the recent window plus the ``heavy`` best-scoring other tokens."""
        best = self._evictable(positions, scores).topk(self.budget, dim=-1).indices
        return best.sort(dim=-1).values

    def _evictable(self, positions: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` with the recent window (the ``recent`` newest positions) set to +inf: never evicted."""
        return scores.masked_fill(positions > self.seen - 1 - self.recent, float("inf"))
