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
- ``multiturn`` (SCBench's multi-turn mode): the context goes through one forward and is trimmed;
  then the questions are asked in turn, as a chat continues: each question in one forward through
  the same cache (after the previous answer and the framing's ``between``), its answer decoded
  through it token by token until it ends, every answer token fed, so what the cache evicts while
  answering counts for the next turn.
- ``multiquery`` (kvpress's several questions per context; SCBench's multi-request mode): the
  context goes through one forward and is trimmed once; each question is then asked on its own of
  a copy of that cache (:func:`~eval.cache_copy.copy_cache`) and its answer decoded until it ends.

Under the last two an answer ends where the case's :class:`~eval.dialogue.Framing` says (its
first line, or an end-of-turn token), not after a fixed number of tokens.

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

from .cache_copy import copy_cache
from .dialogue import Framing, plain
from .memory import footprint, held_bytes
from .stream import feed

CacheFactory = Callable[[], Cache]


@dataclass
class Answers:
    """What a batch of prompts gave: the answers, and the cache's state once the prompt was in."""

    texts: list[str]
    fed_tokens: int
    """Tokens of each prompt that went through the cache under the budget (the prompt; the
    context alone under ``context``; all but the last token under ``last-token-kept``; under
    ``multiturn`` the conversation up to this turn's question)."""
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
    shares_context: bool = False
    """Whether :meth:`answer` asks a case's questions together, of one context (the tasks pass them
    all at once); else each question is asked on its own, with the context before it."""
    lockstep: bool = True
    """Whether the rows of a batch go through every forward together. A conversation's rows part
    at the first answer (answers end where they end), so the tasks give such a protocol one row
    at a time."""

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
        framing: Framing | None = None,
    ) -> list[Answers]:
        """Greedy answers to ``[batch, n]`` contexts each followed by each ``[batch, m]`` question
        (rows of equal lengths), one :class:`Answers` per question; here each question is asked
        on its own, through a cache of its own, and its answer is the first line of ``new_tokens``
        decoded tokens. ``framing`` (plain text if not given) joins the turns of a conversation
        and ends answers for the protocols that share a context."""
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
        return Filled(logits, cache, _state(cache, *prompt.shape))


class Prefill(Protocol):
    name = "prefill"
    summary = "prefill: the whole prompt in one forward, then the policy trims (SnapKV, H2O)"

    def fill(self, model, context, question, cache, chunk):
        prompt = torch.cat([context, question], dim=1)
        logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
        return Filled(logits, cache, _state(cache, *prompt.shape))


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
        state = _state(cache, *context.shape)
        logits, frozen = _outside_budget(model, cache, question)
        return Filled(logits, frozen, state, start=context.shape[1] + question.shape[1])


class LastTokenKept(Protocol):
    name = "last-token-kept"
    summary = "last-token-kept: all but the last prompt token prefilled and trimmed, the last decoded from what was kept (kvpress's needles)"

    def fill(self, model, context, question, cache, chunk):
        prompt = torch.cat([context, question], dim=1)
        model(prompt[:, :-1], cache=cache, use_cache=True, logits_to_keep=1)
        state = _state(cache, *prompt[:, :-1].shape)
        logits = model(prompt[:, -1:], cache=cache, use_cache=True).logits
        return Filled(logits, cache, state)


