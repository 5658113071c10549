"""Tokens seen and slots in use: one object that owns their host and device representations.

Eager forwards read and change the host ints. Static decode steps (the same code eagerly and under
torch.compile) advance a device copy of ``seen`` and never read anything back: eagerly the host
ints follow along (plain arithmetic), compiled they cannot change (dynamo would recompile for each
value), so they go *stale* until :meth:`Counts.sync` reads the device copy once, before the host
bookkeeping is used again (unless ``follow_compiled``: then they follow compiled steps too). As
``StaticLayer`` keeps one device counter, static steps keep one.
"""

from __future__ import annotations

import torch


class Counts:
    """``seen`` (tokens seen, kept or not) and ``live`` (slots ``[0, live)`` in use)."""

    def __init__(self, follow_compiled: bool = False) -> None:
        self.seen = 0
        self.live = 0
        self.seen_t: torch.Tensor | None = None
        """``seen`` on the device (0-d long) while static steps run."""
        self.static = False
        """True while decode steps are static: the device copy is authoritative."""
        self.stale = False
        """True once a compiled static step ran: the host ints lag ``seen_t`` until :meth:`sync`."""
        self.entry = (0, 0)
        """``(seen, live)`` when static steps began."""
        self.follow_compiled = follow_compiled
        """True where the host ints must stay current under compile too (a model's own sliding layer:
        transformers' sliding mask takes their kv offset as an int). Dynamo then recompiles once and
        makes them symbolic inputs, as for ``StaticSlidingWindowLayer.cumulative_length_int``."""

    def reset(self) -> None:
        self.__init__(self.follow_compiled)

    def enter(self, device: torch.device) -> torch.Tensor:
        """Static steps begin (eagerly): the device copy takes the host count; returns it."""
        if self.seen_t is None or self.seen_t.device != device:
            self.seen_t = torch.zeros((), dtype=torch.long, device=device)
        self.seen_t.fill_(self.seen)
        self.entry = (self.seen, self.live)
        self.static, self.stale = True, False
        return self.seen_t

    def advance(self, capacity: int, slots: int = 1) -> None:
        """One static step, which takes ``slots`` more slots until ``capacity`` are in use (a token
        per head where heads share a pool): the device count moves on; eagerly the host ints follow
        (nothing read back), compiled they go stale, or follow as well where ``follow_compiled``."""
        self.seen_t.add_(1)
        if torch.compiler.is_compiling() and not self.follow_compiled:
            self.stale = True
        else:
            self.seen += 1
            self.live = min(self.live + slots, capacity)

    def sync(self, capacity: int, slots: int = 1) -> int:
        """Static steps end: host ints brought up to date (one read when stale; ``slots`` as in
        :meth:`advance`); returns how many static steps ran."""
        if self.stale:
            self.seen = int(self.seen_t)
            self.live = min(self.entry[1] + slots * (self.seen - self.entry[0]), capacity)
        self.static = self.stale = False
        return self.seen - self.entry[0]
