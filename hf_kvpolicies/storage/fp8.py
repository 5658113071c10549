"""FP8 storage: an 8-bit float payload with one power-of-two scale per token and KV head, plus
the most recently written tokens kept in the model's own precision (KIVI's residual).

**Why a scale per token and KV head.** One head's key (or value) vector of one token is the
unit that arrives and the unit a query dots with. A scale computed from that vector alone is
known the moment the token is written and never changes afterwards: no re-quantisation, O(1)
appends, and any slot can be overwritten on its own (a ring eviction, an H2O free slot, a
re-rotated sink). A token much larger than everything before it is not clipped, and one outlier
token cannot crush the precision of all the others, which is what a per-tensor scale frozen at
the first update (transformers' ``Fp8QuantizedLayer``) does. Scales per channel (KIVI's choice
for keys) span many tokens, so they must be recomputed as tokens arrive or grouped in time,
which slot-addressed writes cannot do; and a float format needs them less than KIVI's 2-bit
integers: every element keeps 2^-4 relative precision down to 2^-13 of the vector's
largest, so an outlier channel does not flatten the others to zero.

**Why powers of two.** A scale ``2**e`` is one E8M0 byte (the OCP microscaling scale format):
2 bytes per token and head for keys and values together, instead of 8 for two fp32 scales, so
the payload and scales are ~0.51x the same cache in bf16. Multiplying by a power of two is exact:
the only error is each element's 8-bit rounding, and re-quantising decoded values is lossless (a
trim that rewrites kept tokens adds nothing). ``e`` is the smallest exponent that maps the
vector's largest magnitude inside the format, so it lands in the top binade and nothing saturates.

**The residual.** Slots written by the last ``residual`` writes (write recency, not slot order)
are also held natively, and reads return them exactly: a ring of native copies, each with the
slot it shadows. Every write also quantises into the payload, so a token that leaves the ring
needs no work. A write to slots that the ring already shadows (a re-rotated sink, a ring
retention smaller than the residual) refreshes those copies in place rather than pushing
fresher tokens out.

**Reads** decode slots ``[0, n)`` of one layer into a fresh tensor (the only transient
full-precision copy, freed after that layer's attention), then scatter the residual over it.
PyTorch's float8 conversion runs scalar code on the CPU, ~5x slower than this decoder (measured
in ``eval/benchmarks/fp8.py``), and a 256-entry table lookup ~3x: a byte sign-extended to 16 bits
and shifted so its mantissa meets float16's *is* the float16 of the fp8 value times
``2**(bias - 15)``, normal and subnormal numbers alike, and that power of two joins the scale.
Exact, and made of vectorised integer and float operations on any device.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from ..validation import check_int
from .base import SlotIndex, Storage, expand_slots

DEFAULT_RESIDUAL = 32
"""Native tokens per layer by default, from ``python -m eval.benchmarks.fp8 --residual-sweep``
(SmolLM2-135M, 300 decode steps after 1K tokens): mean KL to the full cache 1.7e-2 with no
residual, 5.6e-3 with 8, 3.0e-3 with 32, 1.7e-3 with 128; 32 holds the cache at ~0.53x bf16 at
4K tokens (fp32 model), where 128 would pass the 0.55x budget."""

SUPPORTED_DTYPES = ("float8_e4m3fn", "float8_e5m2")
"""The float8 formats with an IEEE-like layout (sign, exponent, mantissa) the decoder relies on."""

MIN_EXPONENT, MAX_EXPONENT = -126, 119
"""Scale exponents kept where ``2**e``, ``2**-e`` and the decoder's folded factor are normal fp32."""

FLOAT32_BIAS = 127
FLOAT16_BIAS = 15
FLOAT16_MANTISSA = 10


