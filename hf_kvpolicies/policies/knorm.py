"""Key-norm statistic (Devoto et al., 2024): keys with a low L2 norm tend to draw attention.

A token's score is ``1 / ||k||`` of its key as the model computed it (before any storage
rounding), fixed when it arrives: the ``recent`` newest tokens plus the lowest-norm others stay.
No queries and no attention weights are needed, so it serves every attention implementation.

Scores are rounded to :data:`SCORE_BITS` significant bits. A token that recurs (a generation
loop repeats one token many times) has the same key norm wherever it stands in exact arithmetic,
most of all in the first layer, whose keys are a projection of the token's embedding, rotated; in
fp32 those norms differ in their last bits with the position's rotation and with the batch's
shape (a projection of 3 rows rounds differently from one of 1). Unrounded, such ties are broken
by that noise, so a row of a padded batch would keep other copies than the row alone; rounded,
they are exact ties, and the shared rule breaks them (the oldest copy goes first).

The preset, :class:`KNormCache`, builds it in every governed layer.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..retention.scored import ScoredRetention
from ..retention.scoring import Attended
from ..storage import StorageFactory
from ..validation import check_int
from .scored import HeadBudgets, LayerBudgets, ScoredCache


SCORE_BITS = 12
"""Significant bits of a score: a relative step of 2**-12 (2.4e-4), far above fp32's noise
(a few units of 2**-24) and far below the spread of distinct keys' norms."""


def rounded(scores: torch.Tensor, bits: int = SCORE_BITS) -> torch.Tensor:
    """``scores`` rounded to ``bits`` significant bits (half to even), exactly, in their own dtype."""
    mantissa, exponent = torch.frexp(scores)
    return torch.ldexp(torch.round(mantissa * 2.0**bits) / 2.0**bits, exponent)


class KNormRetention(ScoredRetention):
    """Recent window + the lowest-norm keys per (row, KV head)."""

    needs_queries = False

    def __init__(self, budget: int, recent: int, **options) -> None:
        super().__init__(budget, protected=recent, **options)

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        inverse = rounded(seen.new_keys.float().norm(dim=-1).reciprocal())
        if isinstance(seen.new_slots, int):
            scores[..., seen.new_slots : seen.new_slots + inverse.shape[-1]] = inverse
            return scores
        return scores.scatter(-1, seen.new_slots, inverse)


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
        storage: str | StorageFactory = "native",
    ) -> None:
        check_int("budget", budget, minimum=1)
        check_int("recent", recent, minimum=0)
        if recent > budget:
            raise ValueError(f"recent={recent} is larger than budget={budget}: give recent <= budget")
        self.budget, self.recent = budget, recent
        super().__init__(model, lambda **options: KNormRetention(budget, recent, **options), layer_budgets=layer_budgets, storage=storage, head_budgets=head_budgets)

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """``budget`` kept tokens, the protected recent ones among them: the default count, but never
        more than a quarter of the budget, so that most of it is chosen by key norm at every budget."""
        return {"budget": budget, "recent": min(RECENT, budget // 4)}