class SharedContext(Protocol):
    """A protocol that prefills one context for several questions, and ends each answer where the
    framing says."""

    whole_prompt = False
    lossless_same = False  # its answers end where they end, not after a fixed number of tokens
    shares_context = True

    @staticmethod
    def _prefill(model: PreTrainedModel, context: torch.Tensor, make_cache: CacheFactory) -> Cache:
        """A new cache holding ``context``, fed in one forward (the policy trims after it)."""
        cache = make_cache()
        model(context.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
        return cache


class MultiTurn(SharedContext):
    name = "multiturn"
    summary = "multiturn: the context prefilled and trimmed once, then each question and its answer in turn through the same cache (SCBench's multi-turn)"
    lockstep = False

    @torch.no_grad()
    def answer(self, model, tokenizer, context, questions, make_cache, new_tokens, chunk=1, framing=None):
        """One conversation per row (rows part at the first answer): the turns' :class:`Answers`,
        each over the rows (:func:`over_rows`)."""
        framing = framing or plain(tokenizer)
        conversations = [
            self._conversation(model, tokenizer, context[row : row + 1], [q[row : row + 1] for q in questions], make_cache, new_tokens, framing)
            for row in range(context.shape[0])
        ]
        return [over_rows([conversation[turn] for conversation in conversations]) for turn in range(len(questions))]

    def _conversation(self, model, tokenizer, context, questions, make_cache, new_tokens, framing) -> list[Answers]:
        cache = self._prefill(model, context, make_cache)
        fed = context.shape[1]
        between = torch.tensor([framing.between], dtype=torch.long).reshape(1, -1)
        found = []
        for turn, question in enumerate(questions):
            ids = question if turn == 0 else torch.cat([between, question], dim=1)
            logits = model(ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1).logits
            fed += ids.shape[1]
            state = _state(cache, 1, fed)
            [tokens] = decode_answers(model, cache, logits, new_tokens, framing, feed_last=True)
            fed += len(tokens)
            found.append(Answers([first_line(tokenizer.decode(tokens, skip_special_tokens=True))], *state, held_bytes(cache)))
        return found


class MultiQuery(SharedContext):
    name = "multiquery"
    summary = "multiquery: the context prefilled and trimmed once, each question asked of its own copy of that cache (kvpress's questions per context; SCBench's multi-request)"

    @torch.no_grad()
    def answer(self, model, tokenizer, context, questions, make_cache, new_tokens, chunk=1, framing=None):
        framing = framing or plain(tokenizer)
        rows = context.shape[0]
        cache = self._prefill(model, context, make_cache)
        found = []
        for turn, question in enumerate(questions):
            own = cache if turn == len(questions) - 1 else copy_cache(cache, model)  # the last may take the original
            logits = model(question.to(model.device), cache=own, use_cache=True, logits_to_keep=1).logits
            state = _state(own, rows, context.shape[1] + question.shape[1])
            tokens = decode_answers(model, own, logits, new_tokens, framing, feed_last=False)
            decoded = held_bytes(own)
            texts = [first_line(text) for text in tokenizer.batch_decode(tokens, skip_special_tokens=True)]
            found.append(Answers(texts, *state, None if decoded is None else decoded // rows))
        return found


PROTOCOLS: dict[str, Protocol] = {}
"""Every protocol by name, in the order tables show them."""
DEFAULT_PROTOCOLS = ("streamed", "prefill")


def register_protocol(protocol: Protocol) -> None:
    """Make ``protocol`` available to ``--protocol`` and the sweep by its name."""
    if not protocol.name or protocol.name in PROTOCOLS:
        raise ValueError(f"a protocol needs a name of its own; {protocol.name!r} is empty or taken")
    PROTOCOLS[protocol.name] = protocol


for _protocol in (Streamed(), Prefill(), ContextOnly(), LastTokenKept(), MultiTurn(), MultiQuery()):
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
    framing: Framing | None = None,
) -> Answers:
    """Greedy answers to ``[batch, n]`` contexts followed by ``[batch, m]`` questions (rows of
    equal lengths) under ``protocol``; ``chunk`` tokens per forward under ``streamed``."""
    return protocol_named(protocol).answer(model, tokenizer, context, [question], make_cache, new_tokens, chunk, framing)[0]


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


def over_rows(answers: Sequence[Answers]) -> Answers:
    """Answers of rows answered apart as one: their texts in order, and of the cache's state per
    sequence the most over the rows (each row's own where there is one)."""

    def most(values: list) -> int | None:
        return None if None in values else max(values)

    return Answers(
        [text for a in answers for text in a.texts],
        max(a.fed_tokens for a in answers),
        most([a.kept_tokens for a in answers]),
        most([a.held_bytes for a in answers]),
        max(a.allocated_bytes for a in answers),
        answers[0].governed_layers,
        most([a.decoded_held_bytes for a in answers]),
    )


def first_line(text: str) -> str:
    """The answer: its first non-empty line (a base model goes on to write more text)."""
    return text.lstrip("\n").split("\n", 1)[0]


def _state(cache: Cache, rows: int, fed: int) -> tuple:
    """The cache's state (:class:`Answers`' fields) once ``fed`` tokens of each of ``rows`` rows are in."""
    ours = isinstance(cache, PolicyCache)
    kept = cache.kept_tokens() if ours else None
    held = held_bytes(cache)
    return (
        fed,
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


def decode_answers(
    model: PreTrainedModel, cache: Cache, logits: torch.Tensor, limit: int, framing: Framing, feed_last: bool
) -> list[list[int]]:
    """Each row's greedy answer: tokens until one that ends it (:meth:`Framing.ends`, not part of
    the answer) or ``limit`` of them. Each answer token goes through the cache as a decode step,
    one forward per token (a row that has ended goes on being fed greedy tokens, which its answer
    never reads); the last token of an answer cut at ``limit`` is fed too with ``feed_last`` (the
    conversation goes on after it)."""
    answers: list[list[int]] = [[] for _ in range(logits.shape[0])]
    ended = [False] * len(answers)
    for step in range(limit):
        tokens = logits[:, -1].argmax(-1, keepdim=True)
        for row, token in enumerate(tokens[:, 0].tolist()):
            if not ended[row]:
                ended[row] = framing.ends(answers[row], token)
                if not ended[row]:
                    answers[row].append(token)
        if all(ended) or (step + 1 == limit and not feed_last):
            break
        logits = model(tokens, cache=cache, use_cache=True).logits
    return answers


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
