"""SnapKVCache: what the observation window (the prompt's end: the question) attends to."""

from __future__ import annotations

from typing import Literal

from transformers import PreTrainedModel

from ..retention.snapkv import SnapKVRetention
from ..storage import StorageFactory
from ..validation import check_choice, check_int
from .scored import HeadBudgets, LayerBudgets, ScoredCache

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
    :mod:`hf_kvpolicies.retention.snapkv`). Needs ``sdpa`` or ``eager`` attention.
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
            head_budgets=head_budgets,
        )

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """``budget`` kept tokens, the observation window among them: the default window and kernel,
        but the window never more than a quarter of the budget and the pooling never wider than an
        eighth of it, so that at every budget most of it is chosen by score (a window as large as
        the budget, or pooling that spans every kept token and ties them all, would keep the
        newest tokens: a sliding window under SnapKV's name)."""
        return {"budget": budget, "window": min(WINDOW, max(1, budget // 4)), "kernel": min(KERNEL, max(1, budget // 8) | 1)}
