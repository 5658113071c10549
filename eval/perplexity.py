"""Streaming perplexity, the StreamingLLM way: feed the tokens in order, never reset the cache,
keep the NLL of every next token; the overall PPL and the curve by position."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from .stream import feed


@torch.no_grad()
def streaming_nll(
    model: PreTrainedModel,
    ids: torch.Tensor,
    cache: Cache,
    progress: bool = False,
    desc: str = "ppl",
    chunk_size: int = 1,
    observer: Callable[[int], None] | None = None,
    stops: Iterable[int] = (),
) -> torch.Tensor:
    """Negative log-likelihood of every next token (``[n - 1]`` float64 on the CPU).

    ``chunk_size`` tokens go through each forward (see :mod:`eval.stream` for when that equals
    one at a time), a forward also ending at each of ``stops``; ``observer(tokens_fed)`` runs
    after each forward (memory sampling). The NLL stays on the model's device until the end: no
    host sync per token.
    """
    targets = ids[0, 1:].to(model.device)
    nll = torch.empty(targets.numel(), dtype=torch.float32, device=model.device)
    with tqdm(total=targets.numel(), disable=not progress, desc=desc, leave=False, unit="tok") as bar:
        for start, end, logits in feed(model, ids[:, :-1], cache, chunk_size, stops=stops):
            logits = logits[0].float()
            target = targets[start:end]
            nll[start:end] = torch.logsumexp(logits, -1) - logits.gather(-1, target[:, None])[:, 0]
            if observer is not None:
                observer(end)
            bar.update(end - start)
    return nll.double().cpu()


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.mean()))


def curve(nll: torch.Tensor, bins: int = 32) -> tuple[list[int], list[float]]:
    """Perplexity by position: ``(last position of each bin, PPL over the bin)``, ``bins`` equal bins.

    Windowed rather than cumulative, so a policy that degrades once its budget fills shows
    the drop where it happens instead of diluted by everything before.
    """
    size = max(1, math.ceil(nll.numel() / bins))
    positions, values = [], []
    for start in range(0, nll.numel(), size):
        part = nll[start : start + size]
        positions.append(start + part.numel())
        values.append(perplexity(part))
    return positions, values
