"""How a total budget of kept tokens is shared among layers: uniform, pyramid or adaptive.

Every rule keeps the total (layers x the uniform budget) and leaves each layer at least its
protected tokens (and at least one token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PYRAMID_BETA = 20
"""PyramidKV's steepness: the last layer gets ``1 / beta`` of the uniform share of evictable tokens."""


def pyramid_budgets(budget: int, protected: int, layers: int, beta: int = PYRAMID_BETA) -> list[int]:
    """PyramidKV (Cai et al., 2024): the evictable part of each layer's budget (``budget - protected``)
    decreases linearly from the first layer (twice the uniform share minus the last's) to the last
    (the uniform share / ``beta``); every layer also keeps its ``protected`` tokens. Same total."""
    spare = budget - protected
    if layers == 1 or spare <= 0:
        return [budget] * layers
    low = spare / beta
    high = 2 * spare - low
    shares = [high - i * (high - low) / (layers - 1) for i in range(layers)]
    counts = _apportion(shares, spare * layers)
    return [max(1, protected + count) for count in counts]


def adaptive_budgets(candidates: list[torch.Tensor], reserve: list[int], total: int, pooled: bool = False) -> list[int]:
    """Each layer's budget when the tokens of all layers compete (AdaKV, KVzip).

    ``candidates[l]`` is ``[batch, kv_heads, k_l]`` ranking scores of layer ``l``'s evictable
    tokens (``-inf`` for the protected ones and pads). Each layer's scores are normalised to sum
    to one per row (so that no layer wins by the scale of its statistic), the best
    ``total - sum(reserve)`` tokens per (row, head) of all layers are chosen together, and each
    layer gets its ``reserve`` plus the tokens it won (rows and heads of one layer share its
    budget, the storage being one tensor per layer). A layer's budget is what its heads won on
    average, which is also what pooled heads (``pooled``) share.
    """
    normalised = []
    for scores in candidates:
        finite = torch.isfinite(scores)
        mass = torch.where(finite, scores.clamp(min=0), 0).sum(dim=(1, 2), keepdim=True).clamp(min=1e-30)
        normalised.append(torch.where(finite, scores.clamp(min=0) / mass, float("-inf")).flatten())
    batch, heads = candidates[0].shape[:2]
    spare = max(0, total - sum(reserve))
    everything = torch.cat(normalised)
    chosen = everything.topk(min(spare * batch * heads, everything.numel())).indices
    bounds = torch.tensor([0] + [t.numel() for t in normalised]).cumsum(0)
    won = torch.bucketize(chosen, bounds[1:], right=True).bincount(minlength=len(candidates))
    finite_won = [int(n) for n in won]  # plain ints: decided once per prompt, on the host
    counts = _apportion([n / (batch * heads) for n in finite_won], spare)
    limits = [scores.shape[-1] for scores in candidates]
    return [min(limit, r + c) for limit, r, c in zip(limits, reserve, counts)]


def busiest_head_budgets(candidates: list[torch.Tensor], reserve: list[int], total: int, pooled: bool = False) -> list[int]:
    """Each layer's budget when raw scores compete at the level of heads (KVzip's ranking).

    KVzip ranks the scores of every (layer, KV head, token) together, unnormalised (they are
    attention probabilities, comparable across layers), and lets each head keep what it wins.
    A layer's heads share one slot count here (one tensor per layer), so the layer is sized for
    its most demanding head: the best ``total - sum(reserve)`` tokens per (row, head) of all
    layers are chosen together, and each layer's share of them is proportional to the most any
    of its (row, KV head) won; each layer also keeps its ``reserve``. Same total.
    With ``pooled`` heads (one pooled storage row per layer) each head keeps exactly what it won:
    a layer's share is then what its heads won together, for its busiest row, over the heads.
    ``candidates`` as in :func:`adaptive_budgets`.
    """
    batch, heads = candidates[0].shape[:2]
    spare = max(0, total - sum(reserve))
    everything = torch.cat([scores.flatten() for scores in candidates])
    chosen = everything.topk(min(spare * batch * heads, everything.numel())).indices
    chosen = chosen[torch.isfinite(everything[chosen])]
    sizes = torch.tensor([scores.shape[-1] for scores in candidates], device=chosen.device)
    bounds = torch.cat([sizes.new_zeros(1), (sizes * batch * heads).cumsum(0)])
    layer = torch.bucketize(chosen, bounds[1:], right=True)
    row_head = (chosen - bounds[layer]) // sizes[layer]
    won = torch.zeros(len(candidates), batch * heads, dtype=torch.long, device=chosen.device)
    won.index_put_((layer, row_head), torch.ones_like(chosen), accumulate=True)
    demand = won.view(len(candidates), batch, heads).sum(dim=2).amax(dim=1) / heads if pooled else won.amax(dim=1)
    busiest = [float(n) for n in demand]  # plain numbers: decided once per prompt, on the host
    counts = _apportion(busiest, spare)
    return [min(int(size), r + c) for size, r, c in zip(sizes, reserve, counts)]


AdaptiveRule = Callable[..., list[int]]
"""``rule(candidates, reserve, total, pooled=...)``: the layer budgets of one row (as
:func:`adaptive_budgets` and :func:`busiest_head_budgets`)."""


def budgets_by_row(
    rule: AdaptiveRule, candidates: list[torch.Tensor], reserve: list[list[int]], fitting: list[list[int]], over: list[bool], pooled: bool
) -> list[list[int]]:
    """Per layer, each row's budget: every row ranks its own layers' tokens (``rule`` on that row
    alone, with its ``reserve`` and the total of its ``fitting`` budgets), so a row of a batch gets
    the budgets it gets alone, whatever its neighbours; a row whose tokens fit every layer (``over``
    false) keeps ``fitting``, its budgets where nothing competes. Arguments are per row, by layer."""
    by_row = [
        rule([scores[row : row + 1] for scores in candidates], reserve[row], sum(fitting[row]), pooled=pooled) if over[row] else fitting[row]
        for row in range(len(over))
    ]
    return [list(layer) for layer in zip(*by_row)]


def _apportion(shares: list[float], total: int) -> list[int]:
    """Integers summing to ``total`` (largest remainders), proportional to ``shares``."""
    scale = total / sum(shares) if sum(shares) > 0 else 0.0
    exact = [share * scale for share in shares]
    counts = [int(value) for value in exact]
    order = sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts
