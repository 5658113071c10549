"""Long-range recall: a passkey hidden at a chosen depth of filler text (Mohtashami & Jaggi, 2023).

Generated offline and seeded: the passkey of each (length, depth) cell comes from the seed, so
the same seed gives the same prompts on every machine. The prompt is fed the way perplexity
is (streamed: a bounded cache forgets what streaming forgets, see :mod:`eval.stream`), then
the answer is decoded greedily one token at a time and scored by exact match of its first
number.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from .stream import feed

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will ask you about it afterwards.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
DIGITS = 5


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: torch.Tensor
    """``[1, length]`` token ids."""
    passkey: str
    depth: float
    needle_at: int
    """Token index where the needle sentence starts."""


def passkey_for(seed: int, length: int, depth: float) -> str:
    """The passkey of one cell: a function of the seed and the cell only."""
    rng = random.Random(f"passkey:{seed}:{length}:{depth:.6f}")
    return str(rng.randrange(10 ** (DIGITS - 1), 10**DIGITS))


def make_prompt(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int) -> PasskeyPrompt:
    """A prompt of exactly ``length`` tokens with the needle after ``depth`` of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be in [0, 1], got {depth}")
    passkey = passkey_for(seed, length, depth)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    intro, needle, question = encode(INTRO), encode(NEEDLE.format(key=passkey)), encode(QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    if room < 0:
        shortest = length - room
        raise ValueError(f"passkey length {length} is too short for the prompt: use at least {shortest} tokens")
    filler = encode(FILLER)
    filler = filler * (room // len(filler) + 1)
    before = round(room * depth)
    ids = intro + filler[:before] + needle + filler[: room - before] + question
    return PasskeyPrompt(torch.tensor([ids]), passkey, depth, len(intro) + before)


def first_number(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group() if match else None


def is_correct(answer: str, passkey: str) -> bool:
    """Exact match: the first number of the answer is the passkey, digit for digit."""
    return first_number(answer) == passkey


@torch.no_grad()
def answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[PasskeyPrompt], cache: Cache, chunk: int
) -> list[str]:
    """Stream equal-length prompts into ``cache`` as one batch, then decode greedily a few tokens
    more than a passkey needs; one answer per prompt.

    A batch costs what one prompt costs where forwards are overhead-bound (a small model on a
    CPU, token by token), which is what makes the streamed passkey affordable for every policy.
    """
    ids = torch.cat([prompt.ids for prompt in prompts])
    logits = None
    for _, _, logits in feed(model, ids, cache, chunk, every_logit=False):
        pass
    new_tokens = len(tokenizer(" " + prompts[0].passkey + ".", add_special_tokens=False).input_ids) + 2
    generated = []
    for _ in range(new_tokens):
        tokens = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(tokens)
        logits = model(tokens, cache=cache, use_cache=True).logits
    return tokenizer.batch_decode(torch.cat(generated, dim=1), skip_special_tokens=True)


def passkey_grid(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    make_cache: Callable[[], Cache],
    lengths: Sequence[int],
    depths: Sequence[float],
    seed: int,
    chunk: int,
    progress: bool = False,
    desc: str = "passkey",
) -> dict:
    """Every (length, depth) cell, a fresh cache per length (its depths in one batch): the
    accuracy and each cell's answer."""
    cells = []
    for length in tqdm(lengths, disable=not progress, desc=desc, leave=False, unit="length"):
        prompts = [make_prompt(tokenizer, length, depth, seed) for depth in depths]
        for prompt, text in zip(prompts, answers(model, tokenizer, prompts, make_cache(), chunk)):
            cells.append(
                {
                    "length": length,
                    "depth": prompt.depth,
                    "passkey": prompt.passkey,
                    "answer": text,
                    "correct": is_correct(text, prompt.passkey),
                }
            )
    return {"accuracy": sum(cell["correct"] for cell in cells) / len(cells), "cells": cells}
