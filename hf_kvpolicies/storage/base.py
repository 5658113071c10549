"""The storage axis: how the key/value slots of one layer are held in memory.

A storage is a slot-addressed pair of tensors shaped ``[batch, kv_heads, slots, head_dim]``
(values may be narrower or wider than keys: each is sized from its own last dim).
It knows nothing about which token lives in which slot: that is the retention's job.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

SlotIndex = int | torch.Tensor
"""Where to write: an ``int`` start slot (contiguous run), a ``LongTensor[q]`` shared by every
row and head, or a ``LongTensor[batch, kv_heads, q]`` chosen per row and head."""

UpcomingSlots = Callable[[int], list[int] | None]
"""``upcoming(n)``: the slots the next ``n`` static steps write, in order, one token each and
shared by every row and head, known on the host when static steps begin: an append's (rising) or a
ring's (repeating with the ring's period), so the first ``n`` tell whether any ``n`` in a row repeat;
``None`` where each step chooses its slots per row and head."""


class Storage(ABC):
    """Holds the slots of one layer; reads return the model's dtype."""

    def __init__(self) -> None:
        self.capacity = 0
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None

    @property
    def is_allocated(self) -> bool:
        return self.dtype is not None

    keeps_pads_out = False
    """True when the storage's codes span slots and group each row's real tokens apart, so it must
    be told where a padded batch's pads are (:meth:`write`'s ``ranks``) even where the retention
    keeps tokens in position order and the model's own mask serves."""

    holds_rows_apart = False
    """True when the storage holds something of each row's own beyond its slots (codes that group
    each row's tokens, a native residual of each row's newest tokens): a retention that moves a
    padded row's tokens about (the sink retention's displaced sinks) then stores them where the row
    alone holds them, and ranks its writes."""

    @property
    @abstractmethod
    def rows(self) -> int:
        """Rows of the batch held (once allocated)."""

    @abstractmethod
    def allocate(self, like: torch.Tensor, capacity: int, value_dim: int | None = None) -> None:
        """Create ``capacity`` empty slots shaped like ``like`` (keys: ``[batch, heads, *, head_dim]``).

        ``value_dim``: the values' last dim where it differs from the keys' (multi-head latent
        attention stores 192-wide keys and 128-wide values); ``None`` for the keys' own.
        """

    def check_positions(self, positions: int) -> None:
        """``ValueError`` for options no model of ``positions`` positions can use (checked when a
        cache is built; nothing to check by default)."""

    @abstractmethod
    def grow(self, capacity: int) -> None:
        """Enlarge to at least ``capacity`` slots, keeping the content of the existing ones."""

    @abstractmethod
    def write(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor | None = None) -> None:
        """Write ``keys``/``values`` (``[batch, heads, q, head_dim]``) into ``slots``, in place.

        ``ranks``: in a padded batch, each token's place among the real tokens its row brings in
        this write, in the order the row alone would write them (``long [batch, q]`` or
        ``[batch, heads, q]``; ``-1``: a pad, or a token the row alone would not hold there;
        :func:`real_ranks`). The retentions give it for their prompt writes and trims; a storage
        whose codes span slots groups each row's tokens in that order, so that a row is held as it
        is alone. ``None``: every token is real, in slot order.
        """

    def rewrite(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the content of kept tokens (re-rotated or displaced sinks): a write that brings no
        new token, so a storage that favours recent writes (fp8's residual) does not count it."""
        self.write(slots, keys, values)

    @abstractmethod
    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[0, length)`` in the model's dtype (a view where possible)."""

    @abstractmethod
    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` (``LongTensor[n]`` or ``[batch, heads, n]``) in the model's dtype."""

    def as_written(
        self, keys: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a read would return for ``keys``/``values`` right after writing them (``ranks`` as
        for :meth:`write`).

        A forward that attends to tokens before storing them (the concatenate path of a bounded
        retention) attends to this, so it sees what the in-place path, which writes first and then
        reads, would see: a padded batch and its rows run alone then agree. Native: the tokens.
        """
        return keys, values

    @abstractmethod
    def reorder(self, batch_index: torch.Tensor) -> None:
        """Select rows along the batch axis (beam search, batch expansion or selection)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of every persistent tensor held, allocated capacity included."""

    @abstractmethod
    def bytes_held(self, tokens: int) -> int:
        """Bytes that ``tokens`` kept tokens occupy, spare capacity excluded: what a comparison of
        policies should divide (a buffer that doubles when full would otherwise count up to 2x)."""

    # --- the static decode step (torch.compile) -----------------------------------------
    compileable = True
    """True when :meth:`write_static`/:meth:`read_static` keep every per-step state on the device."""

    def enter_static(self, upcoming: UpcomingSlots | None = None) -> None:
        """Static decode steps follow (called eagerly, outside any compiled region): the tensors
        they mutate get fixed addresses, so a compiled step (and CUDA graphs) can reuse them.
        ``upcoming``: where the retention knows them, the slots its static steps will write (a
        storage with a native residual proves from them that no write lands on a shadowed slot)."""
        self.mark_static_tensors()

    def mark_static_tensors(self) -> None:
        """Give the tensors static steps mutate fixed addresses (again after a growth replaced them)."""
        for tensor in self.static_tensors():
            torch._dynamo.mark_static_address(tensor)

    def static_tensors(self) -> list[torch.Tensor]:
        """The persistent tensors a static step writes in place."""
        return []

    def prepare_row_writes(self) -> None:
        """Static steps will write slots chosen per row and head: build, eagerly, what such writes
        reuse at every step (nothing, unless a storage says otherwise)."""

    def write_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """:meth:`write` to device ``slots`` (``[q]`` shared, or ``[batch, heads, q]``) with no host state."""
        self.write(slots, keys, values)

    def rewrite_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """:meth:`rewrite` in a static step: new content for kept tokens, no new token."""
        self.write_static(slots, keys, values)

    def rewrite_keys_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """:meth:`rewrite_static` where only the keys are new (``values``: what the slots hold): a
        storage that holds keys apart from values writes the keys alone."""
        self.rewrite_static(slots, keys, values)

    def read_static(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot (the whole fixed-shape buffer), in the model's dtype."""
        return self.read(self.capacity)

    def leave_static(self) -> None:
        """Static steps end (before any other call): bring host bookkeeping up to date (may read the device)."""


def allocated(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, what: str, fill: float | int = 0) -> torch.Tensor:
    """A new tensor filled with ``fill``, or a ``ValueError`` that names the bytes asked for and
    ``what`` asked for them, where the device cannot hold it (instead of the allocator's message)."""
    elements = math.prod(shape)
    size = elements * torch.empty((), dtype=dtype).element_size()
    try:
        return torch.full(shape, fill, dtype=dtype, device=device)
    except (RuntimeError, MemoryError, OverflowError, TypeError) as error:
        if isinstance(error, RuntimeError) and "memory" not in str(error).lower() and "allocat" not in str(error).lower():
            raise
        raise ValueError(
            f"{what} asks for {size:,} bytes ({size / 2**30:.1f} GiB) as {tuple(shape)} {str(dtype).removeprefix('torch.')} "
            f"on {device}, which cannot be allocated: lower the budget (or the storage's residual), or use fewer rows"
        ) from None


def real_ranks(real: torch.Tensor) -> torch.Tensor:
    """:meth:`Storage.write`'s ``ranks`` of tokens written in slot order: ``0, 1, ...`` along the
    last axis where ``real``, ``-1`` elsewhere."""
    return torch.where(real, real.cumsum(dim=-1) - 1, -1)


def slot_run(slots: SlotIndex, q: int, device: torch.device) -> torch.Tensor:
    """A write's ``slots`` as a tensor on ``device``: ``q`` slots from an ``int`` start, or the
    slots given (``[q]`` or ``[batch, heads, q]``)."""
    return torch.arange(slots, slots + q, device=device) if isinstance(slots, int) else slots.to(device)


def slots_per_row(slots: SlotIndex, like: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, q]``: the slot each token of a write of ``like`` (``[batch, heads, q, ...]``) takes."""
    batch, heads, q = like.shape[:3]
    run = slot_run(slots, q, like.device)
    return (run.view(1, 1, q) if run.dim() == 1 else run).expand(batch, heads, q)


def ranks_per_row(ranks: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, q]``: :meth:`Storage.write`'s ``ranks`` (``[batch, q]``, ``[batch, 1, q]`` or
    ``[batch, heads, q]``) for each head of a write of ``like``, on its device."""
    batch, heads, q = like.shape[:3]
    return ranks.to(like.device).view(batch, -1, q).expand(batch, heads, q)


def expand_slots(slots: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a slot index to ``like``'s ``[batch, heads, q, head_dim]`` for gather/scatter."""
    if slots.dim() == 1:
        slots = slots.view(1, 1, -1)
    batch, heads, _, head_dim = like.shape
    return slots.unsqueeze(-1).expand(batch, heads, slots.shape[-1], head_dim)


def take(tensor: torch.Tensor, slots: SlotIndex, count: int = 0) -> torch.Tensor:
    """``tensor`` (``[batch, heads, slots, *]``) at ``slots``: ``count`` from an ``int`` start, a
    ``LongTensor[n]`` shared by every row, or ``[batch, heads, n]`` per row and head."""
    if isinstance(slots, int):
        return tensor[:, :, slots : slots + count]
    if slots.dim() == 1:
        return tensor.index_select(2, slots)
    return tensor.gather(2, expand_slots(slots, tensor))


def put(tensor: torch.Tensor, slots: SlotIndex, content: torch.Tensor) -> None:
    """Write ``content`` (``[batch, heads, q, *]``) into ``tensor`` at ``slots`` (as :func:`take`)."""
    if isinstance(slots, int):
        tensor[:, :, slots : slots + content.shape[2]] = content
    elif slots.dim() == 1:
        tensor.index_copy_(2, slots, content)
    else:
        tensor.scatter_(2, expand_slots(slots, content), content)
