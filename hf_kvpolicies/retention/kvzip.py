"""KVzip's statistic (Kim et al., 2025): the largest attention a token receives.

A prompt's tokens are scored by the context reconstruction (:mod:`hf_kvpolicies.reconstruction`),
which the cache runs once its first forward has ended (:class:`~hf_kvpolicies.policies.kvzip.KVzipCache`);
that forward's own attention is not scored. Every prompt token competes by its reconstruction
score, the prompt's last tokens included, as the paper and kvpress rank them. From then on,
every query that attends to a kept token (each decode step, each later chunk) may raise its
score: a score is the maximum over the reconstruction's queries and every later one, over the
query heads of its KV head. Of the tokens after the prompt, the ``recent`` newest are never
evicted, so a decoded token is scored by ``recent`` queries before it competes with the context
(unprotected, each answer token would be evicted as it is written: its score starts at zero).
Each row's first ``sinks`` tokens are kept in every head, as the paper's code keeps the prompt's
system prefix and kvpress its first 4 tokens: they hold the attention sink, which layers whose
reconstruction attends elsewhere would otherwise evict. They win their places by their score
(:data:`SINK_SCORE`), so an adaptive layer budget counts them as tokens its heads won.
Slots, eviction and trims are :class:`~hf_kvpolicies.retention.scored.ScoredRetention`'s.
"""

from __future__ import annotations

import torch

from ..attention_scores import max_attention
from .scored import Attended, ScoredRetention

SINK_SCORE = 2.0
"""A sink's score: above every attention probability (at most 1), so a sink ranks first at the
trim and its running maximum never falls below any other token's, so decoding never evicts it."""


class KVzipRetention(ScoredRetention):
    """Reconstruction scores for the prompt, then the running maximum of the attention received."""

    def __init__(self, budget: int, recent: int, sinks: int = 0, **options) -> None:
        super().__init__(budget=budget, protected=recent, **options)
        self.sinks = sinks
        self.awaiting_reconstruction = True
        """True until the cache has written the first forward's reconstruction scores."""

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.awaiting_reconstruction:
            return scores  # the first forward's scores come from the reconstruction that follows it
        return torch.maximum(
            scores,
            max_attention(seen.query, seen.keys, seen.scaling, seen.first_new, key_mask=seen.key_mask, query_mask=seen.query_mask),
        )

    def take_reconstruction(self, scores: torch.Tensor) -> None:
        """The first forward's scores ``[batch, kv_heads, tokens]``, from the cache's reconstruction."""
        self.awaiting_reconstruction = False
        self.waiting = self.pending is not None  # a prompt over the budget waits for its trim; later forwards do not wait
        self.protected_from = self.seen  # the prompt's tokens rank by these scores alone
        if self.sinks:
            positions = self.positions[..., : self.live] if self.pending is None else self.pending.positions
            real = positions >= 0  # in order, pads first: a row's first real tokens are its sinks
            scores = scores.masked_fill(real & (real.cumsum(dim=-1) <= self.sinks), SINK_SCORE)
        if self.pending is not None:  # over budget: the trim that follows ranks by them
            self.pending.scores = scores
            return
        self.scores[..., : self.live] = scores  # the prompt fits: stored in order, one slot per token
        if self.has_free:  # it filled budget + 1 slots: the slot to free is chosen again, now by score
            self.free = self.lowest(self.positions, self.scores)

    def reset(self) -> None:
        super().reset()
        self.awaiting_reconstruction = True
