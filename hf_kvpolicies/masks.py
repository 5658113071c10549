"""Attention masks for caches whose slots are not in positional order: functions of their inputs.

transformers builds one mask per forward from ``get_mask_sizes`` and reads the 2-D padding mask
at *positions* ``kv_offset + j``. That is right while slot ``j`` holds position
``kv_offset + j``, which a ring or an eviction policy breaks. Without padding it does not
matter (every kept key is visible to every new query, and the new keys come last, in order);
with padding it would hide real tokens and show pads. The exact mask is built here from the
positions each slot holds (``retention.key_positions``); the cache decides when it is needed
(:meth:`~hf_kvpolicies.cache.PolicyCache.before_forward`).

A retention is read through three things only: ``key_positions(q)`` (``[kv]`` positions shared by
the rows, or ``[batch, kv_heads, kv]`` per row and head), ``seen``, and, for shared positions,
``visible(query_pos, key_pos)`` and ``real_keys(padding, key_pos)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

MASK_FORMATS = ("sdpa", "eager")
"""Attention implementations that take a 4-D per-head mask as given."""


def full_attention_mask(mask: Any) -> Any:
    """A forward's mask for its full-attention layers (``{layer_type: mask}`` for models with
    ``layer_types``, else the mask itself)."""
    return mask.get("full_attention", next(iter(mask.values()), None)) if isinstance(mask, dict) else mask


def visible_keys(mask: Any) -> torch.Tensor | None:
    """bool ``[batch, q, kv]``: the keys each query sees under a 4-D mask (bool, or additive with 0
    where seen; the full-attention one of a ``{layer_type: 4-D}``); ``None`` for any other mask."""
    mask = full_attention_mask(mask)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    return (mask if mask.dtype == torch.bool else mask == 0)[:, 0]


def prompt_padding(mask: Any) -> Any:
    """The 2-D padding behind a prefill's mask. ``generate()`` hands a compile-able cache the masks
    it prepared (4-D, or ``{layer_type: 4-D}`` for models with ``layer_types``): in a prefill, a pad
    is a key that no query sees. Anything else is returned as it is."""
    visible = visible_keys(mask)
    return full_attention_mask(mask) if visible is None else visible.any(dim=-2)


def padding_of(mask: Any, past: int) -> torch.Tensor | None:
    """bool ``[batch, past + q]``: a forward's 2-D padding where some row has pads (``None`` where
    none has, or where the mask is not padding: a 4-D mask of one's own after a prefill)."""
    padding = prompt_padding(mask) if past == 0 else mask
    if not isinstance(padding, torch.Tensor) or padding.dim() != 2 or bool(padding.all()):
        return None
    return padding.to(torch.bool)


def causal_with_padding(mask: Any, past: int) -> bool:
    """Whether a multi-token forward's mask (as the forward got it: none, 2-D padding, 4-D, or
    ``{layer_type: 4-D}``) shows each real query exactly the real keys up to its own position, all
    a statistic's probabilities assume (a 4-D mask of one's own, packed sequences, may show others)."""
    allowed = visible_keys(mask)
    if allowed is None:
        return True
    q, kv = allowed.shape[-2:]
    real = allowed.any(dim=-2)  # a real key is one that some query sees
    causal = torch.arange(kv, device=allowed.device) <= torch.arange(past, past + q, device=allowed.device)[:, None]
    expected = causal & real[:, None, :]
    queries = real[:, past : past + q] if real.shape[-1] >= past + q else torch.ones_like(allowed[..., 0])
    return bool(((allowed == expected).all(dim=-1) | ~queries).all())


def check_mask_format(implementation: str, cache_name: str) -> None:
    if implementation not in MASK_FORMATS:
        raise NotImplementedError(
            f"a padded batch with {cache_name} needs attention_implementation 'sdpa' or 'eager' "
            f"(the model uses {implementation!r}): call model.set_attn_implementation('sdpa'), or run rows one at a time"
        )


def masks_by_layer_type(layers: Sequence[Any], allowed: Callable[[Any], torch.Tensor], implementation: str, dtype: torch.dtype):
    """``allowed(retention)`` (bool, 4-D) of the first layer of each layer type, in the format of
    ``implementation``: one mask, or ``{layer_type: mask}`` for models that mix sliding and full
    attention layers (the layers of one type keep alike, so one mask serves them all). Each layer's
    host bookkeeping is brought up to date first (after static decode steps it lags the device)."""
    masks: dict[str, torch.Tensor] = {}
    for layer in layers:
        layer_type = "sliding_attention" if layer.is_sliding else "full_attention"
        if layer_type not in masks:
            layer.host_state()
            masks[layer_type] = to_attention_format(allowed(layer.retention), implementation, dtype)
    return masks if len(masks) > 1 else next(iter(masks.values()))


def allowed_keys(retention, padding: torch.Tensor, query_length: int, groups: int = 1, padded: bool = True) -> torch.Tensor:
    """Boolean ``[batch, 1, q, kv]``: causal, the retention's visibility, and no pads.

    A layout whose positions differ per KV head (scored eviction: ``key_positions`` is
    ``[batch, kv_heads, kv]``) gets ``[batch, query_heads, q, kv]``, each KV head's mask repeated
    for its ``groups`` query heads (sdpa and eager both take a per-head mask). ``padded=False``
    says the batch has no pads (a decode step then shows each head every slot holding a token).
    """
    device = padding.device
    key_pos = retention.key_positions(query_length)
    if key_pos.dim() == 3:
        if query_length == 1 and not padded:  # every kept token precedes the query and is real
            return per_query_head(key_pos.to(device) >= 0, groups)
        return _per_head_allowed(retention, padding, key_pos.to(device), query_length, groups)
    query_pos = torch.arange(retention.seen, retention.seen + query_length)
    causal = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] >= 0)
    allowed = (causal & retention.visible(query_pos, key_pos)).to(device)
    is_token = retention.real_keys(padding.to(device=device, dtype=torch.bool), key_pos)
    allowed = allowed[None, :, :] & is_token[:, None, :]
    # a query with nothing to attend to (a pad in the prompt) attends to everything instead of
    # producing NaN; its output is never used
    empty = ~allowed.any(dim=-1, keepdim=True)
    return (allowed | empty)[:, None]


def per_query_head(visible: torch.Tensor, groups: int) -> torch.Tensor:
    """bool ``[batch, query_heads, 1, k]``: a decode step's keys ``visible`` per KV head
    (``[batch, kv_heads, k]``), repeated for the ``groups`` query heads of each."""
    return visible[:, :, None].repeat_interleave(groups, dim=1)


def _per_head_allowed(retention, padding: torch.Tensor, key_pos: torch.Tensor, query_length: int, groups: int):
    query_pos = torch.arange(retention.seen, retention.seen + query_length, device=key_pos.device)
    causal = (key_pos[:, :, None, :] <= query_pos[:, None]) & (key_pos[:, :, None, :] >= 0)
    is_token = retention.real_keys(padding.to(dtype=torch.bool), key_pos)
    allowed = (causal & is_token[:, :, None, :]).repeat_interleave(groups, dim=1)
    return allowed | ~allowed.any(dim=-1, keepdim=True)  # a pad query attends to everything, not to nothing


def to_attention_format(allowed: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
