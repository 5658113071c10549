"""What a tokenizer sets before a text of its own accord (``add_special_tokens=True``)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def start_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids ``tokenizer(text)`` sets before the text: a BOS for Gemma, Llama 3 or Mistral,
    none for SmolLM2.

    A model trained with a BOS degrades without one (Gemma 3 270M reads the embedded text at a
    perplexity of 87.9 without its BOS, 18.0 with it), so the evaluation harness opens every model
    input with these ids; they are no part of the text, so KVzip's reconstruction does not replay them.
    """
    probe = "a"
    special, plain = tokenizer(probe).input_ids, tokenizer(probe, add_special_tokens=False).input_ids
    for start in range(len(special) - len(plain) + 1):
        if special[start : start + len(plain)] == plain:
            return list(special[:start])
    return []
