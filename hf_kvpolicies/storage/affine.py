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
SMALLEST = torch.finfo(torch.float32).tiny * torch.finfo(torch.float32).eps
"""The smallest positive float32 (a subnormal)."""


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
    """uint8 codes of ``x`` on the grids ``zero + k * scale`` (float32, broadcast against ``x``). A
    zero scale means every number of the group is its zero point: ``x - zero`` is 0 there, and the
    divisor is raised to the smallest positive float so that the code is 0."""
    return (x.float() - zero).div_(scale.clamp(min=SMALLEST)).round_().clamp_(0, 2**bits - 1).to(torch.uint8)


def decode(codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``zero + codes * scale`` in float32 (operands broadcast): the product is exact, so multiplying
    then adding in place is the one rounding of the definition (and several times faster on the CPU
    than ``addcmul`` with a broadcast last axis)."""
    return codes.float().mul_(scale).add_(zero)


# --- groups along one axis ---------------------------------------------------------------------
def group_ranges(x: torch.Tensor, group: int, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` of consecutive groups of ``group`` along ``axis`` (negative), the last one
    shorter where ``group`` does not divide the axis: shaped like ``x`` with that axis
    ``ceil(n / group)`` long."""
    full, tail = divmod(x.shape[axis], group)
    parts = []
    if full:
        parts.append(torch.aminmax(x.narrow(axis, 0, full * group).unflatten(axis, (full, group)), dim=axis))
    if tail:
        parts.append(torch.aminmax(x.narrow(axis, full * group, tail), dim=axis, keepdim=True))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([parts[0][0], parts[1][0]], dim=axis), torch.cat([parts[0][1], parts[1][1]], dim=axis)


def per_group(x: torch.Tensor, parameter: torch.Tensor, group: int, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and a per-group ``parameter`` made to broadcast element by element: ``x`` split into
    ``(groups, group)`` along ``axis`` where ``group`` divides it, else ``parameter`` repeated over
    each group's elements."""
    n = x.shape[axis]
    if n % group == 0:
        return x.unflatten(axis, (n // group, group)), parameter.unsqueeze(axis)
    return x, parameter.repeat_interleave(group, dim=axis).narrow(axis, 0, n)


def quantise_groups(
    x: torch.Tensor, group: int, axis: int, bits: int, half: torch.dtype, skip: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes (shaped like ``x``), zero points and scales of ``x`` in groups along ``axis``;
    the first ``skip`` numbers along it take no part in their group's range (they are held
    elsewhere: their codes are meaningless)."""
    if skip:
        low, high = x.float().clone(), x.float().clone()
        low.narrow(axis, 0, skip).fill_(float("inf"))
        high.narrow(axis, 0, skip).fill_(float("-inf"))
        lo, hi = group_ranges(low, group, axis)[0], group_ranges(high, group, axis)[1]
    else:
        lo, hi = group_ranges(x, group, axis)
    zero, scale = affine_parameters(lo, hi, bits, half)
    grouped, zeros = per_group(x, zero.float(), group, axis)
    scales = per_group(x, scale.float(), group, axis)[1]
    return encode(grouped, zeros, scales, bits).view(x.shape), zero, scale


def decode_groups(codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode ``codes`` whose groups run along ``axis`` into a new ``dtype`` tensor."""
    grouped, zeros = per_group(codes, zero.float(), group, axis)
    scales = per_group(codes, scale.float(), group, axis)[1]
    return decode(grouped, zeros, scales).view(codes.shape).to(dtype)


def round_trip(x: torch.Tensor, group: int, axis: int, bits: int, skip: int = 0) -> torch.Tensor:
    """What ``x`` reads back as once quantised in groups along ``axis``, in ``x``'s dtype (the first
    ``skip`` along it left out of the ranges and returned as they are)."""
    codes, zero, scale = quantise_groups(x, group, axis, bits, scale_dtype(x.dtype), skip)
    out = decode_groups(codes, zero, scale, group, axis, x.dtype)
    if skip:
        out.narrow(axis, 0, skip).copy_(x.narrow(axis, 0, skip))
    return out


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
    view of one where the last byte's high planes are padding). Four bytes are shifted and masked
    at once where the packed width allows (an int32 view, the mask repeated in each byte)."""
    per = 8 // bits
    if per == 1:
        return packed
    words = packed.shape[-1] % 4 == 0 and packed.stride(-1) == 1 and packed.numel() > 0
    source = packed.view(torch.int32) if words else packed
    mask = ((1 << bits) - 1) * (0x01010101 if words else 1)  # the byte mask repeated in each byte of a word
    planes = [source & mask] + [(source >> plane * bits) & mask for plane in range(1, per)]
    out = torch.cat(planes, dim=-1)  # words side by side are their bytes side by side
    if words:
        out = out.view(torch.uint8)
    return out if out.shape[-1] == width else out[..., :width]
