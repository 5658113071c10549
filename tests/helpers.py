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
def greedy(model: PreTrainedModel, ids: torch.Tensor, cache: Cache | None, new_tokens: int, **kwargs) -> torch.Tensor:
    extra = {} if cache is None else {"cache": cache}
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **extra, **kwargs)
