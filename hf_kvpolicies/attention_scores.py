"""How a cache sees attention: the step's queries, captured by hooks on each attention module.

``Cache.update`` receives keys and values, never queries or attention weights, and sdpa returns
no weights at all. There are two ways to show a cache the queries without editing model code:

* an attention function registered with transformers' ``AttentionInterface`` (plus a mask
  function with ``AttentionMaskInterface``), selected by renaming the model's attention
  implementation. It sees the exact query, but the rename is a persistent change of
  ``model.config`` that every later cache then runs under: the mask format that code keyed on
  ``"sdpa"``/``"eager"`` reads (our own exact-mask hook among them), ``output_attentions``,
  the model-specific eager function that the model passes as default, all go through the
  wrapper, and nothing can undo the rename when the cache is dropped;
* hooks on the attention modules, which rebuild the queries from what the module computes.

We use hooks. The model, its config and transformers' registries stay untouched; the attention
output is still computed by the model's own sdpa or eager code, so a budget that evicts nothing
reproduces FullCache's logits exactly; for any other cache the hooks return after one check; they
are installed once per model however many caches are built.

Two hooks per attention module: a forward pre-hook sees the cache and the rotary ``cos``/``sin``
and, when the layer's retention wants queries (it has ``receive_query``), arms the second, a
forward hook on ``q_proj``, which takes the projection the module has just computed (no second
matmul) and applies what the module applies next (a per-head ``q_norm`` where there is one, the
modeling file's ``apply_rotary_pos_emb``), then hands the query to the retention before the
module calls ``update``. That recipe is exact only for architectures whose attention computes its
queries that way, so only those are accepted, checked when the cache is built.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from .cache import PolicyCache
from .masks import MASK_FORMATS, decoder_of

HOOK_ATTRIBUTE = "_hf_kvpolicies_query_hooks"
QUERY_POLICIES = "a query-scored cache (H2O, SnapKV, TOVA, KVzip)"

SCORE_CHUNK_ELEMENTS = 1 << 20
"""Attention probabilities held at once while scoring a long prompt (4 MiB in fp32: a chunk stays
in cache between the product, the softmax and the sum, which is what makes scoring cheap)."""

Rope = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def query_recipe_problem(module: nn.Module) -> str | None:
    """Why the queries of ``module`` cannot be rebuilt as ``rope(q_norm?(q_proj(x)))``, or ``None``.

    Read from the module itself, not from a list of model names: any attention that projects
    its queries with ``q_proj``, normalises them (optionally) per head or over all heads, and
    rotates them with its modeling file's ``apply_rotary_pos_emb`` is served (Llama, Mistral,
    Mixtral, Qwen 2/3 and their MoE variants, Gemma, Gemma 3, Starcoder2, Granite, Olmo 2...).
    """
    missing = [name for name in ("q_proj", "head_dim", "scaling", "layer_idx") if not hasattr(module, name)]
    if missing:
        return f"{type(module).__name__} has no {', '.join(missing)} (the queries are read from q_proj)"
    width = getattr(module.q_proj, "out_features", None)
    if not isinstance(width, int) or width % module.head_dim:
        return f"{type(module).__name__}.q_proj does not project to whole heads of {module.head_dim}"
    norm = getattr(module, "q_norm", None)
    if norm is not None and getattr(getattr(norm, "weight", None), "numel", lambda: -1)() not in (module.head_dim, width):
        return f"{type(module).__name__}.q_norm normalises neither each head nor all heads together"
    if getattr(module, "attn_logit_softcapping", None) is not None:
        return f"{type(module).__name__} softcaps its attention logits, which the scores would not see"
    if getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None) is None:
        return f"{type(module).__name__}'s modeling file has no apply_rotary_pos_emb to rotate the queries with"
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None  # no source to read: the attributes above are all there is to check
    for call in ("q_proj(", "apply_rotary_pos_emb("):
        if call not in source:
            return f"{type(module).__name__}.forward does not call {call[:-1]} (its queries are computed otherwise)"
    return None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder's attention modules, checked to be ones whose queries we can rebuild."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    layers = getattr(decoder_of(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers (model.layers) with attention {QUERY_POLICIES} can see")
    modules = []
    for index, layer in enumerate(layers):
        module = getattr(layer, "self_attn", None)
        problem = "no self_attn module" if module is None else query_recipe_problem(module)
        if problem is not None:
            raise ValueError(
                f"{QUERY_POLICIES} cannot rebuild the queries of {model_type} (layer {index}: {problem}): use a policy "
                "that needs no attention scores (window, sink, knorm)"
            )
        modules.append(module)
    return modules


def check_attention_implementation(policy: str, implementation: str) -> None:
    """Scores are computed beside attention kernels that return no weights: the hooks see the
    queries of sdpa and eager attention, whose masks they can read; others are refused."""
    if implementation not in MASK_FORMATS:
        raise ValueError(
            f"{policy} needs attention implementation 'sdpa' or 'eager' to see the queries (the model uses "
            f"{implementation!r}): call model.set_attn_implementation('sdpa') before building the cache"
        )


def attach_query_hook(model: nn.Module) -> None:
    """Install the query hooks once per model (idempotent: many caches never pile up hooks).

    Raises ``ValueError`` for a model whose attention modules cannot be served.
    """
    modules = attention_modules(model)
    decoder = decoder_of(model)
    if getattr(decoder, HOOK_ATTRIBUTE, None) is not None:
        return
    handles = []
    for module in modules:
        tap = _QueryTap(module)
        handles.append(module.register_forward_pre_hook(tap.arm, with_kwargs=True))
        handles.append(module.q_proj.register_forward_hook(tap.capture))
    setattr(decoder, HOOK_ATTRIBUTE, handles)


def detach_query_hook(model: nn.Module) -> None:
    """Remove the hooks (the model behaves as if no H2O cache had ever been built)."""
    decoder = decoder_of(model)
    for handle in getattr(decoder, HOOK_ATTRIBUTE, None) or ():
        handle.remove()
    setattr(decoder, HOOK_ATTRIBUTE, None)


def query_receiver(cache: object, layer_idx: int) -> Any | None:
    """Who takes the queries of layer ``layer_idx`` in the cache's next forward, if anyone: an
    object with ``receive_query(query, scaling, attention_mask)`` and optionally ``query_rows``
    (it reads only that many of a forward's last queries; ``None`` or absent: all of them).

    A :class:`PolicyCache` layer's retention when it ``needs_queries``; for any other
    ``transformers.Cache``, a layer that has ``receive_query`` itself (KVzip's reconstruction
    replays the context through such a cache). Every other cache gets ``None``: the hooks stay inert.
    """
    if isinstance(cache, PolicyCache):
        retention = cache.layers[layer_idx].retention
        return retention if getattr(retention, "needs_queries", False) else None
    if isinstance(cache, Cache):
        layer = cache.layers[layer_idx]
        return layer if hasattr(layer, "receive_query") else None
    return None


class _QueryTap:
    """The two hooks of one attention module and what passes from the first to the second."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.rope: Rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
        self.receiver: Any | None = None
        self.position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
        self.mask: torch.Tensor | None = None

    def arm(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the attention module: does this layer's retention want queries?"""
        cache = kwargs.get("cache")
        if cache is None:
            cache = kwargs.get("past_key_values")  # the name before transformers 5.40
        self.receiver = None
        receiver = query_receiver(cache, module.layer_idx)
        if receiver is None:
            return
        check_attention_implementation(type(cache).__name__, module.config._attn_implementation)
        self.receiver = receiver
        self.position_embeddings = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        self.mask = kwargs.get("attention_mask")

    def capture(self, q_proj: nn.Module, args: tuple, projected: torch.Tensor) -> None:
        """Forward hook of ``q_proj``: finish the query as the module does and hand it over (only
        the last ``query_rows`` rows where the receiver reads no more: a prefill's other queries
        are never rotated)."""
        receiver, self.receiver = self.receiver, None
        if receiver is None:
            return
        module = self.module
        cos, sin = self.position_embeddings
        rows = getattr(receiver, "query_rows", None)
        if rows is not None and rows < projected.shape[1]:
            projected, cos, sin = projected[:, -rows:], cos[:, -rows:], sin[:, -rows:]
        norm = getattr(module, "q_norm", None)
        if norm is not None and norm.weight.numel() != module.head_dim:  # over all heads (Olmo 2), before the split
            projected = norm(projected)
        query = projected.view(*projected.shape[:-1], -1, module.head_dim)
        if norm is not None and norm.weight.numel() == module.head_dim:  # per head (Qwen 3, Gemma 3)
            query = norm(query)
        query = query.transpose(1, 2)
        query, _ = self.rope(query, query[:, :0], cos, sin)  # the rotation takes a key too: an empty one
        mask, self.position_embeddings, self.mask = self.mask, None, None
        receiver.receive_query(query, module.scaling, mask)


def shares_one_key_row(keys: torch.Tensor) -> bool:
    """Whether ``keys`` is one key row expanded to every KV head (pooled heads hand attention such a
    view): scoring then multiplies every query head with that row, instead of a copy per KV head."""
    return keys.shape[1] > 1 and keys.stride(1) == 0


def query_probabilities(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 softmax probabilities ``[batch, kv_heads, groups, k]`` of one query per query head
    (``query`` ``[batch, query_heads, 1, head_dim]``) over every key: a decode step's, which sees
    the whole cache. The arithmetic of :func:`attention_chunks` in as few operations as it takes:
    a decode step pays for each one in every layer."""
    batch, query_heads, _, head_dim = query.shape
    kv_heads, key_count = keys.shape[1], keys.shape[2]
    if shares_one_key_row(keys):
        rows, keys = query.reshape(batch, 1, query_heads, head_dim), keys[:, :1]
    else:
        rows = query.reshape(batch, kv_heads, query_heads // kv_heads, head_dim)
    logits = torch.matmul(rows, keys.transpose(-1, -2)).mul_(scaling).view(batch, kv_heads, -1, key_count)
    if key_mask is not None:  # the lowest finite logit, as attention_chunks
        logits = torch.where(key_mask[:, :, None], logits, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def attention_chunks(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    first_new: int,
    key_mask: torch.Tensor | None = None,
    chunk_elements: int | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Causal softmax probabilities of ``query`` over ``keys``, a chunk of queries at a time.

    ``query`` is ``[batch, query_heads, q, head_dim]``, ``keys`` ``[batch, kv_heads, k, head_dim]``;
    query ``i`` sits at key index ``first_new + i`` and sees keys up to it. ``key_mask``
    (``[batch, kv_heads, k]`` bool, optional) hides keys that hold no token (padding). Yields
    ``(start, stop, probs)`` with fp32 ``probs[batch, kv_heads, groups, stop - start, end]`` over
    the first ``end = first_new + stop`` keys only (the later ones are in every query's future:
    a long prompt's scores cost half a full query x key product). Chunks hold at most
    ``chunk_elements`` (default :data:`SCORE_CHUNK_ELEMENTS`) probabilities; the arithmetic
    follows transformers' eager attention (``q @ k^T * scaling``, then an fp32 softmax).
    """
    batch, query_heads, length, head_dim = query.shape
    kv_heads, key_count = keys.shape[1], keys.shape[2]
    if length == 1 and first_new == key_count - 1:  # a decode step's one query sees every key
        yield 0, 1, query_probabilities(query, keys, scaling, key_mask).unsqueeze(-2)
        return
    groups = query_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, groups, length, head_dim)
    shared = shares_one_key_row(keys)
    step = max(1, (chunk_elements or SCORE_CHUNK_ELEMENTS) // (batch * query_heads * key_count))
    for start in range(0, length, step):
        stop = min(length, start + step)
        end = min(key_count, first_new + stop)
        if shared:
            rows = grouped[:, :, :, start:stop].reshape(batch, 1, kv_heads * groups * (stop - start), head_dim)
            logits = torch.matmul(rows, keys[:, :1, :end].transpose(-1, -2)).mul_(scaling)
        else:
            rows = grouped[:, :, :, start:stop].reshape(batch, kv_heads, groups * (stop - start), head_dim)
            logits = torch.matmul(rows, keys[:, :, :end].transpose(-1, -2)).mul_(scaling)
        logits = logits.view(batch, kv_heads, groups, stop - start, end)
        if key_mask is not None:  # the lowest finite logit: a query that sees only pads stays finite
            logits.masked_fill_(~key_mask[:, :, None, None, :end], torch.finfo(logits.dtype).min)
        if stop - start > 1:  # the chunk's own keys: each query sees those up to itself (in place, one block)
            future = torch.ones(stop - start, stop - start, dtype=torch.bool, device=keys.device).triu(1)
            logits[..., first_new + start : end].masked_fill_(future, float("-inf"))
        yield start, stop, torch.softmax(logits, dim=-1, dtype=torch.float32)


def accumulated_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    first_new: int,
    chunk_elements: int | None = None,
    key_mask: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax probability received by each key, summed over queries and the query heads of its KV head.

    Arguments as in :func:`attention_chunks`; ``query_mask`` (``[batch, q]`` bool, optional)
    drops the queries of pads. Returns fp32 ``[batch, kv_heads, k]``; the full query x key
    matrix of a long prompt is never held at once.
    """
    return received_attention(query, keys, scaling, first_new, chunk_elements, key_mask, query_mask, largest=False)


def max_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    first_new: int,
    chunk_elements: int | None = None,
    key_mask: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The largest softmax probability each key receives from any query, over the query heads of
    its KV head (KVzip's statistic). Arguments as in :func:`accumulated_attention`; returns fp32
    ``[batch, kv_heads, k]``, 0 for keys that no query sees (pads, the queries' future)."""
    return received_attention(query, keys, scaling, first_new, chunk_elements, key_mask, query_mask, largest=True)


def received_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    first_new: int,
    chunk_elements: int | None,
    key_mask: torch.Tensor | None,
    query_mask: torch.Tensor | None,
    largest: bool,
) -> torch.Tensor:
    """Each key's probabilities over the queries and the query heads of its KV head, chunk by
    chunk: their sum, or with ``largest`` their maximum (pad queries contribute 0 to either)."""
    batch, kv_heads, key_count = keys.shape[0], keys.shape[1], keys.shape[2]
    total: torch.Tensor | None = None
    for start, stop, probs in attention_chunks(query, keys, scaling, first_new, key_mask, chunk_elements):
        if query_mask is not None:
            probs = probs * query_mask[:, None, None, start:stop, None]
        received = probs.amax(dim=(2, 3)) if largest else probs.sum(dim=(2, 3))
        if total is None and received.shape[-1] == key_count:
            total = received  # a first chunk that sees every key (a decode step's): it is the total so far
            continue
        if total is None:  # the later keys are in this chunk's future: 0 until a later query sees them
            total = torch.zeros(batch, kv_heads, key_count, dtype=torch.float32, device=keys.device)
        seen = total[..., : received.shape[-1]]
        if largest:
            torch.maximum(seen, received, out=seen)
        else:
            seen += received
    if total is None:  # no queries
        return torch.zeros(batch, kv_heads, key_count, dtype=torch.float32, device=keys.device)
    return total
