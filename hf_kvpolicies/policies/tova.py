"""TOVACache: keep what the current query attends to."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..retention.tova import TOVARetention
from ..storage import StorageFactory
from ..validation import check_int
from .scored import HeadBudgets, LayerBudgets, ScoredCache


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
        storage: str | StorageFactory = "native",
    ) -> None:
        check_int("budget", budget, minimum=1)
        self.budget = budget
        super().__init__(model, lambda **options: TOVARetention(budget, **options), layer_budgets=layer_budgets, storage=storage, head_budgets=head_budgets)
