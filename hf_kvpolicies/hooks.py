"""The one dispatcher that runs inside a model's forward on behalf of a cache.

``Cache.update`` sees keys and values, never the batch's padding or the queries, and cannot
finish a forward (trim every layer once all have scored). So one dispatcher per model, installed
once however many caches are built, finds the cache in the forward's arguments and calls the
cache's own methods (:class:`ForwardParticipant`):

* a decoder pre-hook: ``before_forward(token, inputs, attention_mask, config, dtype)`` (``token``
  names the model instance), which may return the attention mask to use instead (the exact mask
  of a padded batch);
* one pre-hook per attention module: ``layer_mask(layer_idx)`` (a layer's own mask where layers
  keep different numbers of keys), ``query_rows(layer_idx)`` (whether, and how many of, this
  forward's queries the layer's policy reads) and ``queries_before_rope(layer_idx)`` (whether it
  reads them before their rotation);
* the query handed over with ``receive_query(layer_idx, query, scaling)`` before the layer's
  cache update: the rotated query as the model rotates it, taken from the result of its modeling
  file's ``apply_rotary_pos_emb`` (wrapped once per modeling file: the wrapper returns what the
  function returns and, while a layer's pre-hook has armed it, passes the query on, so reading
  it costs no operation), or, for a policy that reads the queries before their rotation,
  ``q_norm(q_proj(x))`` from a forward hook on the module's ``q_proj``;
* a decoder forward hook: ``after_forward()``.

Where a layer's statistic computes the softmax probabilities of every query of a forward over
every key attention sees (H2O, KVzip after its reconstruction), ``computes_attention(layer_idx)``
(asked on forwards of several tokens only) lets it compute attention's output from them as well:
the module's attention then runs :func:`shared_attention`, which returns
``attention_output(layer_idx)`` instead of computing the softmax a second time (the module's
configured implementation is swapped in the module's pre-hook, after the forward's masks are
built, and back as the function is called).

Any other cache (``DynamicCache``, a cache given to another model) meets hooks that return after
one check: the model's own outputs are unchanged. The attention-module hooks are installed only
when a cache needs them (:func:`serve_attention`, :func:`serve_queries`).
"""

from __future__ import annotations

import functools
import inspect
import sys
import uuid
from typing import Any, Protocol

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .masks import MASK_FORMATS
from .model_layout import decoder_of

ATTRIBUTE = "_hf_kvpolicies_dispatcher"
CACHE_KWARGS = ("cache", "past_key_values")
"""Where a forward carries its cache (``past_key_values`` before transformers 5.40)."""
QUERY_POLICIES = "a query-scored cache (H2O, SnapKV, TOVA, KVzip)"

class ForwardParticipant(Protocol):
    """What a cache implements to take part in the forwards of the model it was built with."""

    def before_forward(self, token: str, inputs: torch.Tensor, attention_mask: Any, config: Any, dtype: torch.dtype) -> Any: ...
    def layer_mask(self, layer_idx: int) -> torch.Tensor | None: ...
    def query_rows(self, layer_idx: int) -> int | None: ...
    def queries_before_rope(self, layer_idx: int) -> bool: ...
    def receive_query(self, layer_idx: int, query: torch.Tensor, scaling: float) -> None: ...
    def computes_attention(self, layer_idx: int) -> bool: ...
    def attention_output(self, layer_idx: int) -> torch.Tensor | None: ...
    def after_forward(self) -> None: ...


UNCHANGED = object()
"""``before_forward``'s answer when the forward keeps its own attention mask."""
ALL_QUERIES = 0
"""``query_rows``' answer for a layer that reads every query of the forward."""


def cache_in(kwargs: dict[str, Any]) -> Any:
    """The cache a forward was given (the one place that knows where to look)."""
    return next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)


def participates(cache: Any) -> bool:
    return callable(getattr(cache, "before_forward", None))


