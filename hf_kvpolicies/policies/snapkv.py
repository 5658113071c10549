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
window is the ``history`` state, ``[batch, kv_heads, window, slots]``, a ring: the query at
position ``p`` holds row ``p % window``, so a step writes one row in place of the oldest.

The preset, :class:`SnapKVCache`, builds it in every governed layer.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.nn import functional
from transformers import PreTrainedModel

from ..attention_scores import attention_chunks
from ..retention.chunks import chunk_ranking
from ..retention.scored import ScoredRetention
from ..retention.scoring import Attended, out_for, slot_index
from ..storage import StorageFactory
from ..validation import check_choice, check_int
from .scored import HeadBudgets, LayerBudgets, ScoredCache


class SnapKVRetention(ScoredRetention):
    """Observation window + the best-scoring others per (row, KV head)."""

    def __init__(self, budget: int, window: int, kernel: int, pooling: str, **options) -> None:
        super().__init__(budget, protected=window, **options)
        self.window, self.kernel, self.pooling = window, kernel, pooling
        self.query_rows = window  # the observation window's queries only

    sets_new_state = True  # the scores are the window's sum, set whole; the history column is zeroed here

    def extra_state(self, batch: int, heads: int, slots: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"history": torch.zeros(batch, heads, self.window, slots, dtype=torch.float32, device=device)}

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        count = min(self.window, seen.q)
        chunks = attention_chunks(
            seen.query[:, :, -count:], seen.keys, seen.scaling, seen.first_new + seen.q - count, seen.key_mask, 1 << 62
        )
        _, _, probs = next(chunks)
        rows = probs.sum(dim=2)  # [batch, kv_heads, count, keys]
        if seen.query_mask is not None:
            rows = rows * seen.query_mask[:, None, -count:, None]
        # a ring: the query at position p holds row p % window, so each query replaces the one
        # ``window`` positions before it, in place
        history, first = extra["history"], seen.first_position
        if count < seen.q:
            first = first + (seen.q - count)
        if isinstance(first, torch.Tensor):  # a static decode step: one query, the device count
            history.scatter_(-1, slot_index(seen.new_slots, history), 0.0)  # the new token's column
            history.index_copy_(2, torch.remainder(first, self.window).view(1), rows)
        elif count == 1:
            history[:, :, first % self.window] = rows[:, :, 0]
        else:
            history[:, :, torch.arange(first, first + count, device=history.device) % self.window] = rows
        return torch.sum(history, dim=2, out=out_for(scores))

    def selection_scores(
        self, positions: torch.Tensor, scores: torch.Tensor, seen: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Scores pooled over neighbouring positions (outside the window, pads excluded)."""
        if self.kernel == 1:
            return scores
        order = positions.argsort(dim=-1, stable=True)
        ordered = positions.gather(-1, order)
        pooled = self._pooled(ordered, scores.gather(-1, order), self.protected_newest(ordered, seen))
        return torch.empty_like(pooled).scatter_(-1, order, pooled)

    def next_free(
        self,
        positions: torch.Tensor,
        scores: torch.Tensor,
        seen: int | torch.Tensor | None = None,
        every_slot_held: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooling orders the slots by position: the lowest (of whole chunks where ``chunk`` > 1,
        as :meth:`ranking` ranks them) is chosen in that order, where the first of the lowest is
        the oldest, and mapped back to its slot."""
        if self.kernel == 1:
            return super().next_free(positions, scores, seen, every_slot_held, out)
        order = positions.argsort(dim=-1, stable=True)
        ordered = positions.gather(-1, order)
        window = self.protected_newest(ordered, seen)
        ranked = self._pooled(ordered, scores.gather(-1, order), window, every_slot_held)
        if self.chunk > 1:
            seen = self.seen if seen is None else seen
            ranked = chunk_ranking(ordered, ranked, self.row_start, seen, self.chunk, True, every_slot_held)
        chosen = self.lowest(ordered, ranked, seen, every_slot_held, ascending=True, newest=window)
        return torch.gather(order, -1, chosen, out=out)

    def _pooled(
        self, positions: torch.Tensor, scores: torch.Tensor, window: torch.Tensor, every_slot_held: bool = False
    ) -> torch.Tensor:
        """``scores`` of slots in ascending ``positions``, pooled over ``kernel`` neighbours; the
        ``window`` (a mask of it) and (unless ``every_slot_held``) empty slots take no part."""
        hidden = window if every_slot_held else window | (positions < 0)
        # [batch, heads, k] pools as (batch, channels, length); one-dimensional max pooling without
        # gradients runs the CPU's fast kernel (~6x the two-dimensional one's speed at 257 slots)
        if self.pooling == "max":
            return functional.max_pool1d(scores.masked_fill(hidden, float("-inf")), self.kernel, stride=1, padding=self.kernel // 2)
        return functional.avg_pool1d(scores.masked_fill(hidden, 0.0), self.kernel, stride=1, padding=self.kernel // 2)


WINDOW = 32
KERNEL = 21
"""Pooling width: measured on the eviction benchmark's needles (budget 256, 40 prompts), a
question attends to a fact's key ("the magic number for X is:") more than to the value after
it, and pooling must reach from the key over the value: kernel 7 keeps 3/40 numbers whole, 15
19/40, 21 36/40, 31 35/40 (streaming perplexity over 2,000 tokens: 13.73 at 7, 13.49 at 21)."""


class SnapKVCache(ScoredCache):
    """SnapKV (Li et al., 2024) inside an unmodified ``model.generate()``, bounded while decoding.

    Per layer and KV head, keeps the last ``window`` tokens plus the ``budget - window`` others
    that the window's queries attend to most (summed over the query heads of the KV head, smoothed
    by ``pooling`` over ``kernel`` neighbouring positions). Prefill a prompt that ends with the
    question at once: the window then is the question and the selection is query-aware.

    Decoding (which the paper leaves uncompressed) evicts one token per step by the same
    statistic kept up to date: the window slides with the stream, scores are the attention from
    the ``window`` most recent queries, pooled as at the prefill, and the ``window`` newest tokens stay (see
    :mod:`hf_kvpolicies.policies.snapkv`). Needs ``sdpa`` or ``eager`` attention.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        budget: int = 1024,
        window: int = WINDOW,
        kernel: int = KERNEL,
        pooling: Literal["max", "avg"] = "max",
        layer_budgets: LayerBudgets = "uniform",
        head_budgets: HeadBudgets = "uniform",
        chunk: int = 1,
        storage: str | StorageFactory = "native",
    ) -> None:
        check_int("budget", budget, minimum=1)
        check_int("window", window, minimum=1)
        check_int("kernel", kernel, minimum=1)
        if window > budget:
            raise ValueError(
                f"window={window} is larger than budget={budget}: the observation window is kept whole, "
                "so give window <= budget (raise budget or lower window)"
            )
        if kernel % 2 == 0:
            raise ValueError(f"kernel={kernel} must be odd (pooling is centred on each token): use {kernel + 1}")
        check_choice("pooling", pooling, ("max", "avg"))
        self.budget, self.window, self.kernel, self.pooling = budget, window, kernel, pooling
        super().__init__(
            model,
            lambda **options: SnapKVRetention(budget, window, kernel, pooling, **options),
            layer_budgets=layer_budgets,
            storage=storage,
            head_budgets=head_budgets, chunk=chunk,
        )

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """``budget`` kept tokens, the observation window among them: the default window and kernel,
        but the window never more than a quarter of the budget and the pooling never wider than an
        eighth of it, so that at every budget most of it is chosen by score (a window as large as
        the budget, or pooling that spans every kept token and ties them all, would keep the
        newest tokens: a sliding window under SnapKV's name)."""
        return {"budget": budget, "window": min(WINDOW, max(1, budget // 4)), "kernel": min(KERNEL, max(1, budget // 8) | 1)}
