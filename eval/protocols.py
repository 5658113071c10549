"""How a prompt meets the cache before the answer is decoded: the protocols, named in every record.

- ``streamed`` (StreamingLLM's): context and question pass through the cache one forward at a
  time, or in chunks where that is exact (:mod:`eval.stream`); a bounded cache forgets what
  streaming forgets. The answer is decoded through the same cache.
- ``prefill`` (SnapKV's and H2O's): the whole prompt, context then question, goes through one
  forward; the policy trims as it does after any prefill; the answer is decoded through the cache.
- ``context`` (kvpress's pipeline and leaderboard): the context alone goes through one forward and
  is trimmed; the question then attends to what was kept plus itself, outside the budget, and
  the answer is decoded with nothing evicted (what each layer returned to the question's
  attention is frozen into a ``DynamicCache`` that decoding extends).
- ``last-token-kept`` (kvpress's pipeline as its needle runs use it): every prompt token but the
  last goes through one forward and is trimmed; the last is then decoded from what was kept, so
  even the first answer token sees only the kept tokens.

A cache that keeps every token in native precision gives the same answers under every protocol
whose :attr:`Protocol.lossless_same` holds (:func:`protocol_independent`), so the sweep runs it
once and says so.

A protocol is a :class:`Protocol` registered under its name (:func:`register_protocol`); its
:meth:`Protocol.answer` takes one context and a list of questions, so that protocols which share
one context between several questions (asked in turn through one cache, or each against the same
compressed context) fit the same interface as those which ask one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
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

CacheFactory = Callable[[], Cache]


@dataclass
class Answers:
    """What a batch of prompts gave: the answers, and the cache's state once the prompt was in."""

    texts: list[str]
    fed_tokens: int
    """Tokens of each prompt that went through the cache under the budget (the prompt; the
    context alone under ``context``; all but the last token under ``last-token-kept``)."""
    kept_tokens: int | None
    """Tokens the first governed layer held then (``None`` for caches that are not ours)."""
    held_bytes: int | None
    """Bytes of the tokens held then, per sequence."""
    allocated_bytes: int
    """Bytes the cache had allocated then, per sequence."""
    governed_layers: int | None
    decoded_held_bytes: int | None = None
    """Bytes held per sequence once the answer was decoded (``None`` where decoding went on in a
    cache that is not ours: the ``context`` protocol's frozen one)."""


