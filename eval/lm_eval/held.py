"""What the policy cache held once each request's prompt was in, per lm-eval task: the figures a
record carries beside its scores (the frontier plots' bytes held and kept fraction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers.cache_utils import Cache

from hf_kvpolicies.cache import PolicyCache

from ..memory import footprint, held_bytes


@dataclass
class HeldLog:
    """Per task, one ``(fed, kept, held, allocated, rows)`` per batch of ``rows`` prompts: tokens
    fed through the budget, tokens the first governed layer kept, bytes held and allocated per
    sequence."""

    tasks: dict[str, list[tuple[int, int | None, int | None, int, int]]] = field(default_factory=dict)

    def add(self, task: str, cache: Cache, fed: int, rows: int) -> None:
        held = held_bytes(cache)
        kept = cache.kept_tokens() if isinstance(cache, PolicyCache) else None
        self.tasks.setdefault(task, []).append((fed, kept, None if held is None else held // rows, footprint(cache) // rows, rows))

    def fields(self) -> dict[str, dict]:
        """Per task: the most tokens kept, the kept fraction's mean over prompts, the most bytes
        held and allocated per sequence, as the harness's records give them."""
        found = {}
        for task, entries in self.tasks.items():
            kept = [entry[1] for entry in entries]
            held = [entry[2] for entry in entries if entry[2] is not None]
            fractions = [(k / fed, rows) for fed, k, _, _, rows in entries if k is not None and fed > 0]
            found[task] = {
                "kept_tokens": None if None in kept else max(kept),
                "kept_fraction": sum(f * rows for f, rows in fractions) / sum(rows for _, rows in fractions) if fractions else None,
                "held_bytes": max(held) if held else None,
                "allocated_bytes": max(entry[3] for entry in entries),
            }
        return found
