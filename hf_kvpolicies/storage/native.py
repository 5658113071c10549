"""Native storage: slots held in the model's own dtype, pre-allocated and written in place."""

from __future__ import annotations

import torch

from .base import SlotIndex, Storage, allocated, expand_slots, put


class NativeStorage(Storage):
    """Two pre-allocated tensors ``[batch, kv_heads, capacity, head_dim]`` in the model's dtype
    (the values' ``head_dim`` is their own)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._rows_heads: tuple[torch.Tensor, torch.Tensor] | None = None
        """``[batch, 1, 1]`` and ``[1, heads, 1]`` aranges: with per-row slots ``[batch, heads, q]``,
        the index of one ``index_put_`` per tensor (built before static steps or at the first such
        write, not at every write; counted in :attr:`nbytes`)."""

    def allocate(self, like: torch.Tensor, capacity: int, value_dim: int | None = None) -> None:
        batch, heads, _, head_dim = like.shape
        what = f"the keys of {capacity} slots"
        keys = allocated((batch, heads, capacity, head_dim), like.dtype, like.device, what)
        values = allocated((batch, heads, capacity, value_dim or head_dim), like.dtype, like.device, "the values" + what[8:])
        self.dtype, self.device, self.capacity, self.keys, self.values = like.dtype, like.device, capacity, keys, values
        self._rows_heads = None

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

    def write(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor | None = None) -> None:
        if isinstance(slots, int) or slots.dim() == 1:
            put(self.keys, slots, keys)
            put(self.values, slots, values)
        else:  # per row and head: one indexed write each, whatever the widths
            index = (*self._index_rows_heads(), slots)
            self.keys.index_put_(index, keys)
            self.values.index_put_(index, values)

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
        self._rows_heads = None

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def prepare_row_writes(self) -> None:
        self._index_rows_heads()

    def _index_rows_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows_heads is None:
            batch, heads = self.keys.shape[:2]
            device = self.keys.device
            self._rows_heads = (torch.arange(batch, device=device).view(batch, 1, 1), torch.arange(heads, device=device).view(1, heads, 1))
        return self._rows_heads

    def rewrite_keys_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        put(self.keys, slots, keys)

    def read_static(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        index = 0 if self._rows_heads is None else sum(t.nbytes for t in self._rows_heads)
        return self.keys.nbytes + self.values.nbytes + index

    def bytes_held(self, tokens: int) -> int:
        if self.keys is None:
            return 0
        per_slot = sum(t.shape[0] * t.shape[1] * t.shape[3] * t.element_size() for t in (self.keys, self.values))
        return tokens * per_slot
