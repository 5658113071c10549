"""SnapKV's statistic (Li et al., 2024): the attention a token receives from the observation window.

At prefill, each prompt token is scored by the softmax attention it receives from the last
``window`` prompt queries (which, in a prompt ending with a question, are the question), summed
over the query heads of its KV head; a trim ranks tokens by these scores smoothed by 1-D pooling
over positions (``kernel`` wide, ``max`` or ``avg``; the window itself is left out of the pooling,
as in the reference code), so that the neighbours of a selected token (the other digits of a
number) come with it. The window is always kept (it is the protected part of the budget).

The paper leaves decoding uncompressed; here the cache stays bounded, by the same statistic kept
up to date: the observation window slides with the stream. Each step's query joins it and the
oldest leaves, so a token's score is always the attention it received from the ``window`` most
recent queries (each as computed at its own step over the tokens kept then), and the token whose
score, pooled as at the prefill over the kept tokens in position order, is lowest outside the
``window`` newest is evicted. (Unpooled, the first decode steps would evict exactly the
neighbours that pooling kept: the other digits of a number.) The per-query attention of the
window is the ``history`` state, ``[batch, kv_heads, window, slots]``, oldest query first.
"""

from __future__ import annotations

import torch
from torch.nn import functional

from ..attention_scores import attention_chunks
from .scored import Attended, ScoredRetention


class SnapKVRetention(ScoredRetention):
    """Observation window + the best-scoring others per (row, KV head)."""

    def __init__(self, budget: int, window: int, kernel: int, pooling: str, **options) -> None:
        super().__init__(budget, protected=window, **options)
        self.window, self.kernel, self.pooling = window, kernel, pooling
        self.query_rows = window  # the observation window's queries only

    def extra_state(self, batch: int, heads: int, slots: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"history": torch.zeros(batch, heads, self.window, slots, dtype=torch.float32, device=device)}

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        count = min(self.window, seen.q)
        first = seen.first_new + seen.q - count
        chunks = attention_chunks(seen.query[:, :, -count:], seen.keys, seen.scaling, first, seen.key_mask, 1 << 62)
        _, _, probs = next(chunks)
        rows = probs.sum(dim=2)  # [batch, kv_heads, count, keys]
        if seen.query_mask is not None:
            rows = rows * seen.query_mask[:, None, -count:, None]
        history = extra["history"]
        if count < self.window:
            history[:, :, : self.window - count] = history[:, :, count:].clone()
        history[:, :, self.window - count :] = rows
        return history.sum(dim=2)

    def selection_scores(
        self, positions: torch.Tensor, scores: torch.Tensor, seen: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Scores pooled over neighbouring positions (outside the window, pads excluded)."""
        if self.kernel == 1:
            return scores
        seen = self.seen if seen is None else seen
        order = positions.argsort(dim=-1)
        ordered = scores.gather(-1, order)
        ordered_positions = positions.gather(-1, order)
        outside = (ordered_positions >= 0) & (ordered_positions <= seen - 1 - self.protected)
        neutral = float("-inf") if self.pooling == "max" else 0.0
        flat = ordered.masked_fill(~outside, neutral).reshape(-1, 1, ordered.shape[-1])
        pool = functional.max_pool1d if self.pooling == "max" else functional.avg_pool1d
        pooled = pool(flat, self.kernel, stride=1, padding=self.kernel // 2).view_as(ordered)
        return torch.empty_like(pooled).scatter_(-1, order, pooled)
