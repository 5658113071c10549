"""H2O's statistic (Zhang et al., NeurIPS 2023): attention accumulated over every query so far.

A token's score is the sum of the softmax probabilities it has received from every query so far
(its own included), summed over the query heads that share its KV head. Each (row, KV head) keeps
the ``recent`` newest tokens plus the ``heavy`` best-scoring others; the slots, the in-place
eviction and the trims are :class:`~hf_kvpolicies.retention.scored.ScoredRetention`'s.

The preset, :class:`H2OCache`, builds it in every governed layer.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..attention_scores import accumulated_attention
from ..retention.scored import ScoredRetention
from ..retention.scoring import Attended
from ..storage import StorageFactory
from ..validation import check_tokens_or_fraction
from .scored import HeadBudgets, LayerBudgets, ScoredCache


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

    def computes_attention(self) -> bool:
        return True

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scores so far, accumulated in place (a decode step copies nothing back)."""
        return scores.add_(accumulated_attention(
            seen.query, seen.keys, seen.scaling, seen.first_new, None, seen.key_mask, seen.query_mask, seen.values, seen.output
        ))


class H2OCache(ScoredCache):
    """H2O (Zhang et al., 2023) inside an unmodified ``model.generate()``.

    Per layer and KV head, keeps the ``recent`` most recent tokens plus the ``heavy`` tokens with
    the largest accumulated attention (the sum of the softmax probabilities received from every
    query so far, over the query heads sharing the KV head). Integers are token counts; floats in
    (0, 1] are fractions of the length of the first forward's input (the prompt), fixed then: the
    paper's 10% + 10% is ``heavy=0.1, recent=0.1``.

    Once over budget, every decode step evicts one token per row and KV head and writes the new
    token into the freed slot in place; a prompt longer than the budget is prefilled normally,
    scored by its causal attention (in query chunks) and trimmed. A forward of several tokens is
    attended once: the statistic's probabilities give the model's attention output as well
    (:func:`~hf_kvpolicies.hooks.shared_attention`). Queries are seen through a
    pre-hook on the attention modules (see :mod:`hf_kvpolicies.attention_scores`), installed once
    per model and inert for every other cache; it works with ``sdpa`` and ``eager``.

    Left-padded batches keep, per row, what the row keeps alone (pads are never kept); beam
    search reorders the scores with the keys. The model's own sliding-window layers (Gemma 3)
    keep the model window. ``layer_budgets`` shares ``heavy + recent`` per layer among layers.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        heavy: int | float = 512,
        recent: int | float = 512,
        layer_budgets: LayerBudgets = "uniform",
        head_budgets: HeadBudgets = "uniform",
        chunk: int = 1,
        storage: str | StorageFactory = "native",
    ) -> None:
        check_tokens_or_fraction("heavy", heavy)
        check_tokens_or_fraction("recent", recent)
        if isinstance(heavy, int) and isinstance(recent, int) and heavy + recent < 1:
            raise ValueError(f"heavy + recent must keep at least 1 token, got heavy={heavy}, recent={recent}")
        self.heavy, self.recent = heavy, recent
        super().__init__(model, lambda **options: H2ORetention(heavy, recent, **options), layer_budgets=layer_budgets, storage=storage, head_budgets=head_budgets, chunk=chunk)

    budget_keys = ("heavy", "recent")

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """Half heavy hitters, half recent tokens (the paper's even split)."""
        return {"heavy": budget // 2, "recent": budget - budget // 2}
