"""KeyDiff's statistic (Park et al., 2025): keys least like the others' average direction stay.

The anchor is the mean of a head's L2-normalised keys; a token's score is the cosine distance of
its key to the anchor, ``1 - cos`` (kvpress's ``KeyDiffPress`` scores ``-cos``: the same ranking,
shifted to be non-negative as adaptive layer budgets, which compare each layer's share of its
score mass, need), so the tokens whose keys point where most keys point are evicted first. No
queries and no attention weights are needed, so it serves every attention implementation.

The anchor moves as tokens come and go, and every score is relative to it, so each forward
scores every key it sees afresh, over the kept keys and the new ones of the row and head (empty
slots and pads left out of the anchor): two products of the keys with one vector, as cheap as one
query's attention. Scores are the keys as attention sees them (fp8-rounded under fp8 storage),
rounded to 12 significant bits (:func:`~hf_kvpolicies.retention.scoring.rounded`), so that the
fp32 noise of another batch shape never flips a near-tie. The ``recent`` newest tokens stay.

The preset, :class:`KeyDiffCache`, builds it in every governed layer.
"""

from __future__ import annotations

import functools

import torch
from transformers import PreTrainedModel

from ..attention_scores import shares_one_key_row
from ..retention.scored import ScoredRetention
from ..retention.scoring import Attended, out_for, rounded
from ..storage import StorageFactory
from ..validation import check_int
from .scored import HeadBudgets, LayerBudgets, ScoredCache


class KeyDiffRetention(ScoredRetention):
    """Recent window + the keys least similar to the mean normalised key, per (row, KV head)."""

    needs_queries = False
    sets_new_state = True  # every score is taken anew from the keys held

    def __init__(self, budget: int, recent: int, **options) -> None:
        super().__init__(budget, protected=recent, **options)

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        keys = seen.keys[:, :1] if shares_one_key_row(seen.keys) else seen.keys  # pooled heads share one row
        keys = keys.float()
        inverse = keys.norm(dim=-1).clamp_(min=1e-12).reciprocal_()  # [batch, heads, k]
        weights = inverse if seen.key_mask is None else inverse * seen.key_mask
        # three-dimensional products (a decode step pays for matmul's expands and views); the sum
        # of the unit keys is the anchor's direction, which is all a cosine reads; similarity is then
        # each key's length times its cosine
        batch, heads, count = weights.shape
        if keys.shape[1] == heads:  # a key row per head: the heads are the batch of the products
            rows = keys.flatten(0, 1)  # [batch * heads, k, dim]
            anchor = _unit(torch.bmm(weights.view(batch * heads, 1, count), rows))
            similarity = torch.bmm(rows, anchor.transpose(1, 2)).view(batch, heads, count)
        else:  # one key row under a mask per head (pooled heads): the heads are one product's rows
            rows = keys[:, 0]  # [batch, k, dim]
            anchor = _unit(torch.bmm(weights, rows))  # [batch, heads, dim]
            similarity = torch.bmm(rows, anchor.transpose(1, 2)).transpose(1, 2)
        out = out_for(scores)
        distance = torch.addcmul(_one(keys.device), similarity, inverse, value=-1, out=out)  # 1 - cos
        return rounded(distance, out=out)


@functools.lru_cache(maxsize=16)
def _one(device: torch.device) -> torch.Tensor:
    """A 0-dimensional 1 on ``device``, made once per device (a step would pay an operation for a new one)."""
    return torch.ones((), device=device)


def _unit(vectors: torch.Tensor) -> torch.Tensor:
    """``vectors`` scaled to unit length along the last axis, in place (a zero one stays zero)."""
    return vectors.div_(vectors.norm(dim=-1, keepdim=True).clamp_(min=1e-12))


RECENT = 32


class KeyDiffCache(ScoredCache):
    """KeyDiff (Park et al., 2025) inside an unmodified ``model.generate()``.

    Per layer and KV head, keeps the ``recent`` newest tokens plus the ``budget - recent`` others
    whose keys are least similar (cosine) to the mean of the head's normalised keys, recomputed at
    every step over the keys kept (see :mod:`hf_kvpolicies.policies.keydiff`). It reads no queries
    and no attention weights, so it works with every attention implementation (padded batches
    need ``sdpa`` or ``eager`` for their exact mask).
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
        super().__init__(
            model, lambda **options: KeyDiffRetention(budget, recent, **options),
            layer_budgets=layer_budgets, storage=storage, head_budgets=head_budgets, chunk=chunk,
        )

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """``budget`` kept tokens, the protected recent ones among them: the default count, but never
        more than a quarter of the budget, so that most of it is chosen by the statistic at every budget."""
        return {"budget": budget, "recent": min(RECENT, budget // 4)}
