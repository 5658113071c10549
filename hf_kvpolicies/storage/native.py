"""Native storage: slots held in the model's own dtype, pre-allocated and written in place."""

from __future__ import annotations

import torch

from .base import SlotIndex, Storage, allocated, expand_slots


class NativeStorage(Storage):
    """Two pre-allocated tensors ``[batch, kv_heads, capacity, head_dim]`` in the model's dtype
    (the values' ``head_dim`` is their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def allocate(self, like: torch.Tensor, capacity: int, value_dim: int | None = None) -> None:
        batch, heads, _, head_dim = like.shape
        what = f"the keys of {capacity} slots"
        keys = allocated((batch, heads, capacity, head_dim), like.dtype, like.device, what)
        values = allocated((batch, heads, capacity, value_dim or head_dim), like.dtype, like.device, "the values" + what[8:])
        self.dtype, self.device, self.capacity, self.keys, self.values = like.dtype, like.device, capacity, keys, values

    @property
    def rows(self) -> int:
        return self.keys.shape[0]

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        old_keys, old_values, used = self.keys, self.values, self.capacity
        self.allocate(old_keys, capacity, value_dim=old_values.shape[-1])
        self.keys[:, :, :used] = old_keys
        self.values[:, :, :used] = old_values

    def write(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor) -> None:
        if isinstance(slots, int):
            end = slots + keys.shape[-2]
            self.keys[:, :, slots:end] = keys
            self.values[:, :, slots:end] = values
        elif slots.dim() == 1:
            self.keys.index_copy_(2, slots, keys)
            self.values.index_copy_(2, slots, values)
        else:  # one index where keys and values are as wide (multi-head latent attention: keys wider)
            index = expand_slots(slots, keys)
            self.keys.scatter_(2, index, keys)
            self.values.scatter_(2, index if values.shape[-1] == keys.shape[-1] else expand_slots(slots, values), values)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, :length], self.values[:, :, :length]

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if slots.dim() == 1:
            return self.keys.index_select(2, slots), self.values.index_select(2, slots)
        return self.keys.gather(2, expand_slots(slots, self.keys)), self.values.gather(2, expand_slots(slots, self.values))

    def reorder(self, batch_index: torch.Tensor) -> None:
        batch_index = batch_index.to(self.keys.device)
        self.keys = self.keys.index_select(0, batch_index)
        self.values = self.values.index_select(0, batch_index)

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def read_static(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def bytes_held(self, tokens: int) -> int:
        if self.keys is None:
            return 0
        per_slot = sum(t.shape[0] * t.shape[1] * t.shape[3] * t.element_size() for t in (self.keys, self.values))
        return tokens * per_slot
