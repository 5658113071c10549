"""FullCache: every token kept, the baseline of every comparison."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..cache import PolicyCache
from ..retention import FullRetention
from ..storage import StorageFactory
from ..validation import check_int


class FullCache(PolicyCache):
    """Keeps every token, like ``DynamicCache``: the baseline every policy is compared with.

    Buffers are allocated for the prompt exactly and grow by a quarter when full, so
    appending is amortised O(1) and in place, and after the first decode step they never hold more
    than 1.25x the tokens kept; ``get_memory_footprint()`` counts the capacity that is paid for.
    Croppable like ``DynamicCache`` (assisted decoding, prompt lookup), on hybrid models too.

    ``max_length``: pre-size every layer to that many tokens, as transformers' ``StaticCache``
    does; decode steps then have static shapes and compile (``is_compileable``), and a forward
    past ``max_length`` is refused with ``ValueError``.
    """

    def __init__(
        self, model: PreTrainedModel, max_length: int | None = None, storage: str | StorageFactory = "native"
    ) -> None:
        if max_length is not None:
            max_length = check_int("max_length", max_length, minimum=1)
        self.max_length = max_length
        super().__init__(model, lambda layout: FullRetention(max_length), storage=storage)
