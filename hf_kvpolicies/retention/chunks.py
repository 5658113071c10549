"""ChunkKV's selection (Liu et al., 2025): tokens kept and evicted in chunks of neighbouring positions.

Any scored statistic can rank whole chunks instead of single tokens (``chunk=`` on every scored
policy), so that what is kept stays whole: the seven digits of a number, the words of a name. A
chunk is ``chunk`` neighbouring positions of one row and KV head, counted from the row's first
real token (a left-padded row chunks its tokens as it does alone). Each head ranks its own chunks,
as it keeps its own tokens (a budget per head, or heads sharing a pooled budget, chunks of every
head competing): summing over a layer's heads, as kvpress does, would make every head keep the
same positions, which per-head budgets exist to avoid.

:func:`chunk_ranking` maps the statistic's per-token ranking scores onto a ranking of chunks,
which the shared mechanism then uses as it uses any ranking (the lowest is evicted, the oldest
among ties; a trim keeps the best, the newest among ties):

* a **whole** chunk (all ``chunk`` of its positions kept) ranks by the sum of its tokens' finite
  scores; a token the statistic ranks ``+inf`` (a sink) keeps that rank and stays by itself, left
  out of its chunk's sum, and its chunk competes by the others;
* a chunk that has **begun to leave** (fewer kept) ranks below every whole one (``-inf``): once a
  chunk's first token is evicted, the next steps evict the rest of it, oldest first, before any
  whole chunk, and a trim keeps it only where room is left;
* the **open** chunk (the one holding the newest position, not yet whole) is protected (``+inf``)
  until it fills: the tokens being written are not ranked against finished chunks.

At a trim every chunk but the open one is whole, so whole chunks are kept best first, and the last
that fits only in part keeps its newest tokens. A decode step (one free slot per step) then
evicts in whole chunks over consecutive steps while the open chunk fills.
"""

from __future__ import annotations

import torch


def chunk_ranking(
    positions: torch.Tensor,
    ranked: torch.Tensor,
    start: torch.Tensor,
    seen: int | torch.Tensor,
    chunk: int,
    ascending: bool = False,
    every_slot_held: bool = False,
) -> torch.Tensor:
    """Per-token ranking scores ``[batch, heads, k]`` of ``positions``' chunks (``-1``/``-2``: no
    token) from per-token ``ranked`` scores; ``start`` ``[batch, 1, 1]``: each row's first real
    position; ``seen``: tokens seen (the newest position is ``seen - 1``); ``ascending``:
    ``positions`` ascend along the last axis and end with the newest (their chunks' ids then need
    no sort, and the open chunk is the last one's); ``every_slot_held``: no slot is empty. Fixed
    shapes, nothing read back: a decode step takes it as it is (a sort and a search of ``k`` ids
    per row and head), and skips what cannot change the ranking."""
    # a slot without a token (position -1 or -2) falls in a chunk of negative id, below every real one
    chunk_id = (positions - start).div(chunk, rounding_mode="floor")
    # one index per chunk in [0, k): where its id first stands among the sorted ids
    compact = torch.searchsorted(chunk_id if ascending else chunk_id.sort(dim=-1).values, chunk_id)
    counted = torch.nan_to_num(ranked, posinf=0.0, neginf=0.0)  # infinite ranks count for nothing
    if every_slot_held:
        tokens = torch.ones_like(counted)
    else:  # empty slots count for nothing, and are no tokens
        real = positions >= 0
        counted, tokens = torch.where(real, counted, 0.0), real.to(ranked.dtype)
    # each chunk's finite scores and its tokens, summed in one pass: [..., 2, k]
    summed = torch.stack([counted, tokens], dim=-2)
    index = compact.unsqueeze(-2).expand_as(summed)
    total, held = torch.zeros_like(summed).scatter_add_(-1, index, summed).gather(-1, index).unbind(-2)
    broken = held != chunk
    newest = chunk_id[..., -1:] if ascending else (seen - 1 - start).div(chunk, rounding_mode="floor")
    kept_anyway = ((chunk_id == newest) & broken) | (ranked == float("inf"))  # the open chunk until whole; sinks
    return total.masked_fill_(broken, float("-inf")).masked_fill_(kept_anyway, float("inf"))
