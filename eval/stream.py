"""Feeding a token stream through a cache: one token per forward, or C tokens per forward with
attention masks that make the result equal to one token per forward.

Token by token, the query at position ``t`` attends to what the cache kept of ``[0, t)`` plus
itself. A C-token forward over a bounded cache, left to the library, attends with ordinary
causal attention over the kept tokens and all C new ones (then trims): early queries of the
chunk would see tokens that streaming had already evicted. The fix is a banded 4-D mask: the
query at ``t`` sees key ``p`` iff ``p == t`` or ``p`` is among the tokens the retention keeps
of ``[0, t)``. Transformers uses a 4-D ``attention_mask`` as given.

That is exact only when what a layer keeps depends on positions alone and keys are stored as
they arrived (:func:`chunks_are_exact`): full, window and sinks at absolute positions, on native
storage. H2O (keeps by attention scores), sinks re-rotated to in-cache positions and lossy
storage change under chunking; their chunked runs are approximate, and labelled so.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from hf_kvpolicies.cache import PolicyCache
from hf_kvpolicies.masks import MASK_FORMATS, masks_by_layer_type
from hf_kvpolicies.retention import Retention

DEFAULT_CHUNK = 256
"""Tokens per forward where chunking is exact and no ``--chunk-size`` is given."""


def chunks_are_exact(cache: Cache, model: PreTrainedModel) -> bool:
    """Whether C tokens per forward under :func:`streaming_masks` equal token-by-token streaming."""
    if not isinstance(cache, PolicyCache) or cache.storage != "native":
        return False
    if model.config._attn_implementation not in MASK_FORMATS:
        return False  # the mask must reach attention as a 4-D tensor
    return all(layer.retention.keeps_by_position for layer in cache.layers)


def resolve_chunk(cache: Cache, model: PreTrainedModel, requested: int | None) -> tuple[int, bool]:
    """``(tokens per forward, approximate)`` for a run.

    ``requested=None`` (the default mode) chunks only where that is exact and streams the other
    policies token by token, so every default figure is the streaming one.
    """
    exact = chunks_are_exact(cache, model)
    chunk = (DEFAULT_CHUNK if exact else 1) if requested is None else requested
    return chunk, chunk > 1 and not exact


def streamed_keys(retention: Retention, query_length: int) -> torch.Tensor:
    """Boolean ``[q, kv]``: which of the keys the next update returns each new query would see
    when fed token by token (the retention must keep by position alone)."""
    key_pos = retention.key_positions(query_length)
    lookup, real = key_pos.clamp(min=0), key_pos >= 0
    kept = torch.zeros(retention.seen + query_length, dtype=torch.bool)  # by position, reused per query
    rows = []
    for t in range(retention.seen, retention.seen + query_length):
        history = torch.arange(t)
        kept.zero_()
        kept[history[retention.select(history)]] = True
        kept[t] = True
        rows.append(kept[lookup] & real)
    return torch.stack(rows)


def streaming_masks(cache: PolicyCache, query_length: int, model: PreTrainedModel):
    """The ``attention_mask`` for the next forward of ``query_length`` tokens: one tensor, or
    ``{layer_type: mask}`` for models that mix sliding and full attention layers."""
    return masks_by_layer_type(
        cache.layers,
        lambda retention: streamed_keys(retention, query_length)[None, None].to(model.device),
        model.config._attn_implementation,
        model.dtype,
    )


def forward_ends(length: int, chunk: int, stops: Iterable[int] = ()) -> list[int]:
    """Where the forwards over ``length`` tokens end: every ``chunk`` tokens from the start and
    from each stop, and at each stop."""
    ends, start = [], 0
    for mark in sorted({*(stop for stop in stops if 0 < stop < length), length}):
        ends += [*range(start + chunk, mark, chunk), mark]
        start = mark
    return ends


@torch.no_grad()
def feed(
    model: PreTrainedModel,
    ids: torch.Tensor,
    cache: Cache,
    chunk: int,
    every_logit: bool = True,
    stops: Iterable[int] = (),
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Run ``ids`` (``[batch, n]``, rows of equal length) through ``model`` into ``cache``,
    ``chunk`` tokens per forward, a forward also ending at each of ``stops`` (tokens fed: where an
    observer must see the cache, whatever the chunk).

    Yields ``(start, end, logits)`` after each forward: the logits of tokens ``[start, end)``
    (``[batch, end - start, vocab]``), or of the last one only (``[batch, 1, vocab]``) when
    ``every_logit`` is False, which spares the vocabulary projection of every other position.
    """
    ids = ids.to(model.device)
    # slots in position order (a full cache): transformers' own causal mask is already exact
    masked = (
        chunk > 1
        and chunks_are_exact(cache, model)
        and not all(layer.retention.in_position_order for layer in cache.layers)
    )
    keep = 0 if every_logit else 1
    ends = forward_ends(ids.shape[1], chunk, stops)
    for start, end in zip([0, *ends], ends):
        mask = streaming_masks(cache, end - start, model) if masked and end - start > 1 else None
        out = model(ids[:, start:end], attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=keep)
        yield start, end, out.logits
