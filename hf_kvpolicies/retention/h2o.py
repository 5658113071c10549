"""H2O's statistic (Zhang et al., NeurIPS 2023): attention accumulated over every query so far.

A token's score is the sum of the softmax probabilities it has received from every query so far
(its own included), summed over the query heads that share its KV head. Each (row, KV head) keeps
the ``recent`` newest tokens plus the ``heavy`` best-scoring others; the slots, the in-place
eviction and the trims are :class:`~hf_kvpolicies.retention.scored.ScoredRetention`'s.
"""

from __future__ import annotations

import torch

from ..attention_scores import accumulated_attention
from .scored import Attended, ScoredRetention


def tokens(value: int | float, prompt: int) -> int:
    """A budget in tokens: integers are counts, floats fractions of the prompt length."""
    return value if isinstance(value, int) else int(value * prompt)


class H2ORetention(ScoredRetention):
    """Heavy hitters + recent window per (row, KV head)."""

    def __init__(self, heavy: int | float, recent: int | float, **options) -> None:
        super().__init__(budget=0, protected=0, **options)
        self.requested_tokens = (heavy, recent)

    def token_budget(self) -> int | None:
        heavy, recent = self.requested_tokens
        return heavy + recent if isinstance(heavy, int) and isinstance(recent, int) else None

    def resolve(self, prompt: int) -> tuple[int, int]:
        """Fractions are of the first forward's length, fixed then."""
        heavy, recent = (tokens(value, prompt) for value in self.requested_tokens)
        if heavy + recent < 1:
            raise ValueError(
                f"heavy={self.requested_tokens[0]}, recent={self.requested_tokens[1]} keep {heavy + recent} tokens of "
                f"this {prompt}-token prompt: heavy + recent must come to at least 1 token; give larger fractions or token counts"
            )
        return heavy + recent, recent

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return scores + accumulated_attention(
            seen.query, seen.keys, seen.scaling, seen.first_new, key_mask=seen.key_mask, query_mask=seen.query_mask
        )
