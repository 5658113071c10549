"""FullCache: every token kept, the baseline of every comparison."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..cache import PolicyCache
from ..retention import FullRetention
from ..retention.full import checked_sizes
from ..storage import StorageFactory


class FullCache(PolicyCache):
    """Keeps every token, like ``DynamicCache``: the baseline every policy is compared with.

    Buffers are allocated for the prompt exactly and grow by a quarter when full, so
    appending is amortised O(1) and in place, and after the first decode step they never hold more
    than 1.25x the tokens kept; ``get_memory_footprint()`` counts the capacity that is paid for.
    Croppable like ``DynamicCache`` (assisted decoding, prompt lookup), on hybrid models too.

    ``max_length``: pre-size every layer to that many tokens, as transformers' ``StaticCache``
    does; decode steps then have static shapes and compile (``is_compileable``), and a forward
    past ``max_length`` is refused with ``ValueError``.

    ``block``: grow without a limit, by whole blocks of ``block`` slots, before the forward that
    needs them; decode steps between growths have static shapes and compile (``is_compileable``:
    ``generate()`` with a ``compile_config`` captures the step again for a new size until dynamo
    makes the size dynamic, three graphs for five growths). ``generate()`` grows the cache
    between steps; a compiled loop of your own cannot, so it is refused with ``ValueError`` when
    full (give ``max_length`` there). Eager decode steps read the block's unfilled slots under a
    mask, as a pre-sized cache reads its whole buffer.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_length: int | None = None,
        storage: str | StorageFactory = "native",
        block: int | None = None,
    ) -> None:
        max_length, block = checked_sizes(max_length, block)
        self.max_length, self.block = max_length, block
        super().__init__(model, lambda layout: FullRetention(max_length, block), storage=storage)
