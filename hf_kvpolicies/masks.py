"""Attention masks for caches whose slots are not in positional order.

transformers builds one mask per forward from ``get_mask_sizes`` and reads the 2-D padding mask
at *positions* ``kv_offset + j``. That is right while slot ``j`` holds position
``kv_offset + j``, which a ring or an eviction policy breaks. Without padding it does not
matter (every kept key is visible to every new query, and the new keys come last, in order);
with padding it would hide real tokens and show pads.

So a forward pre-hook on the decoder, installed once per model, looks at each forward: when the
cache is a :class:`~hf_kvpolicies.cache.PolicyCache` that already holds tokens and the batch is
padded, it replaces the 2-D mask by the exact 4-D mask, built from the positions each slot
holds. For any other cache the hook returns at once and changes nothing. It also tells the cache
which model instance runs it (a cache built for another instance raises ``ValueError``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

HOOK_ATTRIBUTE = "_hf_kvpolicies_mask_hook"
LAYER_HOOK_ATTRIBUTE = "_hf_kvpolicies_layer_mask_hooks"
TOKEN_ATTRIBUTE = "_hf_kvpolicies_model_token"
"""Names the model instance a cache was built with (a deep copy, hook included, shares it)."""
CACHE_KWARGS = ("cache", "past_key_values")
MASK_FORMATS = ("sdpa", "eager")


def decoder_of(model: nn.Module) -> nn.Module:
    """The module that builds the masks (``LlamaModel`` inside ``LlamaForCausalLM``)."""
    return getattr(model, "base_model", model)


def attach_mask_hook(model: nn.Module) -> str:
    """Install the hook once per model (idempotent, so many caches never pile up hooks) and return
    the model's token: a cache keeps it, and the hook compares it at every forward."""
    decoder = decoder_of(model)
    if getattr(decoder, HOOK_ATTRIBUTE, None) is None:
        handle = decoder.register_forward_pre_hook(_exact_mask_hook, with_kwargs=True)
        setattr(decoder, HOOK_ATTRIBUTE, handle)
    if getattr(decoder, TOKEN_ATTRIBUTE, None) is None:
        setattr(decoder, TOKEN_ATTRIBUTE, uuid.uuid4().hex)
    return getattr(decoder, TOKEN_ATTRIBUTE)


def detach_mask_hook(model: nn.Module) -> None:
    decoder = decoder_of(model)
    handle = getattr(decoder, HOOK_ATTRIBUTE, None)
    if handle is not None:
        handle.remove()
        setattr(decoder, HOOK_ATTRIBUTE, None)


def _exact_mask_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    from .cache import PolicyCache

    cache = next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)
    if not isinstance(cache, PolicyCache):
        return None
    embeds = kwargs.get("inputs_embeds")
    inputs = kwargs.get("input_ids") if embeds is None else embeds
    if inputs is None:
        inputs = args[0]
    cache.announce_forward(getattr(module, TOKEN_ATTRIBUTE, None), inputs.shape[0])
    cache.layer_masks = None
    if all(layer.retention.in_position_order for layer in cache.layers):
        return None
    padding = kwargs.get("attention_mask")
    query_length = inputs.shape[1]
    if query_length > 1 and cache.get_seq_length() == 0:
        padding = prompt_padding(padding)
    dtype = embeds.dtype if embeds is not None else next(module.parameters()).dtype
    per_head = cache.per_head_masks and cache.get_seq_length() > 0
    if cache.sizes_differ_by_layer and (
        per_head or len({layer.retention.returned_length(query_length) for layer in cache.layers}) > 1
    ):
        _layer_masks(cache, padding, inputs, query_length, module.config, dtype)
    if not isinstance(padding, torch.Tensor) or padding.dim() != 2:
        return None
    if query_length > 1 or cache.padded is None:
        # read the mask's values on multi-token forwards only: a decode step keeps the padding
        # its prompt had (its own column is a real token), so it reads nothing back
        cache.padded = not bool(padding.all())
    if not cache.padded:
        return None
    if torch.compiler.is_compiling():
        from .cache import NOT_STATIC

        raise ValueError(NOT_STATIC.format(retention=type(cache.layers[cache.first_policy_layer].retention).__name__))
    for layer in cache.layers:
        layer.padded = True
        layer.retention.observe_padding(padding)
    if cache.get_seq_length() == 0:
        return None
    kwargs["attention_mask"] = exact_masks(cache, padding, query_length, module.config, dtype)
    return args, kwargs


