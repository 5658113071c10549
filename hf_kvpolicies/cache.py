"""The container: one ``transformers.Cache`` whose layers each join a retention to a storage."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from .model_layout import LayerLayout, layer_layouts
from .retention import Retention, RingRetention
from .storage import Storage, StorageFactory, storage_factory

RetentionFactory = Callable[[LayerLayout], Retention]
"""Builds the retention of one of the model's full-attention layers."""


class PolicyLayer(CacheLayerMixin):
    """One layer's cache: ``retention`` decides the slots, ``storage`` holds them."""

    is_compileable = False  # shapes change while the cache fills: keep generate() from compiling

    def __init__(self, retention: Retention, storage: StorageFactory) -> None:
        super().__init__()
        self.retention = retention
        self._make_storage = storage
        self.storage: Storage = storage()

    @property
    def is_sliding(self) -> bool:
        return self.retention.is_sliding

    @property
    def is_croppable(self) -> bool:
        return self.retention.is_croppable

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.retention.update(self.storage, key_states[:, :, :0], value_states[:, :, :0])
        self.is_initialized = True
        self.device = key_states.device

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.retention.update(self.storage, key_states, value_states)
        self.is_initialized = True
        self.device = key_states.device
        return keys, values

    def get_seq_length(self) -> int:
        return self.retention.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_length = self.retention.returned_length(query_length)
        return kv_length, self.retention.seen + query_length - kv_length

    def get_max_length(self) -> int:
        return self.retention.max_length

    def reset(self) -> None:
        self.retention.reset()
        self.storage = self._make_storage()
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.storage.is_allocated:
            self.storage.reorder(beam_idx)
            self.retention.reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.storage.is_allocated:
            batch = self.storage_batch_size()
            self.reorder_cache(torch.arange(batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def storage_batch_size(self) -> int:
        keys, _ = self.storage.read(0)
        return keys.shape[0]

    def crop(self, tokens_to_remove: int) -> None:
        self.retention.crop(tokens_to_remove)

    def offload(self) -> None:
        raise NotImplementedError("hf-kvpolicies caches do not offload layers to the CPU")

    prefetch = offload


class PolicyCache(Cache):
    """A cache made of one :class:`PolicyLayer` per decoder layer of ``model``.

    The model's own sliding-window layers (Gemma 3, Qwen with ``layer_types``) keep exactly the
    window the model was trained with, as transformers' ``DynamicSlidingWindowLayer`` does,
    whatever the policy: they are bounded already, and their mask is the model's. The policy's
    retention governs the full-attention layers. Both use the chosen storage.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        retention: RetentionFactory,
        storage: str | StorageFactory = "native",
    ) -> None:
        make_storage = storage_factory(storage)
        self.layouts = layer_layouts(model)
        layers = [
            PolicyLayer(
                RingRetention(layout.sliding_window - 1, banded=True) if layout.is_sliding else retention(layout),
                make_storage,
            )
            for layout in self.layouts
        ]
        super().__init__(layers=layers)
        self.governed = [not layout.is_sliding for layout in self.layouts]
        """Per layer: True where the policy's retention governs it (not the model's own window kept as is)."""
        self.storage = storage
        from .masks import attach_mask_hook  # the hook module imports this one

        attach_mask_hook(model)
        self.attn_implementation = model.config._attn_implementation

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int] | None:
        """The constructor keywords that spend a total of ``budget`` kept tokens per layer.

        ``None`` for policies that keep every token (full, FP8): a budget does not apply to them.
        Budget sweeps (``hf-kvpolicies eval --budgets``) build each bounded policy this way.
        """
        return None

    @property
    def governed_layers(self) -> int:
        """How many layers the policy governs; a run where it governs none measures nothing."""
        return sum(self.governed)

    def get_memory_footprint(self) -> int:
        """Bytes of every persistent tensor this cache holds, pre-allocated capacity included.

        Capacity counts because it is memory the user pays for: a full cache doubles its
        buffers when they fill, a bounded one allocates its ring (``budget + 1`` slots) once.
        """
        return sum(layer.storage.nbytes + layer.retention.state_nbytes for layer in self.layers)

    def stored_tokens(self, layer_idx: int = 0) -> int:
        """Tokens currently kept by a layer (``get_seq_length`` counts every token seen)."""
        return self.layers[layer_idx].retention.stored

    @property
    def first_policy_layer(self) -> int:
        """Index of the first layer the policy governs: the model's own sliding-window layers
        (Gemma 3) keep the model's window whatever the policy; 0 when every layer is sliding."""
        return next((i for i, layer in enumerate(self.layers) if not layer.is_sliding), 0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={len(self.layers)}, storage={self.storage!r})"
