"""Streaming perplexity, the StreamingLLM way: feed tokens one at a time, never reset the cache."""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.cache_utils import Cache


@torch.no_grad()
def streaming_nll(
    model: PreTrainedModel, ids: torch.Tensor, cache: Cache, progress: bool = False, desc: str = "ppl"
) -> torch.Tensor:
    """Negative log-likelihood of every next token (``[n - 1]`` floats), one token per forward."""
    device = model.device
    ids = ids.to(device)
    nll = torch.empty(ids.shape[1] - 1, dtype=torch.float64)
    for t in tqdm(range(ids.shape[1] - 1), disable=not progress, desc=desc, leave=False):
        logits = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1].float()
        nll[t] = (torch.logsumexp(logits, -1) - logits[ids[0, t + 1]]).item()
    return nll


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.mean()))
