"""The container: one ``transformers.Cache`` whose layers each join a retention to a storage."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.utils import logging

from . import hooks
from .attention_scores import as_attention_result
from .masks import (
    allowed_keys,
    causal_with_padding,
    check_mask_format,
    masks_by_layer_type,
    padding_of,
    per_query_head,
    prompt_padding,
    to_attention_format,
)
from .model_layout import LayerLayout, layer_layouts, max_positions
from .retention import Retention, RingRetention
from .storage import Storage, StorageFactory, storage_factory

logger = logging.get_logger(__name__)

RetentionFactory = Callable[[LayerLayout], Retention]
"""Builds the policy's retention for one decoder layer."""

OTHER_MODEL = (
    "this {cache} was built for another model instance than the one running it: its hooks (exact "
    "masks for padded batches, the queries that scores need) and what it read from the model (rotary "
    "frequencies) belong to the model it was built with; build the cache with the model that uses it, "
    "{cache}(model)"
)


NOT_STATIC = (
    "{retention} cannot take this decode step inside a compiled forward: its static step needs a finished "
    "eager prefill, an unpadded batch (pre-sized full caches excepted) and at least as many prompt tokens as "
    "sinks; decode this input eagerly (generate(..., disable_compile=True))"
)


class ForwardState:
    """What one forward hands its layers beyond keys and values: the batch's padding, the queries
    the layers' policies read (handed over by the query hooks before each layer's ``update``), and
    each layer's own mask. One object per cache, begun and ended with every forward."""

    def __init__(self) -> None:
        self.padding: torch.Tensor | None = None
        """``[batch, seen + q]`` bool where the batch is padded."""
        self.queries: dict[int, tuple[torch.Tensor, float]] = {}
        self.layer_masks: list[torch.Tensor] | None = None
        self.static_masks: tuple[int, str, torch.dtype] | None = None
        """``(query groups, implementation, dtype)`` on a decode step whose static layers each need
        their own mask (built on the device as each layer's attention begins)."""
        self.causal = True
        """Whether the forward's mask is causal with padding (:func:`~hf_kvpolicies.masks.causal_with_padding`)."""

    def begin(self) -> None:
        self.padding, self.layer_masks, self.static_masks, self.causal = None, None, None, True
        self.queries.clear()

    end = begin


def _query_groups(config) -> int:
    """Query heads per KV head."""
    heads = config.num_attention_heads
    return heads // (getattr(config, "num_key_value_heads", None) or heads)


