"""FullCache: every token kept, the baseline of every comparison."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..cache import PolicyCache
from ..retention import FullRetention
from ..storage import StorageFactory


class FullCache(PolicyCache):
    """Keeps every token, like ``DynamicCache``: the baseline every policy is compared with.

    Buffers are pre-allocated (256 slots at least) and double when full, so appending is
    amortised O(1) and ``get_memory_footprint()`` counts the capacity that is paid for.
    """

    def __init__(self, model: PreTrainedModel, storage: str | StorageFactory = "native") -> None:
        super().__init__(model, lambda layout: FullRetention(), storage=storage)
