"""Re-rotating cached keys with the model's own rotary position embedding (RoPE).

A cached key arrives rotated at its absolute position ``p``: ``s * R(p) k`` (``s`` is the
rotary ``attention_scaling`` that YaRN and LongRoPE fold into cos/sin). RoPE rotations of one
plane compose additively, ``R(p + d) = R(d) R(p)``, so moving a stored key ``d`` positions later
is one *pure* rotation by ``d``, with no scaling: applying ``s`` again would scale the key twice.

Everything is read from the model's rotary module, not re-derived from the config: its
``inv_freq`` buffer already folds in ``rope_theta``, the head dim, ``partial_rotary_factor``
(its length is half the rotated dims) and the scaling type (linear, llama3, YaRN,
proportional), exactly as the model applies them. The rotation layout (halves as in Llama, or
interleaved pairs as in GLM and Cohere) is probed from the model's own ``rotate_half``.

A query that will stand at one of the positions ``a, ..., a + n - 1`` is rotated, on average, by
the mean of the model's rotations there (:meth:`Rotary.mean_rotation_transposed`): per frequency
the mean of ``cos`` and ``sin`` over the window has a closed form (a geometric sum), and the mean
rotation's transpose is applied to the keys instead of the queries' ``d x d`` statistics.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .model_layout import text_config

LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")
"""Rotary types whose frequencies change with the sequence length: a key stored under one set of
frequencies cannot be moved by a rotation computed from another."""


class Rotary:
    """The rotation a model applies to the first ``rotary_dim`` dims of each key head."""

    def __init__(self, inv_freq: torch.Tensor, interleaved: bool, attention_scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.detach().to("cpu", torch.float64)
        self.interleaved = interleaved
        self.attention_scaling = float(attention_scaling)
        """What the model folds into its cos and sin (YaRN, LongRoPE): a re-rotation never applies it
        (the stored key carries it already); the model's rotation of a query, averaged, does."""
        self._memo: tuple[tuple, torch.Tensor] | None = None
        self._window_on: dict[tuple[torch.device, int], tuple[torch.Tensor, ...]] = {}
        self._sign_on: dict[torch.device, torch.Tensor] = {}
        self._layout_freq_on: dict[tuple[torch.device, int], torch.Tensor] = {}  # per rotated dim, float64

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def matrix(
        self, offset: int | torch.Tensor, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The rotation by ``offset`` positions as a ``[head_dim, head_dim]`` matrix acting on the right.

        ``offset``: an ``int``, or a ``LongTensor[batch]`` (then ``[batch, 1, head_dim, head_dim]``).
        One small matmul rotates every sink of a layer, and every layer of a step shares the
        matrix (the last one is memoised). Angles are taken in float64, so large offsets lose no
        precision; the dims past ``rotary_dim`` (partial rotary) pass through unchanged.
        """
        per_row = isinstance(offset, torch.Tensor)
        key = (tuple(offset.tolist()) if per_row else offset, head_dim, dtype, device)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        if per_row:
            steps = offset.to("cpu", torch.float64)[:, None, None]
        else:
            steps = torch.tensor(float(offset), dtype=torch.float64)
        matrix = self._build(steps, head_dim)
        if per_row:
            matrix = matrix[:, None]
        matrix = matrix.to(device, dtype)
        self._memo = (key, matrix)
        return matrix

    def _build(self, steps: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The float64 rotation matrices for ``steps`` (float64, on the host)."""
        device = steps.device
        angles = steps * self.inv_freq
        angles = angles.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat([angles, angles], dim=-1)
        dim = self.rotary_dim
        basis = torch.eye(dim, dtype=torch.float64, device=device)  # row j becomes the image of basis vector j
        block = basis * angles.cos() + rotate_half(basis, self.interleaved) * angles.sin()
        matrix = torch.eye(head_dim, dtype=torch.float64, device=device).repeat(*block.shape[:-2], 1, 1)
        matrix[..., :dim, :dim] = block
        return matrix

    def turned(self, keys: torch.Tensor) -> torch.Tensor:
        """``rotate_half`` of ``keys``' rotated dims in the model's layout, zeros past them: with
        :meth:`cos_sin`, a rotation by a device offset is ``keys * cos + turned * sin``."""
        dim = self.rotary_dim
        out = torch.zeros_like(keys)
        out[..., :dim] = rotate_half(keys[..., :dim], self.interleaved)
        return out

    def cos_sin(self, offset: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[head_dim]`` float32 cos and sin of a rotation by ``offset`` (a 0-d long tensor on the
        device, nothing read back; angles in float64), ``1`` and ``0`` past the rotated dims:
        five operations where :meth:`matrix` builds a ``head_dim x head_dim`` matrix. The
        frequencies come from :meth:`prepare_cos_sin` (call it eagerly first: a host tensor inside
        a CUDA graph would make it skip the graph)."""
        freq = self._layout_freq_on[(offset.device, head_dim)]
        angles = offset * freq
        return angles.cos().float(), angles.sin().float()

    def prepare_cos_sin(self, device: torch.device, head_dim: int) -> None:
        """Make the per-dim frequencies :meth:`cos_sin` uses on ``device`` (eagerly, once)."""
        key = (device, head_dim)
        if key not in self._layout_freq_on:
            freq = self._per_dim()
            padded = torch.zeros(head_dim, dtype=torch.float64)
            padded[: freq.numel()] = freq
            self._layout_freq_on[key] = padded.to(device)

    def _per_dim(self) -> torch.Tensor:
        """The frequency of each rotated dim in the model's layout (float64, on the host)."""
        return self.inv_freq.repeat_interleave(2) if self.interleaved else self.inv_freq.repeat(2)

    def rotate(self, keys: torch.Tensor, offset: int | torch.Tensor) -> torch.Tensor:
        """``keys`` (``[batch, heads, n, head_dim]``, already rotated) moved ``offset`` positions later,
        in ``keys``' dtype promoted to at least float32."""
        work = torch.promote_types(keys.dtype, torch.float32)
        if keys.dtype != work:
            keys = keys.to(work)
        return keys @ self.matrix(offset, keys.shape[-1], work, keys.device)

    def mean_rotation_transposed(self, vectors: torch.Tensor, start: torch.Tensor, count: int) -> torch.Tensor:
        """``R^T v`` for ``vectors`` ``[batch, heads, n, head_dim]``, where ``R`` is the mean, over the
        positions ``start[b], ..., start[b] + count - 1`` of each row, of the model's rotation
        ``s (diag(cos) + diag(sin) P)`` (``P`` its ``rotate_half``, ``s`` its attention scaling):
        ``(R m) . v = m . (R^T v)``, so the mean rotation of a query statistic ``m`` is applied to
        the keys instead, in ``O(head_dim)`` per key. ``start``: ``LongTensor[batch]`` on the
        vectors' device (nothing is read back). The dims past ``rotary_dim`` pass unchanged."""
        return self.turn_back(vectors, self.mean_turn(start, count))

    def mean_turn(self, start: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`mean_rotation_transposed`'s rotation, for :meth:`turn_back`: ``[batch, 1, 1,
        rotary_dim]`` fp32 mean cos, and the mean sin signed and laid out to multiply the vectors'
        partners (:meth:`partners`): ``R^T v = cos v + sin' partners(v)``, the same products and
        sums as ``cos v - rotate_half(sin v)``, bit for bit. Per frequency ``t``, ``sum_k exp(i (a +
        k) t) = exp(i (a + (count - 1) / 2) t) sin(count t / 2) / sin(t / 2)``: one angle per
        frequency at the window's centre, times a spread factor that depends on ``count`` alone
        (float64 angles, exact at any position)."""
        freq, phase, spread = self._window(start.device, count)
        centre = torch.addcmul(phase, start.to(torch.float64)[:, None], freq)
        cos, sin = (centre.cos() * spread).float(), (centre.sin() * spread).float()
        shape = (-1, 1, 1, cos.shape[-1])
        return cos.view(shape), (self.partners(sin) * self._partner_sign(sin.device)).view(shape)

    def turn_back(self, vectors: torch.Tensor, turn: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``R^T v`` for ``vectors`` ``[batch, heads, n, head_dim]`` and a rotation from :meth:`mean_turn`
        (two products and their sum, in fp32); the dims past ``rotary_dim`` pass unchanged."""
        cos, sin = turn
        dim = self.rotary_dim
        rotated = (vectors if dim == vectors.shape[-1] else vectors[..., :dim]).float()
        out = rotated * cos + self.partners(rotated) * sin
        return out if dim == vectors.shape[-1] else torch.cat([out, vectors[..., dim:].float()], dim=-1)

    def partners(self, x: torch.Tensor) -> torch.Tensor:
        """Each rotated dim's partner in its plane: the other half (Llama) or the pair's other
        member (GLM, Cohere); ``rotate_half`` is this with the first member of each plane negated."""
        if self.interleaved:
            return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return x.roll(x.shape[-1] // 2, dims=-1)

    def _partner_sign(self, device: torch.device) -> torch.Tensor:
        """``[rotary_dim]`` minus the sign ``rotate_half`` gives each partner (``rotate_half(x) =
        sign * partners(x)``), so that ``- rotate_half(sin v) = partners(v) * partners(sin) * -sign``."""
        if device not in self._sign_on:
            self._sign_on[device] = -rotate_half(torch.ones(self.rotary_dim), self.interleaved).to(device)
        return self._sign_on[device]

    def _window(self, device: torch.device, count: int) -> tuple[torch.Tensor, ...]:
        """Per rotated dim (the model's layout), float64: the frequency ``t``, the window's centre
        offset ``(count - 1) t / 2``, and ``s sin(count t / 2) / (count sin(t / 2))`` (``s`` where
        ``t`` is 0); made once per device and window, eagerly (as :meth:`prepare_cos_sin`)."""
        key = (device, count)
        if key not in self._window_on:
            freq = self._per_dim()
            half = freq / 2
            spread = torch.where(half.sin() == 0, 1.0, (count * half).sin() / (count * half.sin()))
            self._window_on[key] = tuple(t.to(device) for t in (freq, freq * (count - 1) / 2, spread * self.attention_scaling))
        return self._window_on[key]



def rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE's ``rotate_half`` in either layout: halves (Llama) or interleaved pairs (GLM, Cohere)."""
    if interleaved:
        return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


RE_ROTATION = ("positions='cache' re-rotates keys", "use positions='absolute', which keeps the keys as the model rotated them")
"""Who needs the rotation, and the fix where a model cannot give it: the sinks' re-rotation (the default)."""


def rotary_of(model: nn.Module, layer_type: str = "full_attention", need: tuple[str, str] = RE_ROTATION) -> Rotary:
    """The rotation that ``model`` applies to the keys and queries of its ``layer_type`` layers.

    Raises ``ValueError`` when it cannot be read as one rotation per position: no RoPE,
    length-dependent frequencies (dynamic NTK, LongRoPE), multi-axis RoPE, or rotary dims that are
    not the leading ones (MLA). ``need``: what the caller does with it and the fix to name
    (:data:`RE_ROTATION` by default).
    """
    config = text_config(model)
    name = getattr(config, "model_type", type(model).__name__)
    purpose, fix = need
    module = _rotary_module(model)
    if module is None:
        raise ValueError(f"{purpose} with RoPE, but {name} has no rotary position embedding; {fix}")
    rope_type = getattr(module, "rope_type", None) or "default"
    per_type = isinstance(rope_type, dict)
    if per_type:
        rope_type = rope_type.get(layer_type) or "default"
    if any(kind in rope_type for kind in LENGTH_DEPENDENT_TYPES):
        raise ValueError(
            f"{purpose} with RoPE, which {name}'s rope_type={rope_type!r} cannot give: its frequencies "
            f"change with the sequence length; {fix}"
        )
    parameters = getattr(config, "rope_parameters", None) or {}
    if per_type:
        parameters = parameters.get(layer_type) or {}
    if "mrope_section" in parameters or rope_type == "axial" or getattr(config, "qk_rope_head_dim", None):
        raise ValueError(f"{purpose} with one-axis RoPE on the leading dims; {name} uses another layout; {fix}")
    inv_freq = getattr(module, f"{layer_type}_inv_freq" if per_type else "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise ValueError(
            f"{name}'s rotary module {type(module).__name__} has no frequencies for {layer_type!r} layers; {fix}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if 2 * inv_freq.numel() > head_dim:
        raise ValueError(f"{name}'s rotary frequencies cover more than its head dim {head_dim}; {fix}")
    scaling = getattr(module, f"{layer_type}_attention_scaling" if per_type else "attention_scaling", 1.0)
    return Rotary(inv_freq, _interleaved(module, name, fix), scaling)


def _rotary_module(model: nn.Module) -> nn.Module | None:
    """The decoder's shared rotary embedding (``model.model.rotary_emb`` in Llama-like models)."""
    decoder = getattr(model, "base_model", model)
    module = getattr(decoder, "rotary_emb", None)
    if isinstance(module, nn.Module):
        return module
    return next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)


def _interleaved(module: nn.Module, name: str, fix: str) -> bool:
    """Probe the modeling file's ``rotate_half``: halves (Llama) or interleaved pairs (GLM, Cohere)."""
    models_rotate_half = getattr(sys.modules.get(type(module).__module__), "rotate_half", None)
    probe = torch.arange(1.0, 9.0)
    if callable(models_rotate_half):
        out = models_rotate_half(probe)
        for interleaved in (False, True):
            if torch.equal(out, rotate_half(probe, interleaved)):
                return interleaved
    raise ValueError(
        f"{name} applies RoPE in a layout hf-kvpolicies does not recognise (no standard rotate_half); {fix}"
    )
