"""Asymmetric (affine) integer quantisation of groups of numbers, and the packing of its codes.

**The definition.** A group of numbers with minimum ``lo`` and maximum ``hi`` is held as a zero
point, a scale and one ``bits``-bit code per number, ``M = 2**bits - 1``:

* ``zero``: the largest number of the half-precision ``dtype`` that is ``<= lo``;
* ``scale``: the smallest number of that ``dtype`` that is ``>= (hi - zero) / M`` (in float32);
* ``code = clamp(round((x - zero) / scale), 0, M)`` in float32, rounding half to even; ``0`` where
  ``scale`` is zero (a group whose numbers all equal its zero point);
* the number read back is ``zero + code * scale`` in float32, then cast to the model's dtype.

Rounding the zero point down and the scale up keeps the grid ``zero + k * scale`` over the whole
group (a zero point rounded to nearest could leave the group's minimum below code 0 by half a
unit of the half format, more than a step at 8 bits), and the product ``code * scale`` is exact
in float32 (8 + 11 significant bits), so the read is one rounding whether or not the addition is
fused: every implementation of this definition gives the same bits.

**Packing.** ``8 // bits`` codes share a byte, planar: byte ``j`` of a vector packed into ``W``
bytes holds codes ``j, j + W, j + 2W, ...`` from its low bits up, so unpacking writes each
plane into one contiguous run of the output (a shift and a mask over ``W`` bytes per plane).
"""

from __future__ import annotations

import torch

BITS = (2, 4, 8)


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The half precision that zero points and scales are held in: the model's own where it is
    16-bit, bfloat16 for a float32 model (float16's range would overflow on large activations)."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def affine_parameters(lo: torch.Tensor, hi: torch.Tensor, bits: int, half: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(zero, scale)`` in ``half`` for groups spanning ``[lo, hi]`` (see the module's definition)."""
    lo, hi = lo.float(), hi.float()
    zero = lo.to(half)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, float("-inf"))), zero)
    step = (hi - zero.float()) / (2**bits - 1)
    scale = step.to(half)
    scale = torch.where(scale.float() < step, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    return zero, scale


def encode(x: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of ``x`` on the grids ``zero + k * scale`` (float32, broadcast against ``x``)."""
    positive = scale > 0
    codes = (x.float() - zero).div_(torch.where(positive, scale, 1.0)).round_().clamp_(0, 2**bits - 1)
    return torch.where(positive, codes, 0.0).to(torch.uint8)


def decode(codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``zero + codes * scale`` (float32 operands, broadcast), into ``out`` where given."""
    return torch.addcmul(zero, codes, scale) if out is None else torch.addcmul(zero, codes, scale, out=out)


# --- groups along one axis ---------------------------------------------------------------------
def group_ranges(x: torch.Tensor, group: int, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` of consecutive groups of ``group`` along ``axis`` (negative), the last one
    shorter where ``group`` does not divide the axis: shaped like ``x`` with that axis
    ``ceil(n / group)`` long."""
    full, tail = divmod(x.shape[axis], group)
    parts = []
    if full:
        parts.append(x.narrow(axis, 0, full * group).unflatten(axis, (full, group)))
    if tail:
        parts.append(x.narrow(axis, full * group, tail).unsqueeze(axis - 1))
    lo = torch.cat([part.amin(axis) for part in parts], dim=axis)
    hi = torch.cat([part.amax(axis) for part in parts], dim=axis)
    return lo, hi


def per_element(parameter: torch.Tensor, group: int, length: int, axis: int) -> torch.Tensor:
    """A per-group ``parameter`` repeated over its group's elements along ``axis`` (``length`` long)."""
    return parameter.repeat_interleave(group, dim=axis).narrow(axis, 0, length)


def quantise_groups(
    x: torch.Tensor, group: int, axis: int, bits: int, half: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes (shaped like ``x``), zero points and scales of ``x`` in groups along ``axis``."""
    zero, scale = affine_parameters(*group_ranges(x, group, axis), bits, half)
    n = x.shape[axis]
    codes = encode(x, per_element(zero.float(), group, n, axis), per_element(scale.float(), group, n, axis), bits)
    return codes, zero, scale


def decode_groups(codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode ``codes`` whose groups run along ``axis`` into a new ``dtype`` tensor: the full groups
    as one broadcast operation written straight in ``dtype``, a shorter last group as another."""
    full, tail = divmod(codes.shape[axis], group)
    zero, scale = zero.float(), scale.float()
    parts = []
    if full:
        grouped = codes.narrow(axis, 0, full * group).unflatten(axis, (full, group))
        out = torch.empty(grouped.shape, dtype=dtype, device=codes.device)
        decode(grouped, zero.narrow(axis, 0, full).unsqueeze(axis), scale.narrow(axis, 0, full).unsqueeze(axis), out=out)
        parts.append(out.flatten(axis - 1, axis))
    if tail:
        last = decode(codes.narrow(axis, full * group, tail), zero.narrow(axis, full, 1), scale.narrow(axis, full, 1))
        parts.append(last.to(dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)


def round_trip(x: torch.Tensor, group: int, axis: int, bits: int) -> torch.Tensor:
    """What ``x`` reads back as once quantised in groups along ``axis``, in ``x``'s dtype."""
    codes, zero, scale = quantise_groups(x, group, axis, bits, scale_dtype(x.dtype))
    return decode_groups(codes, zero, scale, group, axis, x.dtype)


# --- packing -----------------------------------------------------------------------------------
def packed_width(width: int, bits: int) -> int:
    """Bytes that ``width`` codes of ``bits`` bits take (the last byte's high planes may be padding)."""
    return -(-width // (8 // bits))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., width]`` packed planar into ``[..., packed_width(width, bits)]`` bytes."""
    per = 8 // bits
    if per == 1:
        return codes
    width = codes.shape[-1]
    packed = packed_width(width, bits)
    if packed * per != width:
        codes = torch.nn.functional.pad(codes, (0, packed * per - width))
    planes = codes.unflatten(-1, (per, packed))
    out = planes[..., 0, :].clone()
    for plane in range(1, per):
        out.bitwise_or_(planes[..., plane, :] << (plane * bits))
    return out


def unpack(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """The ``width`` uint8 codes of each packed vector: its planes side by side (a new tensor, or a
    view of one where the last byte's high planes are padding)."""
    per = 8 // bits
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    planes = [packed & mask]
    planes += [(packed >> plane * bits) & mask for plane in range(1, per - 1)]
    planes.append(packed >> (per - 1) * bits)  # the top plane needs no mask
    out = torch.cat(planes, dim=-1)
    return out if out.shape[-1] == width else out[..., :width]
