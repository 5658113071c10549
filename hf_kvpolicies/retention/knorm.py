"""Key-norm statistic (Devoto et al., 2024): keys with a low L2 norm tend to draw attention.

A token's score is ``1 / ||k||`` of its key as the model computed it (before any storage
rounding), fixed when it arrives: the ``recent`` newest tokens plus the lowest-norm others stay.
No queries and no attention weights are needed, so it serves every attention implementation.
"""

from __future__ import annotations

import torch

from .scored import Attended, ScoredRetention


class KNormRetention(ScoredRetention):
    """Recent window + the lowest-norm keys per (row, KV head)."""

    needs_queries = False

    def __init__(self, budget: int, recent: int) -> None:
        super().__init__(budget, protected=recent)

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        inverse = seen.new_keys.float().norm(dim=-1).reciprocal()
        if isinstance(seen.new_slots, int):
            scores[..., seen.new_slots : seen.new_slots + inverse.shape[-1]] = inverse
            return scores
        return scores.scatter(-1, seen.new_slots, inverse)