class Protocol:
    """How a prompt meets the cache. Subclasses set the class attributes and :meth:`fill`, or
    override :meth:`answer` when several questions share one context."""

    name: str = ""
    summary: str = ""
    """One line for ``--help``: what goes through the cache, and whose protocol it is."""
    whole_prompt: bool = True
    """Whether context and question go through the cache as one prompt (then prompts of equal
    length batch together, wherever their questions start)."""
    lossless_same: bool = True
    """Whether a cache that keeps every token natively answers as it would under ``prefill``
    (then one run of such a cache stands for every such protocol)."""
    chunked: bool = False
    """Whether prompts go through in chunks of ``--chunk-size`` (exact or labelled approximate)."""

    def check(self, model: PreTrainedModel) -> None:
        """``ValueError`` where this protocol cannot run exactly on ``model``."""

    def fill(self, model: PreTrainedModel, context: torch.Tensor, question: torch.Tensor, cache: Cache, chunk: int) -> Filled:
        """Feed a prompt into ``cache``: the logits to decode the first answer token from."""
        raise NotImplementedError

    @torch.no_grad()
    def answer(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        context: torch.Tensor,
        questions: Sequence[torch.Tensor],
        make_cache: CacheFactory,
        new_tokens: int,
        chunk: int = 1,
    ) -> list[Answers]:
        """Greedy answers to ``[batch, n]`` contexts each followed by each ``[batch, m]`` question
        (rows of equal lengths), one :class:`Answers` per question; here each question is asked
        on its own, through a cache of its own."""
        self.check(model)
        found = []
        for question in questions:
            cache = make_cache()
            filled = self.fill(model, context.to(model.device), question.to(model.device), cache, chunk)
            tokens = _decode(model, filled.cache, filled.logits, new_tokens, filled.start)
            texts = tokenizer.batch_decode(tokens, skip_special_tokens=True)
            decoded = held_bytes(filled.cache)
            found.append(Answers([first_line(text) for text in texts], *filled.state, None if decoded is None else decoded // tokens.shape[0]))
        return found


@dataclass
class Filled:
    """A prompt fed: the logits of its last token, the cache to decode through (from position
    ``start`` when given: a frozen cache holds fewer tokens than were seen), and the cache's
    state once the budget applied (see :class:`Answers`)."""

    logits: torch.Tensor
    cache: Cache
    state: tuple
    start: int | None = None


class Streamed(Protocol):
    name = "streamed"
    summary = "streamed: every prompt token through the cache, token by token or in exact chunks (StreamingLLM)"
    chunked = True

    def fill(self, model, context, question, cache, chunk):
        prompt = torch.cat([context, question], dim=1)
        for _, _, logits in feed(model, prompt, cache, chunk, every_logit=False):
            pass
        return Filled(logits, cache, _state(cache, prompt))


class Prefill(Protocol):
    name = "prefill"
    summary = "prefill: the whole prompt in one forward, then the policy trims (SnapKV, H2O)"

    def fill(self, model, context, question, cache, chunk):
        prompt = torch.cat([context, question], dim=1)
        logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
        return Filled(logits, cache, _state(cache, prompt))


class ContextOnly(Protocol):
    name = "context"
    summary = "context: the context prefilled and trimmed, the question outside the budget (kvpress's pipeline)"
    whole_prompt = False

    def check(self, model):
        if any(layout.is_sliding for layout in layer_layouts(model)):
            raise ValueError(
                "the context protocol cannot run on a model with sliding-window layers (its decode masks "
                "would hide the kept tokens): use --protocol streamed or prefill"
            )

    def fill(self, model, context, question, cache, chunk):
        model(context, cache=cache, use_cache=True, logits_to_keep=1)
        state = _state(cache, context)
        logits, frozen = _outside_budget(model, cache, question)
        return Filled(logits, frozen, state, start=context.shape[1] + question.shape[1])


class LastTokenKept(Protocol):
    name = "last-token-kept"
    summary = "last-token-kept: all but the last prompt token prefilled and trimmed, the last decoded from what was kept (kvpress's needles)"

    def fill(self, model, context, question, cache, chunk):
        prompt = torch.cat([context, question], dim=1)
        model(prompt[:, :-1], cache=cache, use_cache=True, logits_to_keep=1)
        state = _state(cache, prompt[:, :-1])
        logits = model(prompt[:, -1:], cache=cache, use_cache=True).logits
        return Filled(logits, cache, state)


PROTOCOLS: dict[str, Protocol] = {}
"""Every protocol by name, in the order tables show them."""
DEFAULT_PROTOCOLS = ("streamed", "prefill")


def register_protocol(protocol: Protocol) -> None:
    """Make ``protocol`` available to ``--protocol`` and the sweep by its name."""
    if not protocol.name or protocol.name in PROTOCOLS:
        raise ValueError(f"a protocol needs a name of its own; {protocol.name!r} is empty or taken")
    PROTOCOLS[protocol.name] = protocol


for _protocol in (Streamed(), Prefill(), ContextOnly(), LastTokenKept()):
    register_protocol(_protocol)


def protocol_named(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}: choose one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


def check_protocol(model: PreTrainedModel, name: str) -> None:
    """``ValueError`` for a protocol this harness cannot run exactly on ``model``: the context
    protocol decodes from a frozen ``DynamicCache`` whose keys are not at their positions' indices,
    which transformers' sliding-window masks assume (Gemma 3, Mistral with a window)."""
    protocol_named(name).check(model)


def protocol_independent(spec: str) -> bool:
    """Whether a spec's cache keeps every token (no budget applies) in native storage: then the
    protocols whose :attr:`Protocol.lossless_same` holds differ only by float rounding, and one run
    stands for all of them."""
    name, kwargs = parse_spec(spec)
    constructor = policy_constructor(name)
    if getattr(constructor, "budget_parameters", lambda budget: {})(1) is not None:
        return False
    target = constructor.__init__ if inspect.isclass(constructor) else constructor
    parameter = inspect.signature(target).parameters.get("storage")
    storage = kwargs.get("storage", parameter.default if parameter is not None else None)
    return storage == "native"


def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: torch.Tensor,
    question: torch.Tensor,
    make_cache: CacheFactory,
    protocol: str,
    new_tokens: int,
    chunk: int = 1,
) -> Answers:
    """Greedy answers to ``[batch, n]`` contexts followed by ``[batch, m]`` questions (rows of
    equal lengths) under ``protocol``; ``chunk`` tokens per forward under ``streamed``."""
    return protocol_named(protocol).answer(model, tokenizer, context, [question], make_cache, new_tokens, chunk)[0]


def split(cases: Sequence, protocol: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(context, question)`` rows of a batch of cases (each with ``context_ids`` and
    ``question_ids``): apart where the protocol treats them apart; else the whole prompt as the
    context and an empty question, so that prompts of one length batch together."""
    if not protocol_named(protocol).whole_prompt:
        return torch.cat([c.context_ids for c in cases]), torch.cat([c.question_ids for c in cases])
    prompts = torch.cat([torch.cat([c.context_ids, c.question_ids], dim=1) for c in cases])
    return prompts, prompts[:, :0]


def state_fields(answers: Sequence[Answers]) -> dict:
    """The cache's state once the prompt was in, over batches: the most tokens kept, the mean kept
    fraction, and the most bytes held and allocated per sequence."""
    kept = [a.kept_tokens for a in answers]
    fractions = [a.kept_tokens / a.fed_tokens for a in answers if a.kept_tokens is not None]
    held = [a.held_bytes for a in answers if a.held_bytes is not None]
    return {
        "kept_tokens": None if None in kept else max(kept),
        "kept_fraction": sum(fractions) / len(fractions) if fractions else None,
        "held_bytes": max(held) if held else None,
        "allocated_bytes": max(a.allocated_bytes for a in answers),
    }


def first_line(text: str) -> str:
    """The answer: its first non-empty line (a base model goes on to write more text)."""
    return text.lstrip("\n").split("\n", 1)[0]


def _state(cache: Cache, fed: torch.Tensor) -> tuple:
    rows = fed.shape[0]
    ours = isinstance(cache, PolicyCache)
    kept = cache.kept_tokens() if ours else None
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
