"""SlidingWindowCache: the most recent tokens only."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..cache import PolicyCache
from ..retention import RingRetention
from ..storage import StorageFactory
from ..validation import check_int


class SlidingWindowCache(PolicyCache):
    """Each layer keeps the ``window`` most recent tokens; a new token attends to them and itself.

    Decoding writes in place into a ring of ``window + 1`` slots (the new token overwrites the
    one leaving the window): O(1) work per token, no concatenation, and memory that stays
    constant once the ring is allocated. A prompt longer than the window is prefilled with
    ordinary causal attention over the whole prompt and trimmed afterwards (token-by-token
    streaming would instead let each prompt token see only the ``window`` before it); a chunk
    arriving at a full ring attends to the kept window and to itself causally, then is trimmed.

    ``get_seq_length()`` counts every token seen, so positions stay absolute. Left-padded
    batches get an exact per-row mask (each row sees what it would alone), and beam search
    reorders the ring with the rows. Unlike transformers' ``DynamicSlidingWindowLayer``, which
    serves a model trained with a window, this bounds any model's full-attention layers.
    """

    def __init__(self, model: PreTrainedModel, window: int = 1024, storage: str | StorageFactory = "native") -> None:
        window = check_int("window", window, minimum=1)
        self.window = window
        super().__init__(model, lambda layout: RingRetention(window), storage=storage)

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """A window of ``budget`` tokens."""
        return {"window": budget}
