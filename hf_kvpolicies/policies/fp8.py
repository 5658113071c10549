"""FP8Cache: every token kept, held as fp8 with per-token scales and a native residual."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..cache import PolicyCache
from ..retention import FullRetention
from ..retention.full import checked_sizes
from ..storage.fp8 import DEFAULT_RESIDUAL, FP8Storage


class FP8Cache(PolicyCache):
    """A full cache in fp8: 0.53x the memory of the same cache in bf16 at 4K tokens (0.27x of fp32),
    everything included (payload, scales, residual, positions).

    Keys and values are stored as ``dtype`` (``float8_e4m3fn``; ``float8_e5m2`` trades precision
    for range) with a power-of-two scale per token and KV head, and the last ``residual`` tokens
    written are also kept in the model's precision (see :mod:`hf_kvpolicies.storage.fp8`). Each
    layer dequantises its slots when attention reads them: one layer's transient copy at a time.

    For another retention policy in fp8, pass ``storage="fp8"`` (defaults), a name with options,
    ``storage="fp8:residual=0;dtype=e5m2"``, or ``storage=FP8Storage.factory(residual=0)``.
    ``max_length`` pre-sizes it and ``block`` grows it by whole blocks (compile-able decode steps
    either way), as for :class:`FullCache`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        residual: int = DEFAULT_RESIDUAL,
        dtype: str | torch.dtype = "float8_e4m3fn",
        max_length: int | None = None,
        block: int | None = None,
    ) -> None:
        max_length, block = checked_sizes(max_length, block)
        self.residual, self.fp8_dtype, self.max_length, self.block = residual, dtype, max_length, block
        storage = FP8Storage.factory(residual=residual, dtype=dtype)
        super().__init__(model, lambda layout: FullRetention(max_length, block), storage=storage)
