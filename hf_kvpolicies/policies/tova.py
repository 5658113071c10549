"""TOVA's statistic (Oren et al., 2024): the attention of the current query alone.

At every step the token the current query attends to least (averaged over the query heads that
share a KV head) is evicted, the new token included; no window is protected. A prompt longer
than the budget is trimmed by its last token's attention.

The preset, :class:`TOVACache`, builds it in every governed layer.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..attention_scores import query_probabilities
from ..retention.scored import ScoredRetention
from ..retention.scoring import Attended, out_for
from ..storage import StorageFactory
from ..validation import check_int
from .scored import HeadBudgets, LayerBudgets, ScoredCache


class TOVARetention(ScoredRetention):
    """The ``budget`` tokens the latest query attends to most, per (row, KV head)."""

    query_rows = 1  # the latest query only
    sets_new_state = True  # every score is the latest query's attention

    def __init__(self, budget: int, **options) -> None:
        super().__init__(budget, protected=0, **options)

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        # the latest query is the last key's: it sees every key
        probabilities = query_probabilities(seen.query[:, :, -1:], seen.keys, seen.scaling, seen.key_mask)
        return torch.mean(probabilities, dim=2, out=out_for(scores))


class TOVACache(ScoredCache):
    """TOVA (Oren et al., 2024) inside an unmodified ``model.generate()``.

    Per layer and KV head, keeps ``budget`` tokens: once full, every decode step evicts the token
    (the new one included) with the lowest attention from the current query, averaged over the
    query heads sharing the KV head; a longer prompt is trimmed by its last token's attention.
    Needs ``sdpa`` or ``eager`` attention.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        budget: int = 1024,
        layer_budgets: LayerBudgets = "uniform",
        head_budgets: HeadBudgets = "uniform",
        chunk: int = 1,
        storage: str | StorageFactory = "native",
    ) -> None:
        check_int("budget", budget, minimum=1)
        self.budget = budget
        super().__init__(model, lambda **options: TOVARetention(budget, **options), layer_budgets=layer_budgets, storage=storage, head_budgets=head_budgets, chunk=chunk)
