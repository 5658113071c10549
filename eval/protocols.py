"""How a prompt meets the cache before the answer is decoded: three protocols, named in every record.

- ``streamed`` (StreamingLLM's): context and question pass through the cache one forward at a
  time, or in chunks where that is exact (:mod:`eval.stream`); a bounded cache forgets what
  streaming forgets. The answer is decoded through the same cache.
- ``prefill`` (SnapKV's and H2O's): the whole prompt, context then question, goes through one
  forward; the policy trims as it does after any prefill; the answer is decoded through the cache.
- ``context`` (kvpress's pipeline and leaderboard): the context alone goes through one forward and
  is trimmed; the question then attends to what was kept plus itself, outside the budget, and
  the answer is decoded with nothing evicted (what each layer returned to the question's
  attention is frozen into a ``DynamicCache`` that decoding extends).

A cache that keeps every token in native precision gives the same answers under all three
(:func:`protocol_independent`), so the sweep runs it once and says so.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from hf_kvpolicies import parse_spec
from hf_kvpolicies.cache import PolicyCache
from hf_kvpolicies.model_layout import layer_layouts
from hf_kvpolicies.specs import policy_constructor

from .memory import footprint, held_bytes
from .stream import feed

PROTOCOLS = ("streamed", "prefill", "context")
DEFAULT_PROTOCOLS = ("streamed", "prefill")


def check_protocol(model: PreTrainedModel, protocol: str) -> None:
    """``ValueError`` for a protocol this harness cannot run exactly on ``model``: the context
    protocol decodes from a frozen ``DynamicCache`` whose keys are not at their positions' indices,
    which transformers' sliding-window masks assume (Gemma 3, Mistral with a window)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    if protocol == "context" and any(layout.is_sliding for layout in layer_layouts(model)):
        raise ValueError(
            "the context protocol cannot run on a model with sliding-window layers (its decode masks "
            "would hide the kept tokens): use --protocol streamed or prefill"
        )


def protocol_independent(spec: str) -> bool:
    """Whether a spec's cache keeps every token (no budget applies) in native storage: then the
    protocols differ only by float rounding, and one run stands for all of them."""
    name, kwargs = parse_spec(spec)
    constructor = policy_constructor(name)
    if getattr(constructor, "budget_parameters", lambda budget: {})(1) is not None:
        return False
    target = constructor.__init__ if inspect.isclass(constructor) else constructor
    parameter = inspect.signature(target).parameters.get("storage")
    storage = kwargs.get("storage", parameter.default if parameter is not None else None)
    return storage == "native"


@dataclass
class Answers:
    """What a batch of prompts gave: the answers, and the cache's state once the prompt was in."""

    texts: list[str]
    fed_tokens: int
    """Tokens of each prompt that went through the cache under the budget (the prompt; the
    context alone under ``context``)."""
    kept_tokens: int | None
    """Tokens the first governed layer held then (``None`` for caches that are not ours)."""
    held_bytes: int | None
    """Bytes of the tokens held then, per sequence."""
    allocated_bytes: int
    """Bytes the cache had allocated then, per sequence."""
    governed_layers: int | None


@torch.no_grad()
def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: torch.Tensor,
    question: torch.Tensor,
    make_cache: Callable[[], Cache],
    protocol: str,
    new_tokens: int,
    chunk: int = 1,
) -> Answers:
    """Greedy answers to ``[batch, n]`` contexts followed by ``[batch, m]`` questions (rows of
    equal lengths) under ``protocol``; ``chunk`` tokens per forward under ``streamed``."""
    check_protocol(model, protocol)
    cache = make_cache()
    context, question = context.to(model.device), question.to(model.device)
    prompt = torch.cat([context, question], dim=1)
    start = None
    if protocol == "streamed":
        for _, _, logits in feed(model, prompt, cache, chunk, every_logit=False):
            pass
        state = _state(cache, prompt)
    elif protocol == "prefill":
        logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
        state = _state(cache, prompt)
    else:
        model(context, cache=cache, use_cache=True, logits_to_keep=1)
        state = _state(cache, context)
        logits, cache = _outside_budget(model, cache, question)
        start = prompt.shape[1]
    texts = tokenizer.batch_decode(_decode(model, cache, logits, new_tokens, start), skip_special_tokens=True)
    return Answers([first_line(text) for text in texts], *state)


def first_line(text: str) -> str:
    """The answer: its first non-empty line (a base model goes on to write more text)."""
    return text.lstrip("\n").split("\n", 1)[0]


def _state(cache: Cache, fed: torch.Tensor) -> tuple:
    rows = fed.shape[0]
    ours = isinstance(cache, PolicyCache)
    kept = cache.stored_tokens() if ours else None
    held = held_bytes(cache)
    return (
        fed.shape[1],
        kept,
        None if held is None else held // rows,
        footprint(cache) // rows,
        cache.governed_layers if ours else None,
    )


def _outside_budget(model: PreTrainedModel, cache: Cache, question: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    """Feed the question in one forward, recording what each layer returns to its attention (the
    kept context and the question); return the logits and those keys and values as a cache."""
    returned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for index, layer in enumerate(cache.layers):
        def recording(keys, values, *args, _update=layer.update, _index=index, **kwargs):
            out = _update(keys, values, *args, **kwargs)
            returned[_index] = (out[0].clone(), out[1].clone())
            return out

        layer.update = recording  # on the instance, for this one forward
    try:
        logits = model(question, cache=cache, use_cache=True, logits_to_keep=1).logits
    finally:
        for layer in cache.layers:
            del layer.update
    frozen = DynamicCache()
    for index in range(len(cache.layers)):
        frozen.update(*returned[index], index)
    return logits, frozen


def _decode(model: PreTrainedModel, cache: Cache, logits: torch.Tensor, steps: int, start: int | None) -> torch.Tensor:
    """``steps`` greedy tokens; ``start`` gives explicit positions (a frozen cache holds fewer
    tokens than were seen, so its length would give the wrong ones)."""
    tokens = []
    for step in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        if step + 1 == steps:
            break
        extra = {} if start is None else {"position_ids": torch.full_like(token, start + step)}
        logits = model(token, cache=cache, use_cache=True, **extra).logits
    return torch.cat(tokens, dim=1)