class PolicyLayer(CacheLayerMixin):
    """One layer's cache: ``retention`` decides the slots, ``storage`` holds them.

    **Static decode steps.** Where the retention and the storage have one (bounded policies,
    pre-sized full caches), every decode step after the eager prefill takes
    :meth:`~hf_kvpolicies.retention.base.Retention.static_step`, eagerly or compiled alike: the
    token is written at a device index, the whole fixed buffer is returned and ``get_mask_sizes``
    is ``(slots, 0)`` with the query at ``seen``, so unfilled slots are masked, as for
    ``StaticCache``. The same code runs eagerly and compiled, so both give the same tokens.
    """

    def __init__(self, retention: Retention, storage: StorageFactory) -> None:
        super().__init__()
        self.retention = retention
        self._make_storage = storage
        self.storage: Storage = storage()
        self.padded = False
        """Set by the cache on a padded batch where some layer is not in position order: the cache
        then builds every layer's exact per-row masks from host positions, so no layer is static."""
        self.static_allowed = False
        """Set by the cache: every layer can be static, so transformers builds the masks static steps need."""

    @property
    def is_compileable(self) -> bool:
        return self.retention.compileable and self.storage.compileable

    @property
    def is_sliding(self) -> bool:
        return self.retention.is_sliding

    @property
    def is_croppable(self) -> bool:
        return self.retention.is_croppable

    @property
    def record_past(self) -> bool:
        """transformers switches recording off through this attribute when generate() ends."""
        return self.retention.record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self.retention.record_past = value

    def activate_past_recording(self, **kwargs: object) -> None:
        """Keyword arguments (transformers >= 5.25 passes `recurrent_states_to_keep`) concern recurrent layers only."""
        self.host_state()
        self.retention.start_recording(self.storage)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.retention.update(self.storage, key_states[:, :, :0], value_states[:, :, :0], None, None)
        self.is_initialized = True
        self.device = key_states.device

    @property
    def rows(self) -> int | None:
        """Rows of the batch this layer holds (``None`` before the first update)."""
        return self.storage.rows if self.storage.is_allocated else None

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        padding: torch.Tensor | None = None,
        query: tuple[torch.Tensor, float] | None = None,
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``padding``: the forward's 2-D bool padding where the batch is padded; ``query``: its
        queries and their scaling where the retention reads them (both from the cache's forward)."""
        retention = self.retention
        if retention.static and key_states.shape[-2] == 1:
            return retention.static_step(self.storage, key_states, value_states, query)
        if torch.compiler.is_compiling():
            raise ValueError(NOT_STATIC.format(retention=type(retention).__name__))
        self.host_state()
        keys, values = retention.update(self.storage, key_states, value_states, padding, query)
        self.is_initialized = True
        self.device = key_states.device
        self.enter_static_if_ready()
        return keys, values

    # --- static decode steps ------------------------------------------------------------------
    def enter_static_if_ready(self) -> None:
        """After an eager forward: decode steps become static where they can (see the class doc)."""
        self.host_state()
        retention = self.retention
        if self.static_allowed and not self.padded and retention.static_ready(self.storage):
            retention.enter_static(self.storage)

    def host_state(self) -> None:
        """End static steps before the host bookkeeping is used or changed (an eager step re-enters them)."""
        if self.retention.static:
            self.retention.leave_static(self.storage)

    def kept_keys_values(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Keys and values of the tokens kept (``[batch, heads, kept, dim]``; ``None`` before the
        first update, as ``DynamicLayer``'s; with pooled heads, each head's tokens in position
        order, zeros where a head keeps fewer than the busiest: ``Retention.kept_keys_values``)."""
        if not self.storage.is_allocated:
            return None, None
        self.host_state()
        return self.retention.kept_keys_values(self.storage)

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens seen: a host int, or (inside a compiled step and after one, as ``StaticLayer``)
        the 0-d device tensor that static steps advance, so that nothing is read back."""
        retention = self.retention
        if torch.compiler.is_compiling() and retention.static:
            return retention.seen_t
        return retention.seen_t if retention.static and retention.stale else retention.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        retention = self.retention
        if retention.static:
            if query_length == 1 and retention.is_sliding:
                # a model's sliding mask: every slot in use holds one of the last `capacity` positions,
                # so slot j stands at position offset + j, inside the window (host ints: Counts.follow_compiled)
                return self.storage.capacity, max(retention.seen + 1 - self.storage.capacity, 0)
            if query_length == 1:
                return self.storage.capacity, 0
            self.host_state()
        kv_length = self.retention.returned_length(query_length)
        return kv_length, self.retention.seen + query_length - kv_length

    def get_max_length(self) -> int:
        return self.retention.max_length

    def reset(self) -> None:
        self.retention.reset()
        self.storage = self._make_storage()
        self.is_initialized = False
        self.padded = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.storage.is_allocated:
            self.host_state()
            self.storage.reorder(beam_idx)
            self.retention.reorder(beam_idx)
            self.enter_static_if_ready()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.storage.is_allocated:
            batch = self.storage_batch_size()
            self.reorder_cache(torch.arange(batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def storage_batch_size(self) -> int:
        return self.storage.rows

    def crop(self, tokens_to_remove: int) -> None:
        self.host_state()
        self.retention.crop(self.storage, tokens_to_remove)
        self.enter_static_if_ready()

    def offload(self) -> None:
        raise NotImplementedError("hf-kvpolicies caches do not offload layers to the CPU")

    prefetch = offload


class PolicyCache(Cache):
    """A cache made of one :class:`PolicyLayer` per decoder layer of ``model``.

    **Sliding-window layers.** On a model that mixes sliding-window and full-attention layers
    (Gemma 3, Qwen with ``layer_types``) the sliding layers keep exactly the window the model was
    trained with, as transformers' ``DynamicSlidingWindowLayer`` does, whatever the policy: they
    are bounded already and their mask is the model's, while the policy governs the
    full-attention layers, which hold nearly all of the memory a long context costs (Gemma 3:
    one layer in six, each holding the whole context, against windows of 512-1024 tokens). On a
    model whose every layer slides (Mistral-7B-v0.1), that rule would leave the policy nothing to
    do, so there the policy governs every layer, choosing only among the tokens the model's window
    still shows (:meth:`~hf_kvpolicies.retention.base.Retention.within_model_window`): a budget at
    least the model's window gives exactly ``DynamicSlidingWindowLayer``; a policy that cannot
    choose inside that window (attention sinks lie outside it) is refused with ``ValueError``.
    ``governed`` records which layers the policy decides.

    The cache belongs to the model instance it is built with (it installs hooks there and reads
    the model's rotary frequencies); a forward of another instance raises ``ValueError``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        retention: RetentionFactory,
        storage: str | StorageFactory = "native",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"{type(self).__name__} takes the model itself, not {type(model).__name__}: the cache installs "
                f"a hook on the model (exact masks for padded batches, a check that it runs with that model) "
                f"and reads its attention layout and rotary embedding; build it as {type(self).__name__}(model)"
            )
        make_storage = storage_factory(storage)
        self.layouts = layer_layouts(model)
        positions = max_positions(model)
        every_layer_slides = all(layout.is_sliding for layout in self.layouts)
        layers, self.governed, capped = [], [], False
        for layout in self.layouts:
            if layout.is_sliding and not every_layer_slides:
                layer_retention, governed = RingRetention.model_window(layout.sliding_window), False
            else:
                layer_retention, governed = self._policy_retention(model, retention, layout), True
            if governed and positions is not None:
                capped = layer_retention.limit_to(positions) or capped
            layers.append(PolicyLayer(layer_retention, make_storage))
            self.governed.append(governed)
        if positions is not None:
            layers[0].storage.check_positions(positions)
        if capped:
            logger.warning(
                f"{type(self).__name__}: its budget exceeds the {positions} positions of {model.config.model_type}; "
                f"each layer keeps (and allocates) at most {positions} tokens"
            )
        super().__init__(layers=layers)
        self.storage = storage
        self.grows_between_steps = any(layer.retention.grows_between_steps for layer in layers)
        """Whether static steps need their buffers grown before each forward (:meth:`get_mask_sizes`)."""
        self.padded: bool | None = None
        """Whether the batch is padded, read from the mask on multi-token forwards (never on a decode step)."""
        self.sizes_differ_by_layer = False
        """True where layers of one attention type may hold different numbers of tokens (pyramid or
        adaptive layer budgets): each then needs its own mask, handed to its attention module."""
        self.forward = ForwardState()
        self.dispatcher = hooks.attach(model)
        self.model_token = self.dispatcher.token
        self.attn_implementation = model.config._attn_implementation
        self.flex_on_cpu = self.attn_implementation == "flex_attention" and model.device.type == "cpu"
        """Masks then take a tensor kv offset (:meth:`get_mask_sizes`), for the implementation the cache was built under."""
        self._announced = self._masks_built = False
        static = self.static_layout()
        for layer in self.layers:
            layer.static_allowed = static

    def _policy_retention(self, model, retention: RetentionFactory, layout: LayerLayout) -> Retention:
        """The policy's retention for ``layout``, kept inside the model's window on a sliding layer."""
        chosen = retention(layout)
        if not layout.is_sliding:
            return chosen
        inside = chosen.within_model_window(layout.sliding_window)
        if inside is None:
            model_type = getattr(model.config, "model_type", type(model).__name__)
            raise ValueError(
                f"{type(self).__name__} cannot serve {model_type}: every layer of it is a sliding-window layer "
                f"(window {layout.sliding_window}), and {type(chosen).__name__} keeps tokens that window never "
                "shows; use SlidingWindowCache (window) or FullCache for this model"
            )
        return inside

    budget_keys: tuple[str, ...] | None = None
    """The keywords of :meth:`budget_parameters` that size the budget (``None``: all of them); the
    others shape how it is spent at that size. A spec that sets a sizing keyword keeps its own
    budget; one that sets only shaping keywords (``snapkv:kernel=7``) is swept, keeping them."""

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int] | None:
        """The constructor keywords that spend a total of ``budget`` kept tokens per layer.

        ``None`` for policies that keep every token (full, FP8): a budget does not apply to them.
        Budget sweeps (``hf-kvpolicies eval --budgets``) build each bounded policy this way.
        """
        return None

    @property
    def is_compileable(self) -> bool:
        """Whether decode steps are static (see :class:`PolicyLayer`): every layer has a static
        step, and the batch needs no exact per-row masks (known after the prefill; ``generate()``
        asks before it, and a compiled step that meets such a batch raises ``ValueError``)."""
        exact_masks = self.padded and not all(layer.retention.in_position_order for layer in self.layers)
        return self.static_layout() and not exact_masks

    def static_layout(self) -> bool:
        """Whether every layer has a static decode step and one mask serves them all."""
        return all(layer.is_compileable for layer in self.layers)

    @property
    def per_head_masks(self) -> bool:
        """True where some layer shows a head or a row slots that it must not attend to (pooled heads;
        rows with budgets of their own): once tokens are held, every forward needs exact masks
        (``masks``), decode steps of unpadded batches included."""
        return False

    @property
    def governed_layers(self) -> int:
        """How many layers the policy governs; a run where it governs none measures nothing."""
        return sum(self.governed)

    # --- the forward under way (called by the model's dispatcher, :mod:`hf_kvpolicies.hooks`) ------
    def before_forward(self, token: str, inputs: torch.Tensor, attention_mask: Any, config, dtype: torch.dtype) -> Any:
        """Checks the model instance and the batch, reads the padding (on multi-token forwards
        only: a decode step keeps its prompt's, so it reads nothing back), and builds the masks
        transformers' cannot: the exact mask of a padded batch (returned, to replace the
        forward's), and each layer's own where layers return different numbers of keys."""
        if token != self.model_token:
            raise ValueError(OTHER_MODEL.format(cache=type(self).__name__))
        self.check_rows(inputs.shape[0])
        self._announced = True
        forward = self.forward
        forward.begin()
        if inputs.shape[1] > 1 and any(layer.retention.computes_attention() for layer in self.layers):
            forward.causal = causal_with_padding(attention_mask, self.get_seq_length())
        if all(layer.retention.in_position_order for layer in self.layers):
            if inputs.shape[1] > 1 and any(layer.storage.keeps_pads_out for layer in self.layers):
                forward.padding = padding_of(attention_mask, self.get_seq_length())  # the model's mask is right
            return hooks.UNCHANGED
        padding, query_length = attention_mask, inputs.shape[1]
        if query_length > 1 and self.get_seq_length() == 0:
            padding = prompt_padding(padding)
        implementation = config._attn_implementation
        static = [layer.retention.static for layer in self.layers] if query_length == 1 else [False]
        if self.sizes_differ_by_layer and any(static):  # shown their slots from device state: nothing read back
            forward.static_masks = (_query_groups(config), implementation, dtype)
        if self.sizes_differ_by_layer and not all(static) and (
            self.per_head_masks and self.get_seq_length() > 0
            or len({layer.retention.returned_length(query_length) for layer in self.layers}) > 1
        ):
            forward.layer_masks = self._layer_masks(padding, inputs, query_length, config, dtype)
        if not isinstance(padding, torch.Tensor) or padding.dim() != 2:
            return hooks.UNCHANGED
        if query_length > 1 or self.padded is None:
            self.padded = not bool(padding.all())
        if not self.padded:
            return hooks.UNCHANGED
        if torch.compiler.is_compiling():
            raise ValueError(NOT_STATIC.format(retention=type(self.layers[self.first_policy_layer].retention).__name__))
        forward.padding = padding.to(torch.bool)
        for layer in self.layers:
            layer.padded = True
        if self.get_seq_length() == 0:
            return hooks.UNCHANGED
        check_mask_format(implementation, type(self).__name__)
        groups = _query_groups(config)
        return masks_by_layer_type(
            self.layers, lambda retention: allowed_keys(retention, forward.padding, query_length, groups), implementation, dtype
        )

    def _layer_masks(self, padding, inputs: torch.Tensor, query_length: int, config, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Each layer's own exact mask, where layers return different numbers of keys (pyramid or
        adaptive layer budgets) or per head (pooled heads, rows with their own budgets): transformers
        builds one from the first layer's sizes. An sdpa decode step of an unpadded batch needs none
        (every kept key is visible), unless a head or a row must not see some slots, or the cache is
        compileable (transformers then builds a mask of the first layer's size for every step)."""
        implementation = config._attn_implementation
        padded = isinstance(padding, torch.Tensor) and padding.dim() == 2 and (
            self.padded if query_length == 1 and self.padded is not None else not bool(padding.all())
        )
        if query_length == 1 and implementation == "sdpa" and not padded and not self.per_head_masks and not self.is_compileable:
            return None  # (transformers builds a compileable cache's mask, from the first layer's sizes)
        if not isinstance(padding, torch.Tensor) or padding.dim() != 2:
            padding = torch.ones(inputs.shape[0], self.get_seq_length() + query_length, dtype=torch.bool, device=inputs.device)
        groups = _query_groups(config)
        return [
            to_attention_format(allowed_keys(layer.retention, padding, query_length, groups, padded), implementation, dtype)
            for layer in self.layers
        ]

    def layer_mask(self, layer_idx: int) -> torch.Tensor | None:
        """Layer ``layer_idx``'s own mask for this forward (``None``: the model's)."""
        retention = self.layers[layer_idx].retention
        if self.forward.static_masks is not None and retention.static:
            visible = retention.static_visible()
            if visible is None:
                return None
            groups, implementation, dtype = self.forward.static_masks
            return to_attention_format(per_query_head(visible, groups), implementation, dtype)
        masks = self.forward.layer_masks
        return None if masks is None else masks[layer_idx]

    def query_rows(self, layer_idx: int) -> int | None:
        """How many of this forward's last queries layer ``layer_idx``'s policy reads
        (``hooks.ALL_QUERIES``: all of them; ``None``: none)."""
        return self.layers[layer_idx].retention.query_rows_wanted()

    def queries_before_rope(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s policy reads the queries before their rotation."""
        return self.layers[layer_idx].retention.queries_before_rope

    def receive_query(self, layer_idx: int, query: torch.Tensor, scaling: float) -> None:
        self.forward.queries[layer_idx] = (query, scaling)

    def computes_attention(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s statistic computes this forward's attention output from the
        probabilities it scores with (asked on forwards of several tokens: decode steps keep the
        model's attention, which compiles as the static step expects); if so, the layer is asked to."""
        retention = self.layers[layer_idx].retention
        if not (self.forward.causal and retention.computes_attention()):
            return False
        retention.output_wanted = True
        return True

    def attention_output(self, layer_idx: int) -> torch.Tensor | None:
        """The output layer ``layer_idx``'s statistic computed in this forward (``[batch, q, heads,
        value_dim]``), taken once; ``None`` where it computed none."""
        retention = self.layers[layer_idx].retention
        output = getattr(retention, "attention_output", None)
        if output is None:
            return None
        retention.attention_output = None
        return as_attention_result(output)

    def after_forward(self) -> None:
        """The forward is over (subclasses finish what waits for every layer: trims, reconstruction)."""
        self.forward.end()

    def check_rows(self, rows: int) -> None:
        """``ValueError`` for a forward whose batch is not the one the cache holds."""
        held = next((layer.rows for layer in self.layers if layer.rows is not None), None)
        if held is not None and held != rows:
            raise ValueError(
                f"this {type(self).__name__} holds a batch of {held} rows and this forward brings {rows}: call "
                f"cache.reset() (or build a new cache) before using it for another batch"
            )

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """transformers asks while it builds a forward's masks (inside the forward, or, for a
        compile-able cache, in ``generate()`` just before it): a forward that follows without the
        announcement of the cache's model's hook comes from another model instance."""
        self._masks_built = True
        if self.grows_between_steps and query_length == 1:
            for layer in self.layers:  # before any layer's step, on the first mask asked for
                if layer.retention.static:
                    layer.retention.make_room(layer.storage, query_length)
        kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
        if self.flex_on_cpu:
            # torch 2.13's CPU flex_attention (an inductor C++ template) fails to compile once a
            # recompilation makes the mask's int offsets symbolic ("'cur_kvSplitSize0' was not
            # declared in this scope"), as an evicting cache's kv offset, changing at every decode
            # step, does; the offset as a tensor keeps every forward of the cache on graphs that compile
            return kv_length, torch.tensor(kv_offset)
        return kv_length, kv_offset

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked at the first layer (keys written straight to ``update``, with no forward and so
        no masks, are the caller's business); the last layer closes the forward."""
        if layer_idx == 0 and self._masks_built and not self._announced:
            raise ValueError(OTHER_MODEL.format(cache=type(self).__name__))
        if layer_idx == 0:
            self.check_rows(key_states.shape[0])
        if layer_idx == len(self.layers) - 1:
            self._announced = self._masks_built = False
        forward = self.forward
        return self.layers[layer_idx].update(key_states, value_states, forward.padding, forward.queries.pop(layer_idx, None))

    # --- rolling back (assisted decoding, prompt lookup) ------------------------------------
    def _refuse_rollback(self) -> None:
        if not self.is_croppable:
            raise NotImplementedError(
                f"{type(self).__name__} evicts tokens, so it cannot roll back the draft tokens that assisted "
                "decoding and prompt lookup reject: use a cache that keeps every token (FullCache, FP8Cache) "
                "for those, or generate without them"
            )

    def activate_past_recording(self, **kwargs: object) -> None:
        """generate() calls this before prefill for assisted decoding: a bounded policy refuses here."""
        self._refuse_rollback()
        super().activate_past_recording(**kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse_rollback()
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.padded = None
        self.forward.end()
        self._announced = self._masks_built = False

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]:
        """Per layer, as ``DynamicCache`` yields: kept keys, kept values, and the model's sliding
        window as a tensor on sliding layers (``None`` elsewhere)."""
        for layer, layout in zip(self.layers, self.layouts):
            keys, values = layer.kept_keys_values()
            window = None if layout.sliding_window is None or not layer.is_sliding else torch.tensor(layout.sliding_window)
            yield keys, values, window

    def get_memory_footprint(self) -> int:
        """Bytes of every persistent tensor this cache holds, pre-allocated capacity included.

        Capacity counts because it is memory the user pays for: a full cache grows its buffers by a
        quarter when they fill, a bounded one allocates its ring (``budget + 1`` slots) once.
        """
        return sum(layer.storage.nbytes + layer.retention.state_nbytes for layer in self.layers)

    def kept_tokens(self, layer_idx: int | None = None) -> int:
        """Tokens currently kept by a layer, by default the first the policy governs (``get_seq_length``
        counts every token seen; a hybrid model's own sliding layers keep its window whatever the policy)."""
        layer = self.layers[self.first_policy_layer if layer_idx is None else layer_idx]
        if layer.retention.stale:
            layer.host_state()
        return layer.retention.kept

    @property
    def first_policy_layer(self) -> int:
        """Index of the first layer the policy governs (the model's own sliding-window layers of a
        hybrid model keep the model's window whatever the policy)."""
        return self.governed.index(True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={len(self.layers)}, storage={self.storage!r})"