def prompt_padding(mask):
    """The 2-D padding behind a prefill's mask. ``generate()`` hands a compile-able cache the masks
    it prepared (4-D, or ``{layer_type: 4-D}`` for models with ``layer_types``): in a prefill, a pad
    is a key that no query sees. Anything else is returned as it is."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return mask
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return allowed[:, 0].any(dim=-2)


def _layer_masks(cache, padding, inputs: torch.Tensor, query_length: int, config, dtype: torch.dtype) -> None:
    """Layers that return different numbers of keys (pyramid or adaptive layer budgets) each get
    their own exact mask, which :func:`_layer_mask_hook` hands to that layer's attention:
    transformers builds one mask from the first layer's sizes. An sdpa decode step of an unpadded
    batch needs none (every kept key is visible), so the hot path builds nothing, except for pooled
    heads, whose every head must see only the slots it owns."""
    implementation = config._attn_implementation
    padded = isinstance(padding, torch.Tensor) and padding.dim() == 2 and (
        cache.padded if query_length == 1 and cache.padded is not None else not bool(padding.all())
    )
    if query_length == 1 and implementation == "sdpa" and not padded and not cache.per_head_masks:
        return
    if not isinstance(padding, torch.Tensor) or padding.dim() != 2:
        padding = torch.ones(inputs.shape[0], cache.get_seq_length() + query_length, dtype=torch.bool, device=inputs.device)
    heads = config.num_attention_heads
    groups = heads // (getattr(config, "num_key_value_heads", None) or heads)
    cache.layer_masks = [
        to_attention_format(allowed_keys(layer.retention, padding, query_length, groups, padded), implementation, dtype)
        for layer in cache.layers
    ]


def attach_layer_mask_hook(model: nn.Module) -> None:
    """A pre-hook on every attention module that swaps in its layer's own mask when the cache has
    one (:func:`_layer_masks`); idempotent, inert for every other cache."""
    decoder = decoder_of(model)
    if getattr(decoder, LAYER_HOOK_ATTRIBUTE, None) is not None:
        return
    handles = [
        layer.self_attn.register_forward_pre_hook(_layer_mask_hook, with_kwargs=True)
        for layer in getattr(decoder, "layers", ())
        if hasattr(getattr(layer, "self_attn", None), "layer_idx")
    ]
    setattr(decoder, LAYER_HOOK_ATTRIBUTE, handles)


def _layer_mask_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    cache = next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)
    masks = getattr(cache, "layer_masks", None)
    if masks is None:
        return None
    kwargs["attention_mask"] = masks[module.layer_idx]
    return args, kwargs


def exact_masks(cache, padding: torch.Tensor, query_length: int, config, dtype: torch.dtype):
    """The mask (or ``{layer_type: mask}`` for mixed models) for the next forward of ``cache``."""
    implementation = config._attn_implementation
    if implementation not in MASK_FORMATS:
        raise NotImplementedError(
            f"a padded batch with {type(cache).__name__} needs attention_implementation 'sdpa' or 'eager' "
            f"(the model uses {implementation!r}): call model.set_attn_implementation('sdpa'), or run rows one at a time"
        )
    heads = config.num_attention_heads
    groups = heads // (getattr(config, "num_key_value_heads", None) or heads)
    return masks_by_layer_type(
        cache, lambda retention: allowed_keys(retention, padding, query_length, groups), implementation, dtype
    )


def masks_by_layer_type(cache, allowed: Callable[[Any], torch.Tensor], implementation: str, dtype: torch.dtype):
    """``allowed(retention)`` (bool, 4-D) of the first layer of each layer type, in the format of
    ``implementation``: one mask, or ``{layer_type: mask}`` for models that mix sliding and full
    attention layers (the layers of one type keep alike, so one mask serves them all)."""
    masks: dict[str, torch.Tensor] = {}
    for layer in cache.layers:
        layer_type = "sliding_attention" if layer.is_sliding else "full_attention"
        if layer_type not in masks:
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
            return (key_pos.to(device) >= 0)[:, :, None].repeat_interleave(groups, dim=1)
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
