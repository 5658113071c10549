"""Asking cases their questions under a protocol: what the recall and QA tasks and the
shared-context benchmark share.

A case is a context and its turns (:class:`~eval.dialogue.Turn`: question ids and expected
strings). A protocol that shares the context (``multiturn``, ``multiquery``) gets all of a case's
questions at once; any other asks each question on its own, with the context before it. Cases
whose ids are of equal lengths share forwards (a batch gives each row what it gets alone), at most
``batch`` rows, one for a protocol whose rows part (:attr:`~eval.protocols.Protocol.lockstep`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol as Interface

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .dialogue import Framing, Turn
from .protocols import Answers, CacheFactory, Protocol


class Case(Interface):
    """What :func:`ask` reads of a case (a recall case, a QA case)."""

    @property
    def context_ids(self) -> torch.Tensor: ...
    @property
    def turns(self) -> tuple[Turn, ...]: ...
    @property
    def answer_tokens(self) -> int: ...


@dataclass(frozen=True)
class Asked:
    """One question answered: the case's index, the turn's (from 0), the answer, and the
    :class:`Answers` of the batch it came from (the cache's state)."""

    case: int
    turn: int
    text: str
    answers: Answers


def ask(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cases: Sequence[Case],
    protocol: Protocol,
    make_cache: CacheFactory,
    framing: Framing,
    chunk: int = 1,
    batch: int = 16,
) -> list[Asked]:
    """Every question of every case answered under ``protocol``, in case then turn order."""
    groups: dict[tuple, list[tuple[int, tuple[int, ...]]]] = {}
    for index, case in enumerate(cases):
        every = tuple(range(len(case.turns)))
        for turns in [every] if protocol.shares_context else [(turn,) for turn in every]:
            lengths = [case.turns[turn].question_ids.shape[1] for turn in turns]
            context = case.context_ids.shape[1]
            key = (context + lengths[0],) if protocol.whole_prompt else (context, *lengths)
            groups.setdefault(key, []).append((index, turns))
    size = batch if protocol.lockstep else 1
    found = []
    for group in groups.values():
        for at in range(0, len(group), size):
            rows = group[at : at + size]
            if protocol.whole_prompt:  # context and question as one prompt: prompts of equal lengths batch together
                context = torch.cat([torch.cat([cases[index].context_ids, cases[index].turns[turn].question_ids], dim=1) for index, (turn,) in rows])
                questions = [context[:, :0]]
            else:
                context = torch.cat([cases[index].context_ids for index, _ in rows])
                questions = [torch.cat([cases[index].turns[turns[k]].question_ids for index, turns in rows]) for k in range(len(rows[0][1]))]
            new_tokens = max(cases[index].answer_tokens for index, _ in rows)
            outs = protocol.answer(model, tokenizer, context, questions, make_cache, new_tokens, chunk, framing)
            for k, out in enumerate(outs):
                found += [Asked(index, turns[k], text, out) for (index, turns), text in zip(rows, out.texts)]
    return sorted(found, key=lambda asked: (asked.case, asked.turn))