class Dispatcher:
    """The hooks of one model and the cache of the forward under way."""

    def __init__(self, model: nn.Module) -> None:
        self.decoder = decoder_of(model)
        self.token = uuid.uuid4().hex
        """Names the model instance (a deep copy of the model, dispatcher included, shares it)."""
        self.current: ForwardParticipant | None = None
        self.handles = [
            self.decoder.register_forward_pre_hook(self._before, with_kwargs=True),
            self.decoder.register_forward_hook(self._after, with_kwargs=True),
        ]
        self.taps: list[_AttentionTap] | None = None

    # --- the decoder ------------------------------------------------------------------------
    def _before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        for tap in self.taps or ():  # a forward that raised between a swap and its attention
            tap.restore()
        ROTATION.disarm()
        cache = cache_in(kwargs)
        if not participates(cache):
            self.current = None
            return None
        self.current = cache
        embeds = kwargs.get("inputs_embeds")
        inputs = kwargs.get("input_ids") if embeds is None else embeds
        if inputs is None:
            inputs = args[0]
        dtype = embeds.dtype if embeds is not None else next(module.parameters()).dtype
        mask = cache.before_forward(self.token, inputs, kwargs.get("attention_mask"), module.config, dtype)
        if mask is UNCHANGED:
            return None
        kwargs["attention_mask"] = mask
        return args, kwargs

    def _after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        cache, self.current = self.current, None
        if cache is not None:
            with torch.no_grad():
                cache.after_forward()

    # --- the attention modules (installed on demand) -------------------------------------------
    def serve_attention(self) -> None:
        """Install the attention-module pre-hooks (layer masks, query requests), once."""
        if self.taps is not None:
            return
        self.taps = []
        for module in _attention_layers(self.decoder):
            tap = _AttentionTap(self, module)
            self.handles.append(module.register_forward_pre_hook(tap.before, with_kwargs=True))
            self.taps.append(tap)
            setattr(module, TAP_ATTRIBUTE, tap)

    def serve_queries(self, model: nn.Module) -> None:
        """Install the query hooks, once; ``ValueError`` for a model whose queries cannot be read."""
        modules = attention_modules(model)
        self.serve_attention()
        for tap, module in zip(self.taps, modules):
            if not tap.serves_queries:
                tap.serves_queries = True
                tap_rotation(sys.modules[type(module).__module__])
                self.handles.append(module.q_proj.register_forward_hook(tap.capture))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for tap in self.taps or ():
            tap.restore()
            setattr(tap.module, TAP_ATTRIBUTE, None)


class _AttentionTap:
    """The hooks of one attention module, and what passes from the first to the second."""

    def __init__(self, dispatcher: Dispatcher, module: nn.Module) -> None:
        self.dispatcher, self.module = dispatcher, module
        self.serves_queries = False
        self.rows: int | None = None
        """How many of this forward's last queries to hand over before their rotation (``q_proj``'s hook)."""
        self.own_implementation: str | None = None
        """The module's configured attention while :func:`shared_attention` stands in for it."""

    def before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        """Arm the query hook if the layer's policy reads queries; swap in the layer's own mask. A
        policy that reads the queries before their rotation computes no attention probabilities, so
        any attention kernel serves it."""
        cache = self.dispatcher.current
        self.rows = None
        ROTATION.disarm()  # a layer that does not read its queries never receives another's
        if cache is None:
            return None
        layer = module.layer_idx
        rows = cache.query_rows(layer) if self.serves_queries else None
        if rows is not None:
            if cache.queries_before_rope(layer):
                self.rows = rows
            else:
                check_attention_implementation(type(cache).__name__, module.config._attn_implementation)
                ROTATION.arm(self, rows)
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                several = hidden.shape[1] > 1  # a decode step keeps the model's attention: nothing to ask
                if several and rows == ALL_QUERIES and not module.training and cache.computes_attention(layer):
                    self.own_implementation = module.config._attn_implementation
                    module.config._attn_implementation = SHARED_ATTENTION
        mask = cache.layer_mask(layer)
        if mask is None:
            return None
        kwargs["attention_mask"] = mask
        return args, kwargs

    def capture(self, q_proj: nn.Module, args: tuple, projected: torch.Tensor) -> None:
        """Normalise the query before its rotation as the module does and hand it over (only the
        last ``rows`` rows where the policy reads no more)."""
        rows, self.rows = self.rows, None
        if rows is None:
            return
        if rows != ALL_QUERIES and rows < projected.shape[1]:
            projected = projected[:, -rows:]
        self.hand_over(query_before_rope(self.module, projected))

    def hand_over(self, query: torch.Tensor) -> None:
        """``query`` (``[batch, heads, rows, head_dim]``) to the forward's cache, for this layer."""
        self.dispatcher.current.receive_query(self.module.layer_idx, query, self.module.scaling)

    def restore(self) -> str | None:
        """Put the module's own attention implementation back (if swapped); returns it."""
        own, self.own_implementation = self.own_implementation, None
        if own is not None:
            self.module.config._attn_implementation = own
        return own