class Float8Format:
    """An 8-bit float format: how to scale a vector into it and how to decode it exactly."""

    def __init__(self, dtype: torch.dtype) -> None:
        info = torch.finfo(dtype)
        self.dtype = dtype
        self.name = str(dtype).removeprefix("torch.")
        self.max = info.max
        self.mantissa_bits = round(-math.log2(info.eps))
        self.bias = 1 - round(math.log2(info.smallest_normal))
        top_mantissa, top_exponent = math.frexp(info.max)  # max = top_mantissa * 2**top_exponent
        self._top_mantissa, self._top_exponent = top_mantissa, top_exponent
        self._shift = FLOAT16_MANTISSA - self.mantissa_bits
        # sign-extended and shifted, copies of the sign bit land in the exponent field unless shift is 8
        self._mask = None if self._shift == 8 else _as_int16(0x8000 | (0x7F << self._shift))
        self._factor_offset = FLOAT16_BIAS - self.bias

    def quantise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (``[..., head_dim]``) as a uint8 payload and uint8 E8M0 scale codes (``[..., 1]``)."""
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        mantissa, exponent = torch.frexp(amax)
        # the smallest e with amax <= max * 2**e, exactly: compare mantissas, not logarithms
        e = (exponent - self._top_exponent + (mantissa > self._top_mantissa)).clamp_(MIN_EXPONENT, MAX_EXPONENT)
        inverse = ((FLOAT32_BIAS - e) << 23).view(torch.float32)  # 2**-e, built exactly
        scaled = (x.float() * inverse).clamp_(-self.max, self.max)
        return scaled.to(self.dtype).view(torch.uint8), (e + FLOAT32_BIAS).to(torch.uint8)

    def dequantise(self, payload: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``payload * 2**(code - 127)`` in ``dtype``, exactly, without float8 conversion.

        The byte, sign-extended to int16 and shifted so that its mantissa meets float16's, is a
        float16 worth the fp8 value times ``2**(bias - 15)``; that power of two joins the scale.
        """
        bits = payload.view(torch.int8).to(torch.int16).mul_(1 << self._shift)
        if self._mask is not None:
            bits.bitwise_and_(self._mask)
        factor = ((codes.to(torch.int32) + self._factor_offset) << 23).view(torch.float32)
        compute = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = bits.view(torch.float16).to(compute).mul_(factor.to(compute))
        return out if compute == dtype else out.to(dtype)

    def __repr__(self) -> str:
        return f"Float8Format({self.name})"


def float8_format(dtype: str | torch.dtype) -> Float8Format:
    """Resolve ``dtype=`` ("float8_e4m3fn", "e5m2", or a ``torch`` dtype), refusing what cannot serve."""
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(dtype)
    name = name if name.startswith("float8_") else f"float8_{name}"
    supported = ", ".join(repr(n) for n in SUPPORTED_DTYPES)
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"fp8 storage dtype must be one of {supported} (or without 'float8_'), got {dtype!r}")
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype):
        available = [n for n in SUPPORTED_DTYPES if isinstance(getattr(torch, n, None), torch.dtype)]
        raise ValueError(
            f"this PyTorch build ({torch.__version__}) has no torch.{name}; fp8 storage supports "
            f"{', '.join(map(repr, available)) or 'none of ' + supported} here (upgrade PyTorch for the others)"
        )
    return Float8Format(resolved)


def _as_int16(value: int) -> int:
    return value - (1 << 16) if value >= 1 << 15 else value


