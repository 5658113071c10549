"""Key-norm statistic (Devoto et al., 2024): keys with a low L2 norm tend to draw attention.

A token's score is ``1 / ||k||`` of its key as the model computed it (before any storage
rounding), fixed when it arrives: the ``recent`` newest tokens plus the lowest-norm others stay.
No queries and no attention weights are needed, so it serves every attention implementation.

Scores are rounded to 12 significant bits (:func:`~hf_kvpolicies.retention.scoring.rounded`), so
that copies of one token (a generation loop repeats one token many times) tie exactly, whatever
fp32 noise their norms carry, and the shared rule breaks the tie (the oldest copy goes first).

The preset, :class:`KNormCache`, builds it in every governed layer.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..retention.scored import ScoredRetention
from ..retention.scoring import Attended, rounded
from ..storage import StorageFactory
from ..validation import check_int
from .scored import HeadBudgets, LayerBudgets, ScoredCache


class KNormRetention(ScoredRetention):
    """Recent window + the lowest-norm keys per (row, KV head)."""

    needs_queries = False
    sets_new_state = True  # the new key's score is its norm

    def __init__(self, budget: int, recent: int, **options) -> None:
        super().__init__(budget, protected=recent, **options)

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        return seen.write_new(scores, rounded(seen.new_keys.float().norm(dim=-1).reciprocal()))


RECENT = 32


class KNormCache(ScoredCache):
    """Key-norm eviction (Devoto et al., 2024) inside an unmodified ``model.generate()``.

    Per layer and KV head, keeps the ``recent`` newest tokens plus the ``budget - recent`` others
    whose keys have the lowest L2 norm. It reads no queries and no attention weights, so it works
    with every attention implementation (``flex_attention`` and ``flash_attention_2`` included;
    padded batches need ``sdpa`` or ``eager`` for their exact mask). Tested on CPU under eager, sdpa
    and flex_attention (torch 2.13 compiles flex there; pyramid or adaptive layer budgets under
    flex on CPU still hit an inductor compile error, "'cur_kvSplitSize0' was not declared", so use
    sdpa for those); flash_attention_2 has no CPU kernel, its construction is accepted.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        budget: int = 1024,
        recent: int = RECENT,
        layer_budgets: LayerBudgets = "uniform",
        head_budgets: HeadBudgets = "uniform",
        chunk: int = 1,
        storage: str | StorageFactory = "native",
    ) -> None:
        check_int("budget", budget, minimum=1)
        check_int("recent", recent, minimum=0)
        if recent > budget:
            raise ValueError(f"recent={recent} is larger than budget={budget}: give recent <= budget")
        self.budget, self.recent = budget, recent
        super().__init__(model, lambda **options: KNormRetention(budget, recent, **options), layer_budgets=layer_budgets, storage=storage, head_budgets=head_budgets, chunk=chunk)

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """``budget`` kept tokens, the protected recent ones among them: the default count, but never
        more than a quarter of the budget, so that most of it is chosen by key norm at every budget."""
        return {"budget": budget, "recent": min(RECENT, budget // 4)}
