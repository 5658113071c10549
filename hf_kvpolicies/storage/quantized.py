"""Low-bit integer storage after KIVI (Liu et al., 2024): keys per channel, values per token,
the newest tokens native.

Bits 8, 4 or 2 (registered as ``int8``, ``int4``, ``int2``). Codes are packed (two 4-bit or four
2-bit codes a byte), with a zero point and a scale per group in half precision
(:mod:`~hf_kvpolicies.storage.affine` defines them exactly); no tensor holds decoded keys or values
between steps: a read decodes one layer's slots into a fresh tensor, as fp8 does.

* **Values** are quantised per token in groups of ``group_size`` channels
  (:class:`~.quantized_codes.TokenCodes`) at the moment they are written.
* **Keys** are quantised per channel over groups of ``group_size`` consecutive slots
  (``key_axis="channel"``, KIVI's: a few key channels carry most of the magnitude, and a
  per-token range would flatten the others at 2 bits), or per token like the values
  (``key_axis="token"``). A channel group is quantised when one of its tokens leaves the
  residual, from the group's native tokens and the codes of the others
  (:class:`~.quantized_codes.ChannelCodes` says what that does for each write pattern).
* **The residual**: the last ``residual`` tokens written are also held natively and read back
  exactly (:class:`~.residual.NativeResidual`). With channel keys it must cover a group
  (``residual >= group_size``): then an append completes its group before the group's first
  token leaves the residual, so a full cache quantises every group from its own ``group_size``
  tokens, as KIVI does. A :meth:`QuantizedStorage.rewrite` (re-rotated sinks: no new token)
  pushes nothing out of the residual: it refreshes the native copies it hits and quantises the
  rest in place.
* **Padded batches**: the retention ranks each row's real tokens as the row alone writes them
  (:meth:`QuantizedStorage.write`'s ``ranks``), and the channel groups are made of each row's own
  tokens in that order, pads left out (:attr:`QuantizedStorage._place`), so a row's codes equal
  its codes alone.

Defaults: KIVI's group of 32, keys per channel, values per token; a residual of 32 rather than
KIVI's 128. The residual's native copies sit beside codes allocated for every slot, and at 128
they cost 0.35x of the same tokens in bf16 at 4,096 tokens for int4 where 32 costs 0.33x (both
measured, everything allocated counted; ``python -m eval.benchmarks.quant``); 32 is the smallest
residual that covers a group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import check_choice, check_int
from .affine import BITS, round_trip, scale_dtype
from .base import SlotIndex, Storage, UpcomingSlots, expand_slots, ranks_per_row, slot_run, slots_per_row
from .quantized_codes import ChannelCodes, TokenCodes
from .residual import Departed, NativeResidual, PendingTokens

DEFAULT_GROUP = 32
DEFAULT_RESIDUAL = 32
DEFAULT_SINKS = 1
KEY_AXES = ("channel", "token")
OPTIONS = ("group_size", "residual", "key_axis", "sinks")


class QuantizedStorage(Storage):
    """One layer's slots as packed ``bits``-bit codes with half-precision zero points and scales,
    and the newest ``residual`` tokens native (see the module)."""

    def __init__(
        self,
        bits: int = 4,
        group_size: int = DEFAULT_GROUP,
        residual: int = DEFAULT_RESIDUAL,
        key_axis: str = "channel",
        sinks: int | None = None,
    ) -> None:
        """``sinks``: keys of the first slots held natively, out of their channel groups (default
        ``DEFAULT_SINKS`` with channel keys; token keys take none: each is quantised on its own)."""
        super().__init__()
        if bits not in BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits!r}")
        self.bits = bits
        self.group_size = check_int("group_size", group_size, minimum=1)
        self.residual = check_int("residual", residual, minimum=0)
        self.key_axis = check_choice("key_axis", key_axis, KEY_AXES)
        if key_axis == "channel" and residual < group_size:
            raise ValueError(
                f"key_axis='channel' quantises each key channel over {group_size} tokens (group_size), which wait "
                f"natively in the residual until their group is complete: residual must be >= group_size, got "
                f"residual={residual}; raise it, lower group_size, or use key_axis='token'"
            )
        self.per_channel = self.keeps_pads_out = key_axis == "channel"
        self.holds_rows_apart = self.per_channel or residual > 0
        if sinks is None:
            sinks = DEFAULT_SINKS if self.per_channel else 0
        self.sinks = check_int("sinks", sinks, minimum=0)
        if sinks and not self.per_channel:
            raise ValueError(
                f"sinks={sinks} holds the first keys natively out of their channel groups, and key_axis='token' has "
                "none (each key is quantised on its own): give sinks=0 with key_axis='token'"
            )
        self.keys: ChannelCodes | TokenCodes = ChannelCodes(bits, group_size, self.sinks) if self.per_channel else TokenCodes(bits, group_size)
        self.values = TokenCodes(bits, group_size)
        self.ring = NativeResidual(self.residual)
        self._stale_groups: set[int] | None = set()
        """Channel groups written since they were last quantised, while every write named ``int``
        slots (``None`` otherwise): a token leaving the residual from any other group needs no work."""
        self._pending = PendingTokens()
        """Slots the residual holds whose per-token codes (values, token-axis keys) wait until they leave it."""
        self._place: torch.Tensor | None = None
        """``long [batch, heads, capacity]``, once a write has carried ``ranks`` (a padded batch;
        channel keys only): where the key codes hold each slot (``-1``: no real token yet). Each
        row's real tokens take the code slots in the order they would arrive alone (:meth:`_placed_at`),
        so a row's groups and sinks are made of the tokens they hold when the row is alone, wherever
        the retention put its pads; ``None``: slot ``s`` at ``s``."""
        self._placed: torch.Tensor | None = None
        """``long [batch, heads]``: code slots taken so far (the next one to take)."""

    @classmethod
    def factory(
        cls,
        bits: int = 4,
        group_size: int = DEFAULT_GROUP,
        residual: int = DEFAULT_RESIDUAL,
        key_axis: str = "channel",
        sinks: int | None = None,
    ) -> QuantizedFactory:
        """A zero-argument factory for ``storage=`` on any policy (the options are checked now)."""
        checked = cls(bits, group_size, residual, key_axis, sinks)
        return QuantizedFactory(checked.bits, checked.group_size, checked.residual, checked.key_axis, checked.sinks)

    def __repr__(self) -> str:
        return (
            f"QuantizedStorage(bits={self.bits}, group_size={self.group_size}, residual={self.residual}, "
            f"key_axis={self.key_axis!r}, sinks={self.sinks})"
        )

    # --- the Storage interface ---------------------------------------------------------
    def check_positions(self, positions: int) -> None:
        if self.residual > positions:
            raise ValueError(
                f"int{self.bits} storage residual={self.residual} exceeds the {positions} positions of the model: no "
                f"cache holds more tokens natively than the model reads; give residual <= {positions}"
            )

    def allocate(self, like: torch.Tensor, capacity: int, value_dim: int | None = None) -> None:
        batch, heads, _, key_dim = like.shape
        value_dim = value_dim or key_dim
        half = scale_dtype(like.dtype)
        self.dtype, self.device, self.capacity = like.dtype, like.device, capacity
        if self.per_channel:
            self.keys.allocate(batch, heads, capacity, key_dim, half, like.dtype, like.device)
        else:
            self.keys.allocate(batch, heads, capacity, key_dim, half, like.device, "key")
        self.values.allocate(batch, heads, capacity, value_dim, half, like.device, "value")
        self.ring.allocate(batch, heads, key_dim, value_dim, like.dtype, like.device)
        self._stale_groups = set()
        self._place = self._placed = None
        self._pending.allocate(self.residual)

    @property
    def rows(self) -> int:
        return self.values.codes.shape[0]

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        self.keys.grow(capacity)
        self.values.grow(capacity)
        if self._place is not None:
            grown = self._place.new_full((*self._place.shape[:2], capacity), -1)
            grown[..., : self.capacity] = self._place
            self._place = grown
        self.capacity = capacity

    def write(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor | None = None) -> None:
        if ranks is not None:  # a padded batch: each row's residual keeps its own newest tokens
            self._pending.settle(self.ring, self._encode_pending)
            self.ring.part_rows()
            if self.per_channel:
                self._arrange(slots, keys)
            if keys.shape[-2] > self.residual:  # the tokens the residual does not take first
                slots, keys, values, ranks = _in_arrival_order(slots, keys, values, ranks)
        self._write(slots, keys, values, push=True, ranks=ranks)

    def rewrite(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New content for kept tokens: native copies of these slots are refreshed, nothing is pushed
        out of the residual, and the others are quantised now (a key group around them is
        quantised anew, as when a token leaves the residual)."""
        self._write(slots, keys, values, push=False)

    def _write(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor, push: bool, ranks: torch.Tensor | None = None) -> None:
        if not isinstance(slots, int):
            slots = slots.to(self.device)
        placed = self._placed_at(slots, keys, ranks, push) if self.per_channel and self._place is not None else slots
        q = keys.shape[-2]
        pending = self._pending
        lazy = pending.lazy(slots, self.ring)
        if lazy:  # the newest tokens the residual takes are quantised when they leave it
            now = pending.admit(slots, q, push, self.ring)
            self._quantise_tokens(slots, keys[:, :, :now], values[:, :, :now])
        else:
            pending.settle(self.ring, self._encode_pending)
            self._quantise_tokens(slots, keys, values)
        leaving = self.ring.departing(min(q, self.residual) if push else 0) if isinstance(slots, int) else None
        wanted = self._uses_departures(leaving, slots, q)
        departed = self.ring.note(slots, torch.cat([keys, values], dim=-1), self.capacity, push, departures=wanted, ranks=ranks)
        if lazy and departed is not None and pending.due(departed.host_slots):
            pending.flush(self.ring, self._encode_pending, departed)
        if self.per_channel:
            self.keys.note_written(placed, keys)
            self._code_keys(slots, keys, push, departed)

    def _arrange(self, slots: SlotIndex, keys: torch.Tensor) -> None:
        """A write that ranks its tokens: the code slots follow each row's own tokens from now on, and
        a write from slot 0 (a prompt, a trim: the layer arranged anew) places them afresh."""
        batch, heads = keys.shape[:2]
        if self._place is None:
            self._place = torch.full((batch, heads, self.capacity), -1, dtype=torch.long, device=self.device)
            self._placed = torch.zeros(batch, heads, dtype=torch.long, device=self.device)
            self._stale_groups = None  # groups now follow each row's tokens: the host no longer knows them
        elif isinstance(slots, int) and slots == 0:  # code slots past the write keep what they held, as slots do
            self._place.fill_(-1)
            self._placed.zero_()

    def _placed_at(self, slots: SlotIndex, keys: torch.Tensor, ranks: torch.Tensor | None, new: bool = True) -> torch.Tensor:
        """``[batch, heads, q]`` code slots of the tokens this write brings (``-1`` for pads): a slot
        that held a real token keeps its code slot (the token replacing it joins that token's
        group, as in a row alone), a slot that held none takes the row's next free one, in the
        order of ``ranks`` (slot order where ``None``), unless the write brings no new token (a
        :meth:`rewrite`: a slot with no real token holds a pad still)."""
        logical = slots_per_row(slots, keys)
        taken = self._place.gather(-1, logical)
        if ranks is None:
            fresh = (taken < 0) & new
            order = fresh.cumsum(dim=-1) - 1
        else:
            order = ranks_per_row(ranks, keys)
            fresh = (taken < 0) & (order >= 0)
        placed = torch.where(fresh, self._placed.unsqueeze(-1) + order, taken)
        self._place.scatter_(-1, logical, placed)
        self._placed.add_(fresh.sum(dim=-1))
        return placed

    def _physical(self, slots: torch.Tensor) -> torch.Tensor:
        """Where the key codes hold ``slots`` (``[n]`` or ``[batch, heads, n]``; ``-1``, and a slot
        that holds no real token, give ``-1``: in no group)."""
        if self._place is None:
            return slots
        logical = slots.view(1, 1, -1) if slots.dim() == 1 else slots
        logical = logical.expand(*self._place.shape[:2], logical.shape[-1])
        return self._place.gather(-1, logical.clamp(min=0)).masked_fill(logical < 0, -1)

    def _uses_departures(self, leaving: list[int] | None, slots: SlotIndex, q: int) -> bool:
        """Whether this write needs the native copies its push overwrites: to quantise a pending slot
        or a stale key group, as far as the host knows (``leaving``: the slots they shadow)."""
        if leaving is None or self._stale_groups is None and self.per_channel:
            return self.per_channel or self._pending.slots is not None
        if not leaving:
            return False
        if self._pending.due(leaving):
            return True
        if not self.per_channel:
            return False
        size = self.group_size
        stale = self._stale_groups | set(range(slots // size, (slots + q - 1) // size + 1))
        return any(slot >= 0 and slot // size in stale for slot in leaving)

    def _quantise_tokens(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The per-token codes of these tokens: values, and keys where they are per token."""
        if isinstance(slots, int) and not keys.shape[-2]:
            return
        self.values.store(slots, values)
        if not self.per_channel:
            self.keys.store(slots, keys)

    def _encode_pending(self, slots: torch.Tensor, natives: torch.Tensor) -> None:
        """The per-token codes of pending ``slots`` from their native copies (:class:`PendingTokens`)."""
        self._quantise_tokens(slots, *self.ring.split(natives))

    def _code_keys(self, slots: SlotIndex, keys: torch.Tensor, push: bool, departed: Departed | None) -> None:
        """Quantise the key groups that hold a token the residual no longer holds: the tokens of this
        write it did not take (all but the newest ``residual``; all of a rewrite's) and those its
        push overwrote."""
        q, size = keys.shape[-2], self.group_size
        unheld = q - min(q, self.residual) if push else q
        host = isinstance(slots, int) and self._stale_groups is not None and (departed is None or departed.host_slots is not None)
        if not host:
            self._stale_groups = None
        elif unheld == 0 and departed is None:
            self._stale_groups.update(range(slots // size, (slots + q - 1) // size + 1))
            return
        wanted: list[torch.Tensor] = []
        if host:
            touched = set(range(slots // size, (slots + q - 1) // size + 1))
            named = set(range(slots // size, (slots + unheld - 1) // size + 1)) if unheld else set()
            if departed is not None:
                named |= {slot // size for slot in departed.host_slots if slot >= 0} & (self._stale_groups | touched)
            self._stale_groups = (self._stale_groups | touched) - named
            if not named:
                return
            wanted.append(torch.tensor(sorted(named), device=self.device).expand(*keys.shape[:2], -1))
        else:
            if unheld:
                wanted.append(_groups_of(self._physical(slot_run(slots, q, self.device)[..., :unheld]), size, keys))
            if departed is not None:
                wanted.append(_groups_of(self._physical(departed.slots), size, keys))
            if not wanted:
                return
        natives = self._native_keys(departed)
        run = (slots, keys) if isinstance(slots, int) and self._place is None else None
        if run is None:
            natives.append((self._physical(slot_run(slots, q, self.device)), keys))
        self.keys.code(torch.cat(wanted, dim=-1), natives, run)

    def _native_keys(self, departed: Departed | None, every_entry: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The native keys the residual holds (and those a push just overwrote), as coding sources
        (their slots where the key codes hold them)."""
        ring, natives = self.ring, []
        if ring.size:
            held = ring.size if every_entry else ring.held
            natives.append((self._physical(ring.slots[:, :, :held]), ring.split(ring.values[:, :, :held])[0]))
        if departed is not None:
            natives.append((self._physical(departed.slots), ring.split(departed.values)[0]))
        return natives

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self._channel_keys(length) if self.per_channel else self.keys.read(0, length, self.dtype)
        values = self.values.read(0, length, self.dtype)
        return self.ring.overlay(keys, values, length)

    def _channel_keys(self, length: int) -> torch.Tensor:
        """Slots ``[0, length)`` of the channel-grouped keys, in slot order."""
        if self._place is None:
            return self.keys.read(length, self.dtype)
        held = self.keys.read(self.capacity, self.dtype)
        where = self._physical(torch.arange(length, device=self.device)).clamp(min=0)
        return held.gather(2, where.unsqueeze(-1).expand(*where.shape, held.shape[-1]))

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.to(self.device)
        if self.per_channel:
            keys = self.keys.gather(self._physical(slots).clamp(min=0), self.dtype)
        else:
            keys = self.keys.read(slots, 0, self.dtype)
        return self.ring.override(keys, self.values.read(slots, 0, self.dtype), slots)

    def as_written(
        self, keys: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a read returns right after writing ``keys``/``values`` into an empty storage from
        slot 0 (allocated or not): all but the newest ``residual`` tokens decoded, key channel groups
        starting at the first token (each over all its tokens, the native ones included, the sinks
        left out and native). With ``ranks`` and channel keys, each row's groups start at its own
        first real token: that write and read are made, in a storage of their own."""
        q = keys.shape[-2]
        if ranks is not None and self.per_channel and q > self.residual:
            scratch = QuantizedStorage(self.bits, self.group_size, self.residual, self.key_axis, self.sinks)
            scratch.allocate(keys, q, value_dim=values.shape[-1])
            scratch.write(0, keys, values, ranks=ranks)
            return scratch.read(q)
        old = q - self.residual
        if old <= 0:
            return keys, values
        size = self.group_size
        coded = min(q, -(-old // size) * size) if self.per_channel else old
        seen_keys = round_trip(keys[:, :, :coded], size, -2 if self.per_channel else -1, self.bits, min(self.sinks, coded))
        seen_values = round_trip(values[:, :, :old], size, -1, self.bits)
        return (
            torch.cat([seen_keys[:, :, :old], keys[:, :, old:]], dim=-2),
            torch.cat([seen_values, values[:, :, old:]], dim=-2),
        )

    def reorder(self, batch_index: torch.Tensor) -> None:
        batch_index = batch_index.to(self.device)
        if self._place is not None:
            self._place, self._placed = (t.index_select(0, batch_index) for t in (self._place, self._placed))
        self.keys.reorder(batch_index)
        self.values.reorder(batch_index)
        self.ring.reorder(batch_index)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.ring.nbytes

    def bytes_held(self, tokens: int) -> int:
        """Codes, zero points and scales of ``tokens`` slots (and of the key groups they fill), plus
        the native copies of the residual in use, each with the slot it shadows."""
        if self.values.codes is None:
            return 0
        keys = self.keys.bytes_held(tokens) if self.per_channel else tokens * self.keys.slot_bytes()
        return keys + tokens * self.values.slot_bytes() + self.ring.bytes_held(tokens)

    # --- the static decode step ----------------------------------------------------------
    def enter_static(self, upcoming: UpcomingSlots | None = None) -> None:
        self._pending.settle(self.ring, self._encode_pending)
        self.ring.enter_static(self.device, upcoming)
        super().enter_static()

    def static_tensors(self) -> list[torch.Tensor]:
        placement = [] if self._place is None else [self._place, self._placed]
        return [*self.keys.tensors(), *self.values.tensors(), *self.ring.static_tensors(), *placement]

    def write_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._write_static(slots, keys, values, push=True)

    def rewrite_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._write_static(slots, keys, values, push=False)

    def _write_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, push: bool) -> None:
        """:meth:`_write` with no host state: the key groups of every token leaving the residual
        (of every rewritten token) are quantised at each step; a group with no native token left
        to quantise is rewritten as it was."""
        self._quantise_tokens(slots, keys, values)
        departed = self.ring.write_static(slots, torch.cat([keys, values], dim=-1), push, departures=self.per_channel)
        if not self.per_channel:
            return
        self.keys.note_written(self._placed_at(slots, keys, None, push) if self._place is not None else slots, keys)
        natives = self._native_keys(departed, every_entry=True)
        if push:
            groups = _groups_of(self._physical(departed.slots), self.group_size, keys)
        else:
            physical = self._physical(slots)
            groups = _groups_of(physical, self.group_size, keys)
            natives.append((physical, keys))
        self.keys.code(groups, natives)

    def read_static(self) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = self.capacity
        keys = self._channel_keys(capacity) if self.per_channel else self.keys.read(0, capacity, self.dtype)
        return self.ring.overlay_static(keys, self.values.read(0, capacity, self.dtype))

    def leave_static(self) -> None:
        self.ring.leave_static(self.capacity)
        self._stale_groups = None  # static writes may have touched any group


def _in_arrival_order(
    slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor
) -> tuple[SlotIndex, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ranked write (:meth:`~.base.Storage.write`'s ``ranks``) as each row alone would make it:
    per row and head, the tokens it does not hold there first, then its own in rank order, so that
    the write's first ``q - residual`` tokens, whose key groups are quantised at once, are those
    the row's residual does not take (it pushes each row's newest real tokens).
    Returns ``[batch, heads, q]`` slots with the keys, values and ranks in that order, or the write
    as given where that is its order already (a left-padded prompt: pads first)."""
    q = keys.shape[-2]
    ranks = ranks_per_row(ranks, keys)
    within = torch.arange(q, device=keys.device)
    order = torch.where(ranks >= 0, q + ranks, within).argsort(dim=-1)
    if bool((order == within).all()):  # (a prompt or a trim: one look at the host per write)
        return slots, keys, values, ranks
    written = slots_per_row(slots, keys)
    return (
        written.gather(-1, order),
        keys.gather(2, expand_slots(order, keys)),
        values.gather(2, expand_slots(order, values)),
        ranks.gather(-1, order),
    )


def _groups_of(slots: torch.Tensor, size: int, like: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, n]`` channel groups of ``slots`` (``[n]`` or ``[batch, heads, n]``; ``-1`` stays ``-1``)."""
    groups = torch.div(slots, size, rounding_mode="floor")
    return groups.expand(*like.shape[:2], -1) if groups.dim() == 1 else groups


@dataclass(frozen=True)
class QuantizedFactory:
    """Builds one layer's :class:`QuantizedStorage`; its repr is the call that made it.

    Registered as ``int8``/``int4``/``int2``, it also takes options in a spec:
    ``storage="int4:group_size=64;residual=128;key_axis=token"``, ``storage="int2:sinks=4"``.
    """

    bits: int
    group_size: int = DEFAULT_GROUP
    residual: int = DEFAULT_RESIDUAL
    key_axis: str = "channel"
    sinks: int | None = None

    def __call__(self) -> QuantizedStorage:
        return QuantizedStorage(self.bits, self.group_size, self.residual, self.key_axis, self.sinks)

    def from_options(self, options: str) -> QuantizedFactory:
        """The factory named by ``"group_size=64;residual=128;key_axis=token"`` (``;`` separates the
        options, since ``,`` separates a policy's), at this factory's bits."""
        kwargs: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in options.split(";"))):
            key, equals, raw = (part.strip() for part in item.partition("="))
            if not equals or key not in OPTIONS or key in kwargs:
                raise ValueError(
                    f"int{self.bits} storage options are group_size=<int>, residual=<int>, "
                    f"key_axis=<{'|'.join(KEY_AXES)}> and sinks=<int>, separated by ';', each at most once; got {options!r}"
                )
            if key == "key_axis":
                kwargs[key] = raw
                continue
            try:
                kwargs[key] = int(raw)
            except ValueError:
                minimum = 1 if key == "group_size" else 0
                raise ValueError(f"int{self.bits} storage option {key} must be an integer >= {minimum}, got {raw!r}") from None
        return QuantizedStorage.factory(self.bits, **kwargs)

    def __repr__(self) -> str:
        return (
            f"QuantizedStorage.factory(bits={self.bits}, group_size={self.group_size}, residual={self.residual}, "
            f"key_axis={self.key_axis!r}, sinks={self.sinks})"
        )
