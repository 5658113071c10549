"""TOVA's statistic (Oren et al., 2024): the attention of the current query alone.

At every step the token the current query attends to least (averaged over the query heads that
share a KV head) is evicted, the new token included; no window is protected. A prompt longer
than the budget is trimmed by its last token's attention.
"""

from __future__ import annotations

import torch

from ..attention_scores import query_probabilities
from .scored import Attended, ScoredRetention


class TOVARetention(ScoredRetention):
    """The ``budget`` tokens the latest query attends to most, per (row, KV head)."""

    query_rows = 1  # the latest query only

    def __init__(self, budget: int, **options) -> None:
        super().__init__(budget, protected=0, **options)

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        # the latest query is the last key's: it sees every key
        return query_probabilities(seen.query[:, :, -1:], seen.keys, seen.scaling, seen.key_mask).mean(dim=2)
