"""SlidingWindowCache: the most recent tokens only."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..cache import PolicyCache
from ..retention import RingRetention
from ..storage import StorageFactory
from ..validation import check_int


class SlidingWindowCache(PolicyCache):
    """Each layer keeps the ``window`` most recent tokens; a new token attends to them and itself.

    A prompt longer than the window is prefilled with ordinary causal attention over the whole
    prompt and trimmed afterwards (token-by-token streaming would instead let each prompt token
    see only the ``window`` before it). Decoding writes in place into a ring of ``window + 1``
    slots: O(1) work per token, constant memory.
    """

    def __init__(self, model: PreTrainedModel, window: int = 1024, storage: str | StorageFactory = "native") -> None:
        check_int("window", window, minimum=1)
        self.window = window
        super().__init__(model, lambda layout: RingRetention(window), storage=storage)
