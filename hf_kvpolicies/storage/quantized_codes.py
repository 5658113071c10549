"""The packed integer codes of one layer's keys or values, in the two layouts KIVI uses.

* :class:`TokenCodes`: each slot's vector quantised on its own, in groups of ``group``
  consecutive channels (KIVI's values). A slot's codes, zero points and scales depend on nothing
  else, so any write, anywhere, is final at once.
* :class:`ChannelCodes`: each channel quantised over groups of ``group`` consecutive slots
  (KIVI's keys: a channel's outliers stay within its own range). A group's range spans slots, so
  a token cannot be quantised on its own: the storage holds new tokens natively (its residual)
  and :meth:`ChannelCodes.code` quantises a group when one of its tokens leaves the residual,
  from the native tokens of the group it is given (fresh) and the codes of the others (survivors).

  With no survivor (an append that completes a group, a ring that has overwritten all of it) the
  range is the fresh tokens' own: KIVI exactly. With survivors (a slot freed anywhere by a scored
  policy, a ring passing the sinks' group), the grid stays where every fresh token falls within
  half a step of it, per channel, and the survivors' codes are untouched; a channel a fresh
  token falls outside widens to cover it, and that channel's survivors are re-rounded once onto
  the wider grid. Ranges widen only, until a group is all fresh again, so a survivor is
  re-rounded about as often as its group meets a new extreme, not at every write.

  **Sinks.** The keys of the first ``sinks`` slots (where every retention writes first: the
  stream's first tokens, a sink retention's sinks) are also held natively and read back exactly,
  and take no part in their group's range. The first token draws attention far beyond its
  content (the attention sink) and its key is an outlier in many channels: quantised with its
  group, it loses most of its precision and widens the range of the group's other tokens
  (IntactKV, Liu et al., 2024, keeps such pivot tokens in full precision for the same reason).
"""

from __future__ import annotations

import torch

from . import cpu_kernels
from .affine import affine_parameters, decode, decode_groups, encode, pack, packed_width, quantise_groups, unpack
from .base import SlotIndex, allocated, expand_slots, put, take