class FP8Storage(Storage):
    """One layer's slots as an fp8 payload, a scale per token and KV head, and a native residual.

    Keys and values are held together, ``[2, batch, kv_heads, slots, head_dim]``, so each write,
    read and reorder is one operation for both. Bytes per token and KV head: ``2 * head_dim``
    (payload) + 2 (scales); plus ``residual`` native tokens and the slot each one shadows.
    """

    def __init__(self, residual: int = DEFAULT_RESIDUAL, dtype: str | torch.dtype = "float8_e4m3fn") -> None:
        super().__init__()
        self.residual = check_int("residual", residual, minimum=0)
        self.format = float8_format(dtype)
        self.payload: torch.Tensor | None = None
        """``uint8 [2, batch, heads, capacity, head_dim]``: the fp8 bytes of every slot."""
        self.scales: torch.Tensor | None = None
        """``uint8 [2, batch, heads, capacity, 1]``: E8M0 codes, scale ``2**(code - 127)``."""
        self.residual_values: torch.Tensor | None = None
        """``[2, batch, heads, residual, head_dim]`` in the model's dtype: a ring of the latest writes."""
        self.residual_slots: torch.Tensor | None = None
        """``long [batch, heads, residual]``: the slot each residual entry shadows."""
        self._held = 0  # residual entries in use (they fill [0, residual) in order)
        self._next = 0  # ring position of the next entry
        self._written_end = 0  # one past the highest slot ever written: reads that cover it need no filter

    @classmethod
    def factory(cls, residual: int = DEFAULT_RESIDUAL, dtype: str | torch.dtype = "float8_e4m3fn"):
        """A zero-argument factory for ``storage=`` on any policy (the options are checked now)."""
        cls(residual, dtype)
        return partial(cls, residual=residual, dtype=dtype)

    @classmethod
    def from_options(cls, options: str):
        """The factory named by ``"residual=16;dtype=e5m2"`` (``storage="fp8:residual=16;dtype=e5m2"``
        in a policy spec: ``;`` separates the options, since ``,`` separates the policy's)."""
        kwargs: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in options.split(";"))):
            key, equals, raw = (part.strip() for part in item.partition("="))
            if not equals or key not in ("residual", "dtype") or key in kwargs:
                raise ValueError(
                    f"fp8 storage options are residual=<int> and dtype=<{'|'.join(SUPPORTED_DTYPES)}>, "
                    f"separated by ';', each at most once; got {options!r}"
                )
            if key == "residual":
                try:
                    kwargs[key] = int(raw)
                except ValueError:
                    raise ValueError(f"fp8 storage option residual must be an integer >= 0, got {raw!r}") from None
            else:
                kwargs[key] = raw
        return cls.factory(**kwargs)

    def __repr__(self) -> str:
        return f"FP8Storage(residual={self.residual}, dtype={self.format.name!r})"

    # --- the Storage interface ---------------------------------------------------------
    def allocate(self, like: torch.Tensor, capacity: int) -> None:
        batch, heads, _, head_dim = like.shape
        self.dtype, self.device, self.capacity = like.dtype, like.device, capacity
        self.payload = torch.zeros(2, batch, heads, capacity, head_dim, dtype=torch.uint8, device=like.device)
        self.scales = torch.zeros(2, batch, heads, capacity, 1, dtype=torch.uint8, device=like.device)
        if self.residual:
            self.residual_values = like.new_zeros(2, batch, heads, self.residual, head_dim)
            self.residual_slots = torch.zeros(batch, heads, self.residual, dtype=torch.long, device=like.device)
        self._held = self._next = self._written_end = 0

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        payload, scales, used = self.payload, self.scales, self.capacity
        self.payload = payload.new_zeros(*payload.shape[:3], capacity, payload.shape[-1])
        self.scales = scales.new_zeros(*scales.shape[:3], capacity, 1)
        self.payload[:, :, :, :used] = payload
        self.scales[:, :, :, :used] = scales
        self.capacity = capacity

    def write(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.shape != values.shape:
            raise NotImplementedError(
                f"fp8 storage holds keys and values of one shape; got {tuple(keys.shape)} and {tuple(values.shape)} "
                "(use storage='native' for this model)"
            )
        fresh = torch.stack([keys, values])
        payload, codes = self.format.quantise(fresh)
        q = keys.shape[-2]
        if isinstance(slots, int):
            self.payload[:, :, :, slots : slots + q] = payload
            self.scales[:, :, :, slots : slots + q] = codes
            start, end = slots, slots + q
        else:
            slots = slots.to(self.device)
            if slots.dim() == 1:
                self.payload.index_copy_(3, slots, payload)
                self.scales.index_copy_(3, slots, codes)
            else:
                self.payload.scatter_(3, _expand(slots, payload), payload)
                self.scales.scatter_(3, _expand(slots, codes), codes)
            start, end = int(slots.min()), int(slots.max()) + 1
        unwritten = start >= self._written_end  # an append: no residual entry can shadow these slots
        self._written_end = max(self._written_end, end)
        if self.residual:
            self._remember(slots, fresh, unwritten)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if length == 0:
            _, batch, heads, _, head_dim = self.payload.shape
            empty = torch.empty(batch, heads, 0, head_dim, dtype=self.dtype, device=self.device)
            return empty, empty
        out = self.format.dequantise(self.payload[:, :, :, :length], self.scales[:, :, :, :length], self.dtype)
        if self._held and length >= self._written_end:
            # every entry shadows a slot inside the read, and entries that share a slot agree
            held = self.residual_slots[:, :, : self._held]
            out.scatter_(3, _expand(held, out), self.residual_values[:, :, :, : self._held])
        elif self._held:
            out = self._override(out, torch.arange(length, device=self.device))
        return out[0], out[1]

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.to(self.device)
        if slots.dim() == 1:
            payload, codes = self.payload.index_select(3, slots), self.scales.index_select(3, slots)
        else:
            payload = self.payload.gather(3, _expand(slots, self.payload))
            codes = self.scales.gather(3, _expand(slots, self.scales))
        out = self.format.dequantise(payload, codes, self.dtype)
        if self._held:
            out = self._override(out, slots)
        return out[0], out[1]

    def reorder(self, batch_index: torch.Tensor) -> None:
        batch_index = batch_index.to(self.device)
        self.payload = self.payload.index_select(1, batch_index)
        self.scales = self.scales.index_select(1, batch_index)
        if self.residual:
            self.residual_values = self.residual_values.index_select(1, batch_index)
            self.residual_slots = self.residual_slots.index_select(0, batch_index)

    @property
    def nbytes(self) -> int:
        tensors = (self.payload, self.scales, self.residual_values, self.residual_slots)
        return sum(t.nbytes for t in tensors if t is not None)

    def bytes_held(self, tokens: int) -> int:
        """Payload and scales of ``tokens`` slots, plus the native copies of the residual in use."""
        if self.payload is None:
            return 0
        _, batch, heads, _, head_dim = self.payload.shape
        held = tokens * 2 * batch * heads * (head_dim + 1)  # a byte per element, a scale byte per vector
        if self.residual:
            native = 2 * head_dim * self.residual_values.element_size() + self.residual_slots.element_size()
            held += min(tokens, self.residual) * batch * heads * native
        return held

    # --- the residual ------------------------------------------------------------------
    def _remember(self, slots: SlotIndex, fresh: torch.Tensor, unwritten: bool) -> None:
        """Keep native copies of what was just written.

        Invariant: every entry in use holds the current content of the slot it shadows. So
        entries whose slot this write overwrites take the new content first (several entries may
        shadow one slot: they agree, and a read may scatter them in any order). Then the newest
        ``min(q, residual)`` tokens are pushed into the ring, unless every slot written was
        shadowed already: a rewrite of shadowed slots (re-rotated sinks, a ring smaller than the
        residual) refreshes them in place and does not push fresher tokens out.
        """
        q = fresh.shape[-2]
        if self._held and not unwritten:
            held = self.residual_slots[:, :, : self._held]
            match = _shadowing(held, slots, q)  # [batch, heads, held, q]
            shadowed = match.any(dim=-1)
            if bool(shadowed.any()):
                source = match.to(torch.uint8).argmax(dim=-1)
                current = self.residual_values[:, :, :, : self._held]
                new = fresh.gather(3, _expand(source, fresh))
                self.residual_values[:, :, :, : self._held] = torch.where(shadowed[None, ..., None], new, current)
                if bool(match.any(dim=-2).all()):
                    return
        count = min(q, self.residual)
        if count == 1:
            self.residual_values[:, :, :, self._next] = fresh[:, :, :, -1]
            self.residual_slots[:, :, self._next] = slots + q - 1 if isinstance(slots, int) else slots[..., -1]
        else:
            ring = (self._next + torch.arange(count, device=self.device)) % self.residual
            if isinstance(slots, int):
                tail = torch.arange(slots + q - count, slots + q, device=self.device)
            else:
                tail = slots[..., q - count :]
            self.residual_values[:, :, :, ring] = fresh[:, :, :, q - count :]
            self.residual_slots[:, :, ring] = tail
        self._next = (self._next + count) % self.residual
        self._held = min(self.residual, self._held + count)

    def _override(self, out: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``out`` (decoded ``slots``: ``[n]`` or ``[batch, heads, n]``) with residual slots made native."""
        held = self.residual_slots[:, :, : self._held]
        wanted = slots.view(1, 1, -1) if slots.dim() == 1 else slots
        match = wanted.unsqueeze(-1) == held.unsqueeze(-2)  # [batch, heads, n, held]
        found = match.any(dim=-1)
        entry = match.to(torch.uint8).argmax(dim=-1)
        native = self.residual_values[:, :, :, : self._held].gather(3, _expand(entry, out))
        return torch.where(found[None, ..., None], native, out)


def _expand(slots: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A slot index (``[n]`` or ``[batch, heads, n]``) broadcast to ``like``'s ``[2, batch, heads, *, last]``."""
    return expand_slots(slots, like[0]).unsqueeze(0).expand(like.shape[0], -1, -1, -1, -1)


def _shadowing(held: torch.Tensor, slots: SlotIndex, q: int) -> torch.Tensor:
    """``[batch, heads, held, q]``: residual entry ``i`` shadows the slot that new token ``j`` is written to."""
    if isinstance(slots, int):
        written = slots if q == 1 else torch.arange(slots, slots + q, device=held.device)
    else:
        written = slots.view(1, 1, 1, -1) if slots.dim() == 1 else slots.unsqueeze(-2)
    return held.unsqueeze(-1) == written
