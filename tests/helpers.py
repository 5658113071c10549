"""Small drivers shared by the tests: a hand-written forward loop and greedy generation."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache


@torch.no_grad()
def prefill_then_decode(model: PreTrainedModel, ids: torch.Tensor, cache: Cache, prefill: int) -> torch.Tensor:
    """Logits of every position: one forward over ``ids[:, :prefill]``, then one token at a time."""
    logits = [model(ids[:, :prefill], cache=cache, use_cache=True).logits]
    for t in range(prefill, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


@torch.no_grad()
def stream_long(model: PreTrainedModel, cache: Cache, ids: torch.Tensor) -> int:
    """Feed all of ``ids`` (10,000 tokens or more): chunks up to 2,000, 40 single-token steps that
    must write into the same key buffer of layer 0 (in place, no new tensor), then chunks to the
    end. Returns the footprint at token 2,000, for comparing with the one at the end."""
    for start in range(0, 2000, 500):
        model(ids[:, start : start + 500], cache=cache)
    at_2000 = cache.get_memory_footprint()
    buffer = cache.layers[0].storage.keys
    for t in range(2000, 2040):
        model(ids[:, t : t + 1], cache=cache)
    assert cache.layers[0].storage.keys is buffer  # decode steps wrote into the ring, no new tensor
    for start in range(2040, ids.shape[1], 995):
        model(ids[:, start : start + 995], cache=cache)
    return at_2000


@torch.no_grad()
def greedy(model: PreTrainedModel, ids: torch.Tensor, cache: Cache | None, new_tokens: int, **kwargs) -> torch.Tensor:
    extra = {} if cache is None else {"cache": cache}
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **extra, **kwargs)


@torch.no_grad()
def streaming_reference(
    model: PreTrainedModel, ids: torch.Tensor, window: int, sinks: int = 0, causal_prefix: int = 0
) -> torch.Tensor:
    """Logits of one full-sequence forward under an explicit 4-D mask: each query sees itself,
    the ``window`` tokens before it and the first ``sinks`` tokens (the first ``causal_prefix``
    queries, a prefilled prompt, see every token before them). The model's own sliding layers
    keep their trained window."""
    batch, length = ids.shape
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    seen = (q - k <= window) | (k < sinks) | (q < causal_prefix)
    mask = ((k <= q) & seen).expand(batch, 1, length, length)
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        trained = ((k <= q) & (q - k <= model.config.sliding_window - 1)).expand(batch, 1, length, length)
        mask = {"full_attention": mask, "sliding_attention": trained}
    return model(ids, attention_mask=mask).logits


@torch.no_grad()
def generated_logits(
    model: PreTrainedModel, ids: torch.Tensor, cache: Cache, new_tokens: int, **kwargs
) -> torch.Tensor:
    """``[batch, new_tokens, vocab]`` logits of greedy generation (EOS suppressed: every row runs to the end)."""
    out = model.generate(
        ids, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True, **kwargs,
    )
    return torch.stack(out.logits, dim=1)


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch from rows (``[1, n]``) of different lengths, left-padded with the pad id 0, and its mask."""
    length = max(row.shape[1] for row in rows)
    ids = torch.cat([torch.nn.functional.pad(row, (length - row.shape[1], 0)) for row in rows])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(row), (length - row.shape[1], 0)) for row in rows])
    return ids, mask


def real_positions(cache: Cache, row: int, shift: int = 0) -> list[list[list[int]]]:
    """Per layer and KV head, the positions a row keeps, shifted by ``shift`` (pads and the ``-1``
    that pad the rows of pooled heads left out)."""
    return [
        [[p - shift for p in head.tolist() if p >= 0] for head in layer.retention.kept_positions()[row]]
        for layer in cache.layers
    ]


def forward_with_attentions(model: PreTrainedModel, ids: torch.Tensor, start: int, stop: int, cache: Cache):
    """The naive references' forward: tokens ``[start, stop)`` of every row at their absolute
    positions, into ``cache``, returning the eager attention weights with the logits."""
    batch, length = ids.shape[0], stop - start
    return model(
        ids[:, start:stop],
        position_ids=torch.arange(start, stop).expand(batch, length),
        cache=cache,
        use_cache=True,
        output_attentions=True,
    )
