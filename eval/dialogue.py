"""How a case's text becomes the token ids of a conversation, and where an answer ends.

A case is a context and one or more questions (:class:`Question`: what is asked, then the answer
prefix the model continues). :class:`Framing` turns them into ids in one of two ways:

- plain text (the default): the context opens with what the tokenizer sets before a text
  (:func:`~hf_kvpolicies.special_tokens.start_ids`); each question follows as printed, answer prefix
  included (its own line breaks set it off from what came before), and nothing joins the turns of
  a conversation: the next question follows the answer. An answer ends where its first line ends
  (the token that completes a line break after any the answer opens with) or at the tokenizer's
  end-of-sequence token;
- the tokenizer's chat template (``--chat-template``): the context opens the first user message
  (after the template's opening: system prompt, BOS), followed by a blank line and the first
  question; each question is a user message, and the assistant's message opens with the answer
  prefix, which the model continues. An answer ends at the end-of-sequence token or the token that
  closes a message in the template; the template's closing of the answer and opening of the next
  user message (``between``) go before each later question.

The pieces of the template are found by rendering a two-turn conversation of marker strings, so
any template that renders each turn the same way, whatever follows it, serves; one that does not
(it rewrites earlier turns once a later one follows) is refused with ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from hf_kvpolicies.special_tokens import start_ids

JOINER = "\n\n"
"""What separates the context from the first question inside the first user message (chat)."""
MARKS = ("KVPMARKCONTEXT", "KVPMARKQUESTION", "KVPMARKANSWER", "KVPMARKNEXT")


@dataclass(frozen=True)
class Question:
    """A question as text: what is asked, then the answer prefix the model continues (plain text
    is ``ask + prefix`` as printed; under a chat template ``ask`` is the user's message and
    ``prefix`` opens the assistant's)."""

    ask: str
    prefix: str = ""

    @property
    def text(self) -> str:
        return self.ask + self.prefix


@dataclass(frozen=True)
class Turn:
    """One question of a case as ids (asked right after the context, or after ``between`` in a
    conversation), and the strings its answer is scored against."""

    question_ids: torch.Tensor
    """``[1, m]``."""
    expected: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Framing:
    """The ids around a case's text, and the rule that ends an answer (see the module docstring)."""

    tokenizer: PreTrainedTokenizerBase = field(repr=False)
    opening: tuple[int, ...]
    """Before the context."""
    after_context: tuple[int, ...] = ()
    """After the context, before the first question."""
    between: tuple[int, ...] = ()
    """After an answer, before the next question of a conversation."""
    reply: tuple[int, ...] = ()
    """After a question's ask, before its answer prefix (the end of a user message and the
    template's generation prompt)."""
    stops: frozenset[int] = frozenset()
    """Tokens that end an answer; they are not part of it and never go through the cache."""
    chat: bool = False

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids if text else []

    def question_ids(self, question: Question) -> list[int]:
        """The ids of ``question`` asked right after the context (or after :attr:`between`)."""
        if not self.chat:
            return self.encode(question.text)
        return self.encode(question.ask.strip()) + list(self.reply) + self.encode(question.prefix.strip())

    def ends(self, answer: list[int], token: int) -> bool:
        """Whether ``token`` ends an answer that holds ``answer`` so far (``token`` is then not part
        of it): a stop token, or in plain text the token that completes its first line."""
        if token in self.stops:
            return True
        if self.chat:
            return False
        return "\n" in self.tokenizer.decode([*answer, token], skip_special_tokens=True).lstrip("\n")


def plain(tokenizer: PreTrainedTokenizerBase) -> Framing:
    """Plain text, as every single-question protocol reads its prompts."""
    eos = tokenizer.eos_token_id
    return Framing(tokenizer, tuple(start_ids(tokenizer)), stops=frozenset(() if eos is None else (eos,)))


def chat(tokenizer: PreTrainedTokenizerBase) -> Framing:
    """The tokenizer's chat template; ``ValueError`` naming the fix for a tokenizer without one or
    a template that renders a turn differently once another follows."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat-template: the tokenizer has no chat template: evaluate without --chat-template, or use a model that has one (an instruct model)")
    context, question, answer, following = MARKS

    def render(*contents: str) -> str:
        roles = ("user", "assistant") * len(contents)
        messages = [{"role": role, "content": content} for role, content in zip(roles, contents)]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    one, two = render(context + question), render(context + question, answer, following)
    head, _, rest = one.partition(context)
    between, found, second_reply = two[len(one) + len(answer) :].partition(following)
    if not (rest.startswith(question) and two.startswith(one + answer) and found and second_reply == rest[len(question) :]):
        raise ValueError(
            "--chat-template: the tokenizer's chat template renders a turn differently once another follows "
            "(it rewrites earlier messages), so a conversation cannot be fed turn by turn: evaluate without --chat-template"
        )
    frame = Framing(tokenizer, (), chat=True)
    between_ids = frame.encode(between)
    stops = {tokenizer.eos_token_id} - {None}
    if between_ids and between_ids[0] in tokenizer.all_special_ids:  # the token that closes a message
        stops.add(between_ids[0])
    return Framing(
        tokenizer, tuple(frame.encode(head)), tuple(frame.encode(JOINER)), tuple(between_ids),
        tuple(frame.encode(rest[len(question) :])), frozenset(stops), chat=True,
    )


def framing_for(tokenizer: PreTrainedTokenizerBase, chat_template: bool) -> Framing:
    """The chat template's framing with ``chat_template``, plain text without."""
    return chat(tokenizer) if chat_template else plain(tokenizer)