class _ArmedRotation:
    """Which layer the next rotation's query goes to (armed by the layer's pre-hook, one call).

    One per process, as the wrapped functions are: forwards of query-scored caches run one at a
    time (two models forwarding in two threads at once would hand each other their queries)."""

    def __init__(self) -> None:
        self.tap: _AttentionTap | None = None
        self.rows = ALL_QUERIES

    def arm(self, tap: _AttentionTap, rows: int) -> None:
        self.tap, self.rows = tap, rows

    def disarm(self) -> None:
        self.tap = None

    def receive(self, query: torch.Tensor) -> None:
        tap, self.tap = self.tap, None
        module = tap.module
        heads = module.q_proj.out_features // module.head_dim
        if query.dim() != 4 or query.shape[1] != heads or query.shape[-1] != module.head_dim:
            raise ValueError(
                f"{type(module).__name__} rotates queries shaped {tuple(query.shape)}, not [batch, {heads} heads, "
                f"tokens, {module.head_dim}] as {QUERY_POLICIES} reads them: use a policy that needs no attention "
                "scores (window, sink, knorm, keydiff)"
            )
        if self.rows != ALL_QUERIES and self.rows < query.shape[-2]:
            query = query[:, :, -self.rows :]
        tap.hand_over(query)


ROTATION = _ArmedRotation()
WRAPPED = "_hf_kvpolicies_rotation_tap"


def tap_rotation(modeling: Any) -> None:
    """Wrap ``modeling.apply_rotary_pos_emb`` (once) so that an armed layer receives the rotated
    query the model computes: the wrapper returns the function's result unchanged and, disarmed,
    does nothing else (a model served by no cache of ours, or a layer whose policy reads no query)."""
    rotate = modeling.apply_rotary_pos_emb
    if getattr(rotate, WRAPPED, False):
        return

    @functools.wraps(rotate)
    def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> Any:
        rotated = rotate(*args, **kwargs)
        if ROTATION.tap is not None:
            ROTATION.receive(rotated[0])
        return rotated

    setattr(apply_rotary_pos_emb, WRAPPED, True)
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb


TAP_ATTRIBUTE = "_hf_kvpolicies_tap"
SHARED_ATTENTION = "hf_kvpolicies_shared"
"""The attention implementation a layer runs while its statistic computes its output."""


def shared_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output the layer's statistic computed from its probabilities (an ``AttentionInterface``
    function, run only where the module's pre-hook swapped it in). The module's own implementation
    computes it instead where there is none, or where the call asks for what the statistic's
    softmax does not have (attention weights, soft-capping, learned sinks)."""
    tap = getattr(module, TAP_ATTRIBUTE)
    own = tap.restore()
    cache = tap.dispatcher.current
    output = None if cache is None else cache.attention_output(module.layer_idx)
    if output is None or kwargs.get("output_attentions") or any(kwargs.get(name) is not None for name in ("softcap", "s_aux")):
        default = sys.modules[type(module).__module__].eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS.get_interface(own, default)(module, query, key, value, attention_mask, **kwargs)
    return output, None


AttentionInterface.register(SHARED_ATTENTION, shared_attention)


def query_before_rope(module: nn.Module, projected: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, q, head_dim]``: the query of ``module`` before its rotation, ``q_norm(q_proj(x))``,
    from its ``q_proj`` output (the module rotates it with ``apply_rotary_pos_emb`` next)."""
    norm = getattr(module, "q_norm", None)
    if norm is not None and norm.weight.numel() != module.head_dim:  # over all heads (Olmo 2), before the split
        projected = norm(projected)
    query = projected.view(*projected.shape[:-1], -1, module.head_dim)
    if norm is not None and norm.weight.numel() == module.head_dim:  # per head (Qwen 3, Gemma 3)
        query = norm(query)
    return query.transpose(1, 2)


# --- installing ------------------------------------------------------------------------------
def attach(model: nn.Module) -> Dispatcher:
    """The model's dispatcher, installed on first use (idempotent: many caches never pile up hooks)."""
    decoder = decoder_of(model)
    dispatcher = getattr(decoder, ATTRIBUTE, None)
    if dispatcher is None:
        dispatcher = Dispatcher(model)
        setattr(decoder, ATTRIBUTE, dispatcher)
    return dispatcher


def detach(model: nn.Module) -> None:
    """Remove every hook (the model behaves as if no cache of ours had ever been built)."""
    decoder = decoder_of(model)
    dispatcher = getattr(decoder, ATTRIBUTE, None)
    if dispatcher is not None:
        dispatcher.remove()
        setattr(decoder, ATTRIBUTE, None)


def check_attention_implementation(policy: str, implementation: str) -> None:
    """Scores are computed beside attention kernels that return no weights: the hooks see the
    queries of sdpa and eager attention, whose masks they can read; others are refused."""
    if implementation not in MASK_FORMATS:
        raise ValueError(
            f"{policy} needs attention implementation 'sdpa' or 'eager' to see the queries (the model uses "
            f"{implementation!r}): call model.set_attn_implementation('sdpa') before building the cache"
        )


def _attention_layers(decoder: nn.Module) -> list[nn.Module]:
    return [layer.self_attn for layer in getattr(decoder, "layers", ()) if hasattr(getattr(layer, "self_attn", None), "layer_idx")]


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
