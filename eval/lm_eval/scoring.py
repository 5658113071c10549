"""Log-likelihoods scored through a policy cache, as lm-eval's ``loglikelihood`` requests ask.

Which tokens go through the budget. A request is a context ``c_0 .. c_{n-1}`` and a continuation
``t_0 .. t_{m-1}``:

1. the context but its last token, ``c_0 .. c_{n-2}``, goes into the cache under the protocol:
   ``prefill`` and ``last-token-kept``: one forward with causal attention over all of it, after
   which the policy trims to its budget; ``streamed``: through the budget, each token seeing what
   the policy kept of those before it (in exact chunks where chunking is exact, else one at a time);
2. the last context token and the continuation but its last token, ``c_{n-1}, t_0 .. t_{m-2}``,
   follow as decoded tokens do: each sees what the cache kept and itself, then joins the cache
   (the policy evicting as it does while decoding), in exact chunks where that is exact;
3. ``t_i`` is scored by the log-softmax of the logits of the token before it, and the request is
   greedy where each ``t_i`` is its distribution's argmax (lm-eval's ``is_greedy``).

So every continuation token, the first included, is scored from the tokens the policy kept: a
one-token continuation (a multiple-choice letter) sees the trimmed context, not the whole one.
Under ``prefill`` the first ``n - 1`` tokens' keys and values are those of the one forward that
saw all of them; under ``streamed``, those of a stream through the budget. A cache that keeps
every token gives lm-eval's ``hf`` scores under every protocol.

Contexts of equal length go through step 1 together; the cache is then copied row by row for
each of their continuations (a multiple-choice context is fed once for all its choices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ..stream import feed, resolve_chunk

Scores = list[tuple[float, bool]]


@torch.no_grad()
def prime(model: PreTrainedModel, ids: torch.Tensor, cache: Cache, streams: bool, chunk: int) -> None:
    """Feed ``ids`` (``[rows, n]``, ``n`` may be 0) into ``cache``: through the budget in ``chunk``
    tokens per forward (``streams``; other chunks follow), else in one forward the policy trims after."""
    if ids.shape[1] == 0:
        return
    if streams:
        for _ in feed(model, ids, cache, chunk, every_logit=False):
            pass
    else:
        model(ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)


@torch.no_grad()
def score_contexts(
    model: PreTrainedModel,
    contexts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[Sequence[int]]],
    make_cache: Callable[[], Cache],
    streams: bool,
    softmax_dtype: torch.dtype | None = None,
    primed: Callable[[Cache, int, int], None] | None = None,
) -> list[Scores]:
    """``(log-likelihood, greedy)`` of each continuation of each context, as the module says.

    ``contexts`` have one length (none padded); ``continuations[i]`` are those of ``contexts[i]``.
    ``primed(cache, fed, rows)`` is called once the contexts but their last tokens are in.
    """
    cache = make_cache()
    chunk, _ = resolve_chunk(cache, model, None)
    heads = torch.tensor([list(context[:-1]) for context in contexts], dtype=torch.long)
    prime(model, heads, cache, streams, chunk)
    if primed is not None:
        primed(cache, heads.shape[1], heads.shape[0])
    owners = [i for i, conts in enumerate(continuations) for _ in conts]
    if owners != list(range(len(contexts))):
        cache.reorder_cache(torch.tensor(owners, device=model.device))  # a copy of a context's row per continuation
    fed = [[contexts[i][-1], *cont[:-1]] for i, conts in enumerate(continuations) for cont in conts]
    width = max(map(len, fed))
    ids = torch.tensor([row + [row[-1]] * (width - len(row)) for row in fed])  # right padding: never attended to
    logits = torch.cat([part for _, _, part in feed(model, ids, cache, chunk)], dim=1)
    logprobs = F.log_softmax(logits, dim=-1, dtype=softmax_dtype)
    scores: list[Scores] = [[] for _ in contexts]
    for row, (owner, cont) in enumerate(zip(owners, (cont for conts in continuations for cont in conts))):
        target = torch.tensor(cont, device=logprobs.device)
        part = logprobs[row, : len(cont)]
        greedy = bool((part.argmax(-1) == target).all())
        scores[owner].append((float(part.gather(-1, target[:, None]).sum()), greedy))
    return scores
