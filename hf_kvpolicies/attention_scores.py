"""Attention probabilities for the score-based statistics, as functions of queries and keys.

The statistics (H2O's accumulated attention, TOVA's last query, SnapKV's observation window,
KVzip's largest attention) need the softmax probabilities that sdpa never returns. They are
recomputed here from the queries the hooks hand over (:mod:`hf_kvpolicies.hooks`) and the keys
attention sees, with transformers' eager arithmetic (``q @ k^T * scaling``, then an fp32
softmax), a chunk of queries at a time so that a long prompt never holds its whole query x key
matrix.

Where a statistic computes every query's probabilities over every key attention sees, it can also
compute attention's output from them (``values=``, ``output=``): the model's attention then
returns that output (:mod:`hf_kvpolicies.hooks`) instead of computing the softmax a second time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

SCORE_CHUNK_ELEMENTS = 1 << 20
"""Attention probabilities held at once while scoring a long prompt (4 MiB in fp32: a chunk stays
in cache between the product, the softmax and the sum, which is what makes scoring cheap)."""


def shares_one_key_row(keys: torch.Tensor) -> bool:
    """Whether ``keys`` is one key row expanded to every KV head (pooled heads hand attention such a
    view): scoring then multiplies every query head with that row, instead of a copy per KV head."""
    return keys.shape[1] > 1 and keys.stride(1) == 0


def lowest_logit(dtype: torch.dtype) -> float:
    """The logit a hidden key takes: the lowest finite one of ``dtype`` that stays finite in the
    fp32 softmax (float64's would become ``-inf`` there, and a query that sees only pads ``NaN``)."""
    return max(torch.finfo(dtype).min, torch.finfo(torch.float32).min)


def query_probabilities(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 softmax probabilities ``[batch, kv_heads, groups, k]`` of one query per query head
    (``query`` ``[batch, query_heads, 1, head_dim]``) over every key: a decode step's, which sees
    the whole cache. The arithmetic of :func:`attention_chunks` in as few operations as it takes:
    a decode step pays for each one in every layer."""
    batch, query_heads, _, head_dim = query.shape
    kv_heads, key_count = keys.shape[1], keys.shape[2]
    if shares_one_key_row(keys):
        keys = keys[:, :1]
    # three-dimensional products, as matmul makes of four-dimensional ones, without its expands and views
    rows = query.reshape(batch * keys.shape[1], -1, head_dim)
    logits = torch.bmm(rows, keys.flatten(0, 1).transpose(1, 2)).mul_(scaling).view(batch, kv_heads, -1, key_count)
    if key_mask is not None:  # the lowest finite logit, as attention_chunks
        logits = torch.where(key_mask[:, :, None], logits, lowest_logit(logits.dtype))
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def attention_chunks(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    first_new: int,
    key_mask: torch.Tensor | None = None,
    chunk_elements: int | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Causal softmax probabilities of ``query`` over ``keys``, a chunk of queries at a time.

    ``query`` is ``[batch, query_heads, q, head_dim]``, ``keys`` ``[batch, kv_heads, k, head_dim]``;
    query ``i`` sits at key index ``first_new + i`` and sees keys up to it. ``key_mask``
    (``[batch, kv_heads, k]`` bool, optional) hides keys that hold no token (padding). Yields
    ``(start, stop, probs)`` with fp32 ``probs[batch, kv_heads, groups, stop - start, end]`` over
    the first ``end = first_new + stop`` keys only (the later ones are in every query's future:
    a long prompt's scores cost half a full query x key product). Chunks hold at most
    ``chunk_elements`` (default :data:`SCORE_CHUNK_ELEMENTS`) probabilities; the arithmetic
    follows transformers' eager attention (``q @ k^T * scaling``, then an fp32 softmax).
    """
    batch, query_heads, length, head_dim = query.shape
    kv_heads, key_count = keys.shape[1], keys.shape[2]
    if length == 1 and first_new == key_count - 1:  # a decode step's one query sees every key
        yield 0, 1, query_probabilities(query, keys, scaling, key_mask).unsqueeze(-2)
        return
    groups = query_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, groups, length, head_dim)
    shared = shares_one_key_row(keys)
    step = max(1, (chunk_elements or SCORE_CHUNK_ELEMENTS) // (batch * query_heads * key_count))
    for start in range(0, length, step):
        stop = min(length, start + step)
        end = min(key_count, first_new + stop)
        if shared:
            rows = grouped[:, :, :, start:stop].reshape(batch, 1, kv_heads * groups * (stop - start), head_dim)
            logits = torch.matmul(rows, keys[:, :1, :end].transpose(-1, -2)).mul_(scaling)
        else:
            rows = grouped[:, :, :, start:stop].reshape(batch, kv_heads, groups * (stop - start), head_dim)
            logits = torch.matmul(rows, keys[:, :, :end].transpose(-1, -2)).mul_(scaling)
        logits = logits.view(batch, kv_heads, groups, stop - start, end)
        if key_mask is not None:  # the lowest finite logit: a query that sees only pads stays finite
            logits.masked_fill_(~key_mask[:, :, None, None, :end], lowest_logit(logits.dtype))
        if stop - start > 1:  # the chunk's own keys: each query sees those up to itself (in place, one block)
            future = torch.ones(stop - start, stop - start, dtype=torch.bool, device=keys.device).triu(1)
            logits[..., first_new + start : end].masked_fill_(future, float("-inf"))
        yield start, stop, torch.softmax(logits, dim=-1, dtype=torch.float32)


def accumulated_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    first_new: int,
    chunk_elements: int | None = None,
    key_mask: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax probability received by each key, summed over queries and the query heads of its KV head.

    Arguments as in :func:`attention_chunks`; ``query_mask`` (``[batch, q]`` bool, optional)
    drops the queries of pads; with ``values`` and ``output`` (:func:`new_attention_output`), the
    attention output of every query is written into ``output`` from the same probabilities.
    Returns fp32 ``[batch, kv_heads, k]``; the full query x key matrix of a long prompt is never
    held at once.
    """
    return received_attention(query, keys, scaling, first_new, chunk_elements, key_mask, query_mask, False, values, output)


def max_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    first_new: int,
    chunk_elements: int | None = None,
    key_mask: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """The largest softmax probability each key receives from any query, over the query heads of
    its KV head (KVzip's statistic). Arguments as in :func:`accumulated_attention`; returns fp32
    ``[batch, kv_heads, k]``, 0 for keys that no query sees (pads, the queries' future)."""
    return received_attention(query, keys, scaling, first_new, chunk_elements, key_mask, query_mask, True, values, output)


def received_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    first_new: int,
    chunk_elements: int | None,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    largest: bool,
    values: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each key's probabilities over the queries and the query heads of its KV head, chunk by
    chunk: their sum, or with ``largest`` their maximum (pad queries contribute 0 to either);
    with ``values``, attention's output written into ``output`` on the way."""
    batch, kv_heads, key_count = keys.shape[0], keys.shape[1], keys.shape[2]
    total: torch.Tensor | None = None
    for start, stop, probs in attention_chunks(query, keys, scaling, first_new, key_mask, chunk_elements):
        if values is not None:
            rows = probs.to(values.dtype).flatten(2, 3)  # [batch, kv_heads, groups * n, keys seen]
            output[:, :, :, start:stop] = torch.matmul(rows, values[:, :, : probs.shape[-1]]).unflatten(2, probs.shape[2:4])
        if query_mask is not None:
            probs = probs * query_mask[:, None, None, start:stop, None]
        received = probs.amax(dim=(2, 3)) if largest else probs.sum(dim=(2, 3))
        if total is None and received.shape[-1] == key_count:
            total = received  # a first chunk that sees every key (a decode step's): it is the total so far
            continue
        if total is None:  # the later keys are in this chunk's future: 0 until a later query sees them
            total = torch.zeros(batch, kv_heads, key_count, dtype=torch.float32, device=keys.device)
        seen = total[..., : received.shape[-1]]
        if largest:
            torch.maximum(seen, received, out=seen)
        else:
            seen += received
    if total is None:  # no queries
        return torch.zeros(batch, kv_heads, key_count, dtype=torch.float32, device=keys.device)
    return total


def new_attention_output(query: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """An empty ``[batch, kv_heads, groups, q, value_dim]`` buffer for the attention output of
    ``query`` (``[batch, query_heads, q, head_dim]``) over ``values`` (``[batch, kv_heads, k, value_dim]``)."""
    batch, heads, length, _ = query.shape
    kv_heads = values.shape[1]
    return values.new_empty(batch, kv_heads, heads // kv_heads, length, values.shape[-1])


def as_attention_result(output: torch.Tensor) -> torch.Tensor:
    """A filled :func:`new_attention_output` buffer as transformers' attention functions return
    their output: ``[batch, q, query_heads, value_dim]``, contiguous."""
    batch, kv_heads, groups, length, width = output.shape
    return output.view(batch, kv_heads * groups, length, width).transpose(1, 2).contiguous()
