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
slot it shadows. While every write names ``int`` slots (a full cache's appends), a token the
ring takes is quantised only when it leaves (:class:`~.residual.PendingTokens`: the ring's tokens
in one batch, once per ``residual + 1`` appends, the same bytes); any other write (a ring
retention's device slot, a scored policy's free slots) also quantises into the payload at once,
so a token that leaves the ring needs no work. A write to slots that the ring already shadows (a
re-rotated sink, a ring retention smaller than the residual) refreshes those copies in place
rather than pushing fresher tokens out.

**Reads** decode slots ``[0, n)`` of one layer into a fresh tensor (the only transient
full-precision copy, freed after that layer's attention), then scatter the residual over it.
Keys and values as wide as each other are decoded in one pass into one buffer, each half
contiguous, and the residual's entries land in one scatter.
An accelerator converts the float8 payload in one kernel and multiplies by the scale (a decode
step's launches are its cost there). PyTorch's float8 conversion runs scalar code on the CPU,
~5x slower than the CPU's own decoder (measured in ``eval/benchmarks/fp8.py``), and a 256-entry
table lookup ~3x: a byte sign-extended to 16 bits and shifted so its mantissa meets float16's
*is* the float16 of the fp8 value times ``2**(bias - 15)``, normal and subnormal numbers alike,
and that power of two joins the scale. Both are exact, so both give the same bits.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from ..validation import check_int
from . import cpu_kernels
from .base import SlotIndex, Storage, UpcomingSlots, allocated, put, take
from .residual import NativeResidual, PendingTokens

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
        self._shift = FLOAT16_MANTISSA - self.mantissa_bits
        # sign-extended and shifted, copies of the sign bit land in the exponent field unless shift is 8
        self._mask = None if self._shift == 8 else _as_int16(0x8000 | (0x7F << self._shift))
        self._factor_offset = FLOAT16_BIAS - self.bias
        # max = 1.g * 2**t: adding this to a magnitude's float32 bits and shifting out the mantissa
        # gives t's excess over its exponent, plus the carry of a mantissa above g
        top_bits = _float32_bits(info.max)
        self._code_offset = (1 << 23) - 1 - (top_bits & ((1 << 23) - 1)) - (((top_bits >> 23) - FLOAT32_BIAS) << 23)

    def quantise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (``[..., head_dim]``) as an int8 payload (the fp8 bytes) and uint8 E8M0 scale codes (``[..., 1]``)."""
        amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
        # the code e + 127 of the smallest e with amax <= max * 2**e, exactly, from amax's bits: its
        # exponent less max's, plus one where its mantissa exceeds max's (an integer carry)
        codes = ((amax.view(torch.int32) + self._code_offset) >> 23).clamp_(MIN_EXPONENT + FLOAT32_BIAS, MAX_EXPONENT + FLOAT32_BIAS)
        inverse = ((2 * FLOAT32_BIAS - codes) << 23).view(torch.float32)  # 2**-e, built exactly
        scaled = (x * inverse).clamp_(-self.max, self.max)  # in float32 (the product promotes)
        return scaled.to(self.dtype).view(torch.int8), codes.to(torch.uint8)

    def dequantise(self, payload: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``payload * 2**(code - 127)`` in ``dtype``, exactly (``codes`` broadcast against ``payload``)."""
        out = torch.empty(payload.shape, dtype=_compute_dtype(dtype), device=payload.device)
        self.dequantise_into(out, payload, codes)
        return out if out.dtype == dtype else out.to(dtype)

    def dequantise_into(self, out: torch.Tensor, payload: torch.Tensor, codes: torch.Tensor) -> None:
        """:meth:`dequantise` written into ``out`` (float32 or bfloat16, any strides).

        An accelerator converts the float8 bytes. On the CPU, the byte, sign-extended to int16 and
        shifted so that its mantissa meets float16's, is a float16 worth the fp8 value times
        ``2**(bias - 15)``; that power of two joins the scale.
        """
        signed = payload if payload.dtype == torch.int8 else payload.view(torch.int8)
        if not cpu_kernels.on_cpu_path(payload.device):
            out.copy_(signed.view(self.dtype))
            out.mul_((codes.to(torch.int32) << 23).view(torch.float32).to(out.dtype))  # 2**(code - 127)
            return
        bits = signed.to(torch.int16).mul_(1 << self._shift)
        if self._mask is not None:
            bits.bitwise_and_(self._mask)
        factor = ((codes.to(torch.int32) + self._factor_offset) << 23).view(torch.float32)
        out.copy_(bits.view(torch.float16))
        out.mul_(factor.to(out.dtype))  # a power of two: exact in either dtype

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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where decoding multiplies: the model's dtype, or float32 for float16 (whose range the
    scale's power of two may leave)."""
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def _as_int16(value: int) -> int:
    return value - (1 << 16) if value >= 1 << 15 else value


def _float32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


class FP8Storage(Storage):
    """One layer's slots as an fp8 payload, a scale per token and KV head, and a native residual.

    Keys and values are held side by side, ``[batch, kv_heads, slots, key_dim + value_dim]``, so
    each write, read and reorder is one operation for both, and values are as wide as they are
    (multi-head latent attention: 192-wide keys, 128-wide values). Bytes per token and KV head:
    ``key_dim + value_dim`` (payload) + 2 (a scale for the key, one for the value); plus
    ``residual`` native tokens and the slot each one shadows (:class:`~.residual.NativeResidual`).
    """

    def __init__(self, residual: int = DEFAULT_RESIDUAL, dtype: str | torch.dtype = "float8_e4m3fn") -> None:
        super().__init__()
        self.residual = check_int("residual", residual, minimum=0)
        self.format = float8_format(dtype)
        self.payload: torch.Tensor | None = None
        """``int8 [batch, heads, capacity, key_dim + value_dim]``: the fp8 bytes of every slot (signed,
        so that decoding sign-extends them without a view)."""
        self.scales: torch.Tensor | None = None
        """``uint8 [batch, heads, capacity, 2]``: E8M0 codes (key, value), scale ``2**(code - 127)``."""
        self.ring = NativeResidual(self.residual)
        self.holds_rows_apart = self.residual > 0  # each row's residual holds its own newest tokens
        self._pending = PendingTokens()
        """Slots the residual holds whose fp8 bytes wait until they leave it (appends of ``int`` slots)."""
        self.key_dim = 0  # keys fill the payload's first key_dim bytes, values the rest

    @classmethod
    def factory(cls, residual: int = DEFAULT_RESIDUAL, dtype: str | torch.dtype = "float8_e4m3fn") -> FP8Factory:
        """A zero-argument factory for ``storage=`` on any policy (the options are checked now)."""
        checked = cls(residual, dtype)
        return FP8Factory(checked.residual, checked.format.name)

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
    def check_positions(self, positions: int) -> None:
        if self.residual > positions:
            raise ValueError(
                f"fp8 storage residual={self.residual} exceeds the {positions} positions of the model: no cache holds "
                f"more tokens natively than the model reads; give residual <= {positions} (default {DEFAULT_RESIDUAL})"
            )

    def allocate(self, like: torch.Tensor, capacity: int, value_dim: int | None = None) -> None:
        batch, heads, _, key_dim = like.shape
        value_dim = value_dim or key_dim
        width = key_dim + value_dim
        self.dtype, self.device, self.capacity, self.key_dim = like.dtype, like.device, capacity, key_dim
        self.payload = allocated((batch, heads, capacity, width), torch.int8, like.device, f"the fp8 payload of {capacity} slots")
        self.scales = allocated((batch, heads, capacity, 2), torch.uint8, like.device, f"the fp8 scales of {capacity} slots")
        self.ring.allocate(batch, heads, key_dim, value_dim, like.dtype, like.device)
        self._pending.allocate(self.residual)

    @property
    def rows(self) -> int:
        return self.payload.shape[0]

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        payload, scales, used = self.payload, self.scales, self.capacity
        self.payload = payload.new_zeros(*payload.shape[:2], capacity, payload.shape[-1])
        self.scales = scales.new_zeros(*scales.shape[:2], capacity, 2)
        self.payload[:, :, :used] = payload
        self.scales[:, :, :used] = scales
        self.capacity = capacity

    def write(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor | None = None) -> None:
        if ranks is not None:  # a padded batch: each row's residual keeps its own newest tokens
            self._pending.settle(self.ring, self._encode)
            self.ring.part_rows()
        self._write(slots, keys, values, new_tokens=True, ranks=ranks)

    def rewrite(self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Native copies of these slots are refreshed; no entry is pushed (recent tokens stay native)."""
        self._write(slots, keys, values, new_tokens=False)

    def _write(
        self, slots: SlotIndex, keys: torch.Tensor, values: torch.Tensor, new_tokens: bool, ranks: torch.Tensor | None = None
    ) -> None:
        """The tokens into the payload and the residual; where every write names ``int`` slots, the
        newest the residual takes are quantised only when they leave it (:class:`PendingTokens`)."""
        fresh = torch.cat([keys, values], dim=-1)
        q, pending, ring = keys.shape[-2], self._pending, self.ring
        lazy = pending.lazy(slots, ring)
        if lazy:
            now = pending.admit(slots, q, new_tokens, ring)
            if now:
                self._encode(slots, fresh[:, :, :now])
        else:
            pending.settle(ring, self._encode)
            if not isinstance(slots, int):
                slots = slots.to(self.device)
            self._encode(slots, fresh)
        wanted = lazy and pending.due(ring.departing(min(q, self.residual) if new_tokens else 0))
        departed = ring.note(slots, fresh, self.capacity, push=new_tokens, departures=wanted, ranks=ranks)
        if departed is not None:
            pending.flush(ring, self._encode, departed)

    def _encode(self, slots: SlotIndex, fresh: torch.Tensor) -> None:
        """Tokens (keys and values side by side) quantised into ``slots``."""
        payload, codes = self._quantise(fresh)
        put(self.payload, slots, payload)
        put(self.scales, slots, codes)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if length == 0:
            batch, heads, _, width = self.payload.shape
            return self.ring.split(torch.empty(batch, heads, 0, width, dtype=self.dtype, device=self.device))
        keys, values, paired = self._dequantise(self.payload[:, :, :length], self.scales[:, :, :length])
        return self.ring.overlay(keys, values, length, paired)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.to(self.device)
        keys, values, _ = self._dequantise(take(self.payload, slots), take(self.scales, slots))
        return self.ring.override(keys, values, slots)

    def as_written(
        self, keys: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded from fp8, but the newest ``residual`` tokens native, as a write then a read gives."""
        q = keys.shape[-2]
        if q <= self.residual:
            return keys, values
        old = q - self.residual  # a scale per token and vector: nothing here depends on the slots

        def rounded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.format.dequantise(*self.format.quantise(x[:, :, :old]), x.dtype), x[:, :, old:]], dim=-2)

        return rounded(keys), rounded(values)

    def reorder(self, batch_index: torch.Tensor) -> None:
        batch_index = batch_index.to(self.device)
        self.payload = self.payload.index_select(0, batch_index)
        self.scales = self.scales.index_select(0, batch_index)
        self.ring.reorder(batch_index)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.payload, self.scales) if t is not None) + self.ring.nbytes

    def bytes_held(self, tokens: int) -> int:
        """Payload and scales of ``tokens`` slots, plus the native copies of the residual in use."""
        if self.payload is None:
            return 0
        batch, heads, _, width = self.payload.shape
        held = tokens * batch * heads * (width + self.scales.shape[-1])  # a byte per element, one per scale
        return held + self.ring.bytes_held(tokens)

    # --- the static decode step ----------------------------------------------------------
    def enter_static(self, upcoming: UpcomingSlots | None = None) -> None:
        self._pending.settle(self.ring, self._encode)
        self.ring.enter_static(self.device, upcoming)
        super().enter_static()

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.payload, self.scales, *self.ring.static_tensors()]

    def write_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The residual's rules, decided on the device (:meth:`~.residual.NativeResidual.write_static`)."""
        self._write_static(slots, keys, values, push=True)

    def rewrite_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """As :meth:`rewrite`: entries shadowing these slots are refreshed, none is pushed."""
        self._write_static(slots, keys, values, push=False)

    def _write_static(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, push: bool) -> None:
        fresh = torch.cat([keys, values], dim=-1)
        self._encode(slots, fresh)
        self.ring.write_static(slots, fresh, push)

    def read_static(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ring.overlay_static(*self._dequantise(self.payload, self.scales))

    def leave_static(self) -> None:
        self.ring.leave_static(self.capacity)

    # --- keys and values side by side --------------------------------------------------
    def _quantise(self, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., key_dim + value_dim]`` as payload bytes and ``[..., 2]`` scale codes."""
        if 2 * self.key_dim == fresh.shape[-1]:  # equal widths: one call over a [..., 2, dim] view
            payload, codes = self.format.quantise(fresh.unflatten(-1, (2, self.key_dim)))
            return payload.flatten(-2), codes.flatten(-2)
        key_payload, key_codes = self.format.quantise(fresh[..., : self.key_dim])
        value_payload, value_codes = self.format.quantise(fresh[..., self.key_dim :])
        return torch.cat([key_payload, value_payload], dim=-1), torch.cat([key_codes, value_codes], dim=-1)

    def _dequantise(self, payload: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys and values decoded, each contiguous (attention reads them at full speed), and, where
        they are equally wide, decoded in one pass into one ``[2, batch, heads, n, dim]`` buffer
        whose ``[batch, heads, n, 2, dim]`` view pairs them (the residual's entries then land in one
        scatter); ``None`` for the pairing otherwise."""
        key_dim = self.key_dim
        if 2 * key_dim != payload.shape[-1]:
            keys = self.format.dequantise(payload[..., :key_dim], codes[..., :1], self.dtype)
            values = self.format.dequantise(payload[..., key_dim:], codes[..., 1:], self.dtype)
            return keys, values, None
        batch, heads, n, _ = payload.shape
        out = torch.empty(2, batch, heads, n, key_dim, dtype=_compute_dtype(self.dtype), device=payload.device)
        paired = out.permute(1, 2, 3, 0, 4)
        self.format.dequantise_into(paired, payload.unflatten(-1, (2, key_dim)), codes.unsqueeze(-1))
        if out.dtype != self.dtype:  # float16: decoded in float32, the pairing is not the result
            out = out.to(self.dtype)
            return out[0], out[1], None
        return out[0], out[1], paired


@dataclass(frozen=True)
class FP8Factory:
    """Builds one layer's :class:`FP8Storage`; its repr is the call that made it."""

    residual: int
    dtype: str

    def __call__(self) -> FP8Storage:
        return FP8Storage(self.residual, self.dtype)

    def __repr__(self) -> str:
        return f"FP8Storage.factory(residual={self.residual}, dtype={self.dtype!r})"