class TokenCodes:
    """Codes ``uint8 [batch, heads, capacity, packed]`` and per-slot zero points and scales
    ``[batch, heads, capacity, ceil(width / group)]`` in half precision."""

    def __init__(self, bits: int, group: int) -> None:
        self.bits, self.group = bits, group
        self.width = 0
        self.codes: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None

    def allocate(self, batch: int, heads: int, capacity: int, width: int, half: torch.dtype, device: torch.device, what: str) -> None:
        self.width = width
        groups = -(-width // self.group)
        self.codes = allocated((batch, heads, capacity, packed_width(width, self.bits)), torch.uint8, device, f"the {what} codes of {capacity} slots")
        self.zero = allocated((batch, heads, capacity, groups), half, device, f"the {what} zero points of {capacity} slots")
        self.scale = allocated((batch, heads, capacity, groups), half, device, f"the {what} scales of {capacity} slots")

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.zero, self.scale]

    def grow(self, capacity: int) -> None:
        self.codes, self.zero, self.scale = (_grown(t, capacity) for t in self.tensors())

    def reorder(self, batch_index: torch.Tensor) -> None:
        self.codes, self.zero, self.scale = (t.index_select(0, batch_index) for t in self.tensors())

    def store(self, slots: SlotIndex, x: torch.Tensor) -> None:
        codes, zero, scale = quantise_groups(x, self.group, -1, self.bits, self.zero.dtype)
        for tensor, content in zip(self.tensors(), (pack(codes, self.bits), zero, scale)):
            put(tensor, slots, content)

    def read(self, slots: SlotIndex, count: int, dtype: torch.dtype) -> torch.Tensor:
        """The decoded vectors at ``slots`` (``count`` from an ``int`` start)."""
        codes, zero, scale = (take(t, slots, count) for t in self.tensors())
        if isinstance(slots, int):
            fused = cpu_kernels.decode_groups(codes, zero, scale, count, self.width, self.group, -1, self.bits, dtype)
            if fused is not None:
                return fused
        return decode_groups(unpack(codes, self.bits, self.width), zero, scale, self.group, -1, dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self.codes is None else sum(t.nbytes for t in self.tensors())

    def slot_bytes(self) -> int:
        """Bytes of one slot of every row and head: codes, zero points and scales."""
        return sum(t[:, :, :1].nbytes for t in self.tensors())


class ChannelCodes:
    """Codes ``uint8 [batch, heads, groups x group, packed]`` (capacity rounded up to whole groups:
    a group's coding reads and writes all its slots at once) and per-group, per-channel zero points
    and scales ``[batch, heads, groups, width]`` in half precision; ``written`` is one past the
    highest slot written, per row and head (slots past it hold nothing to quantise)."""

    def __init__(self, bits: int, group: int, sinks: int) -> None:
        self.bits, self.group, self.sinks = bits, group, sinks
        self.width = self.capacity = 0
        self.codes: torch.Tensor | None = None
        self.zero: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.written: torch.Tensor | None = None
        self.sink_keys: torch.Tensor | None = None
        """``[batch, heads, sinks, width]`` in the model's dtype: the keys of slots ``[0, sinks)``."""

    def allocate(
        self, batch: int, heads: int, capacity: int, width: int, half: torch.dtype, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.width, self.capacity = width, capacity
        self.sink_keys = allocated((batch, heads, self.sinks, width), dtype, device, f"the {self.sinks} sink keys")
        groups = -(-capacity // self.group)
        slots = groups * self.group
        self.codes = allocated((batch, heads, slots, packed_width(width, self.bits)), torch.uint8, device, f"the key codes of {capacity} slots")
        self.zero = allocated((batch, heads, groups, width), half, device, f"the key zero points of {capacity} slots")
        self.scale = allocated((batch, heads, groups, width), half, device, f"the key scales of {capacity} slots")
        self.written = allocated((batch, heads), torch.long, device, "the keys' written slots")

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.zero, self.scale, self.written, self.sink_keys]

    def grow(self, capacity: int) -> None:
        groups = -(-capacity // self.group)
        self.codes = _grown(self.codes, groups * self.group)
        self.zero, self.scale = _grown(self.zero, groups), _grown(self.scale, groups)
        self.capacity = capacity

    def reorder(self, batch_index: torch.Tensor) -> None:
        self.codes, self.zero, self.scale, self.written, self.sink_keys = (t.index_select(0, batch_index) for t in self.tensors())

    def note_written(self, slots: SlotIndex, keys: torch.Tensor) -> None:
        """Advance ``written`` past ``slots`` and keep the keys written to sink slots (on the
        device, with no value read back)."""
        q, sinks = keys.shape[-2], self.sinks
        if isinstance(slots, int):
            self.written.clamp_(min=slots + q)
            if slots < sinks:
                count = min(sinks - slots, q)
                self.sink_keys[:, :, slots : slots + count] = keys[:, :, :count]
            return
        self.written.copy_(torch.maximum(self.written, slots.amax(dim=-1) + 1))  # [q] shared: a 0-d maximum
        if sinks:  # each sink slot takes the last key this write gives it
            written = slots.view(1, 1, -1) if slots.dim() == 1 else slots
            match = written.unsqueeze(-2) == torch.arange(sinks, device=keys.device).view(sinks, 1)
            match = match.expand(*keys.shape[:2], sinks, q)
            last = (match * torch.arange(1, q + 1, device=keys.device)).argmax(dim=-1)  # [b, h, sinks]
            given = keys.gather(2, expand_slots(last, keys))
            self.sink_keys.copy_(torch.where(match.any(dim=-1, keepdim=True), given, self.sink_keys))

    def read(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots ``[0, length)`` decoded (their groups' current grids), by the CPU kernels where they
        serve; otherwise the whole groups they touch are decoded in one broadcast operation and the
        first ``length`` slots returned (a view)."""
        decoded = cpu_kernels.decode_groups(self.codes, self.zero, self.scale, length, self.width, self.group, -2, self.bits, dtype)
        if decoded is None:
            groups = -(-length // self.group)
            codes = unpack(self.codes[:, :, : groups * self.group], self.bits, self.width)
            decoded = decode_groups(codes, self.zero[:, :, :groups], self.scale[:, :, :groups], self.group, -2, dtype)
        sinks = min(self.sinks, length)
        decoded[:, :, :sinks] = self.sink_keys[:, :, :sinks]
        return decoded[:, :, :length]

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``slots`` (``[n]`` or ``[batch, heads, n]``) decoded, sink slots native."""
        codes = unpack(take(self.codes, slots), self.bits, self.width)
        groups = torch.div(slots, self.group, rounding_mode="floor")
        zero, scale = (take(t, groups).float() for t in (self.zero, self.scale))
        decoded = decode(codes, zero, scale).to(dtype)
        if not self.sinks:
            return decoded
        sink = take(self.sink_keys, slots.clamp(max=self.sinks - 1))
        return torch.where((slots < self.sinks).unsqueeze(-1), sink.expand_as(decoded), decoded)

    def code(
        self,
        groups: torch.Tensor,
        natives: list[tuple[torch.Tensor, torch.Tensor]],
        run: tuple[int, torch.Tensor] | None = None,
    ) -> None:
        """Quantise ``groups`` (``[batch, heads, k]``, ``-1``: none) from the native keys given.

        ``natives``: ``(slots, keys)`` pairs (``[batch, heads, n]`` or ``[n]`` slots, ``-1`` for
        none; keys ``[batch, heads, n, width]``): the residual's entries, those a push just
        overwrote, a rewrite's tokens. ``run``: ``(start, keys)`` of a contiguous write. A slot
        found in them is fresh; a written slot found in none is a survivor (its codes are current).
        Entries that repeat a group compute the same result, so a row may name a group twice.
        """
        batch, heads, k = groups.shape
        size, width, bits, top_code = self.group, self.width, self.bits, 2**self.bits - 1
        row_group = groups.amax(dim=-1, keepdim=True)
        requested = row_group >= 0  # a row that names no group changes nothing (its -1 stand in for one it names)
        groups = torch.where(groups >= 0, groups, row_group).clamp(min=0)
        members = (groups.unsqueeze(-1) * size + torch.arange(size, device=groups.device)).flatten(2)  # [b, h, k * size]
        packed = take(self.codes, members)
        codes = unpack(packed, bits, width).view(batch, heads, k, size, width)
        zero, scale = (take(t, groups).float() for t in (self.zero, self.scale))  # [b, h, k, width]
        survivors = decode(codes, zero.unsqueeze(-2), scale.unsqueeze(-2))
        native, fresh = self._natives(members, natives, run)
        native = native.view(batch, heads, k, size, width)
        written = (members < self.written.unsqueeze(-1)) & (members >= self.sinks)  # sinks are held natively
        fresh = (fresh & written).view(batch, heads, k, size)
        surviving = (written.view(batch, heads, k, size) & ~fresh).any(dim=-1, keepdim=True)  # [b, h, k, 1]
        is_fresh = fresh.unsqueeze(-1)
        fresh_lo = native.masked_fill(~is_fresh, float("inf")).amin(dim=-2)
        fresh_hi = native.masked_fill(~is_fresh, float("-inf")).amax(dim=-2)
        grid_top = zero + top_code * scale
        fits = surviving & (fresh_lo >= zero - scale / 2) & (fresh_hi <= grid_top + scale / 2)
        lo = torch.where(surviving, torch.minimum(zero, fresh_lo), fresh_lo)
        hi = torch.where(surviving, torch.maximum(grid_top, fresh_hi), fresh_hi)
        new_zero, new_scale = (p.float() for p in affine_parameters(lo, hi, bits, self.zero.dtype))
        new_zero, new_scale = torch.where(fits, zero, new_zero), torch.where(fits, scale, new_scale)
        coded = encode(torch.where(is_fresh, native, survivors), new_zero.unsqueeze(-2), new_scale.unsqueeze(-2), bits)
        keep = (fits.unsqueeze(-2) & ~is_fresh) | ~written.view(batch, heads, k, size, 1)  # survivors on an unchanged grid, unwritten slots
        active = requested & fresh.any(dim=-1)  # [b, h, k]
        coded = torch.where(keep | ~active[..., None, None], codes, coded)
        self.codes.scatter_(2, expand_slots(members, packed), pack(coded.flatten(2, 3), bits))
        for tensor, old, new in ((self.zero, zero, new_zero), (self.scale, scale, new_scale)):
            tensor.scatter_(2, expand_slots(groups, tensor), torch.where(active[..., None], new, old).to(tensor.dtype))

    def _natives(
        self, members: torch.Tensor, natives: list[tuple[torch.Tensor, torch.Tensor]], run: tuple[int, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Native keys of ``members`` (``[batch, heads, m]``) where a source holds them, and where."""
        batch, heads, m = members.shape
        found = torch.zeros(batch, heads, m, dtype=torch.bool, device=members.device)
        native = torch.zeros(batch, heads, m, self.width, dtype=torch.float32, device=members.device)
        for slots, keys in natives:
            held = slots.view(1, 1, -1) if slots.dim() == 1 else slots
            match = members.unsqueeze(-1) == held.unsqueeze(-2)  # [b, h, m, n]
            hit = match.any(dim=-1)
            source = keys.expand(batch, heads, -1, -1).gather(2, expand_slots(match.to(torch.uint8).argmax(dim=-1), keys.expand(batch, heads, -1, -1)))
            native = torch.where(hit.unsqueeze(-1), source.float(), native)
            found |= hit
        if run is not None:
            start, keys = run
            index = members - start
            hit = (index >= 0) & (index < keys.shape[2])
            source = keys.gather(2, expand_slots(index.clamp(0, keys.shape[2] - 1), keys))
            native = torch.where(hit.unsqueeze(-1), source.float(), native)
            found |= hit
        return native, found

    @property
    def nbytes(self) -> int:
        return 0 if self.codes is None else sum(t.nbytes for t in self.tensors())

    def bytes_held(self, tokens: int) -> int:
        """Codes of ``tokens`` slots, the parameters of the groups they fill, ``written``, and the
        native keys of the sinks among them."""
        if self.codes is None:
            return 0
        groups = -(-tokens // self.group)
        per_group = self.zero[:, :, :1].nbytes + self.scale[:, :, :1].nbytes
        sinks = min(tokens, self.sinks) * self.sink_keys[:, :, :1].nbytes
        return tokens * self.codes[:, :, :1].nbytes + groups * per_group + self.written.nbytes + sinks


def _grown(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` with its slot axis (2) enlarged to ``length``, zeros after the old content."""
    if tensor.shape[2] >= length:
        return tensor
    grown = tensor.new_zeros(*tensor.shape[:2], length, *tensor.shape[3:])
    grown[:, :, : tensor.shape[2]] = tensor
    return grown
