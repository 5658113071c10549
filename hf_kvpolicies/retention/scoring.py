"""What a statistic scores: the keys one forward attends to, and a forward waiting for its trim."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..storage.base import SlotIndex


@dataclass
class Attended:
    """What one forward attends to, handed to :meth:`ScoredRetention.score`.

    ``keys`` are the keys attention sees (``[batch, kv_heads, k, head_dim]``); query ``i`` of the
    ``q`` new ones sits at key index ``first_new + i`` for causality; ``new_keys`` are the
    incoming keys as the model computed them (before any storage rounding), held at ``new_slots``
    of ``keys`` (a start index, or ``[batch, kv_heads, 1]`` for a decode step written in place);
    ``query`` holds the new queries (only the last ``query_rows`` where the statistic sets it),
    ``None`` for statistics that need no queries.
    ``key_mask``/``query_mask`` mark real tokens (``None``: every key and query is real).
    """

    keys: torch.Tensor
    new_keys: torch.Tensor
    first_new: int
    new_slots: SlotIndex
    query: torch.Tensor | None = None
    scaling: float = 1.0
    key_mask: torch.Tensor | None = None
    query_mask: torch.Tensor | None = None

    @property
    def q(self) -> int:
        return self.keys.shape[-2] - self.first_new


@dataclass
class Pending:
    """A scored forward waiting for its trim: every key it attended to (as the storage will hold
    them), with positions and scores, and the same keys as they arrived, which the trim stores."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    arrived: tuple[torch.Tensor, torch.Tensor] | None = None
    """Keys and values to store where they differ from what attention saw (``None``: the same)."""

    @property
    def to_store(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.arrived if self.arrived is not None else (self.keys, self.values)
