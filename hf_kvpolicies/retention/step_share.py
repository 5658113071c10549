"""Values every layer of one forward computes alike, computed once per forward.

A decode step pays each operation in every layer, and some of a statistic's inputs depend only on
the forward's tokens, not on the layer: which of the new queries a running statistic counts, the
rotation of the window that follows them. The first layer of a cache to take from a
:class:`StepShare` (its leader, the first to run in every forward) computes them in every forward
and records them; a later layer of the same forward takes them. The leader overwrites them in every forward, so a
later layer never reads another forward's; a key the host knows without reading the device (the
new tokens' first position where the host has it, their count, the batch) guards against a
layer whose forward differs in shape, which then computes its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


class StepShare:
    """One forward's shared values, computed by the leader and taken by the later layers."""

    def __init__(self) -> None:
        self.leader: object | None = None
        self._key: Hashable | None = None
        self._value: Any = None

    def take(self, member: object, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The leader's value for this forward (``compute()`` by the leader, recorded under ``key``);
        a later layer's own ``compute()`` where its ``key`` differs. The first member to take leads
        (the first layer to run: a retention built but never run, such as a constructor's probe,
        does not)."""
        if self.leader is None:
            self.leader = member
        if member is self.leader:
            self._key, self._value = key, compute()
            return self._value
        return self._value if key == self._key else compute()
