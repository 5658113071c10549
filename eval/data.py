"""Text to evaluate on: the embedded CPython reference manual, Hub datasets, or a local file."""

from __future__ import annotations

import platform

import torch
from transformers import PreTrainedTokenizerBase

EMBEDDED_TEXT = "pydoc"


def embedded_text() -> str:
    """CPython's reference manual (``pydoc_data.topics``), in a fixed topic order.

    It ships with every CPython, so it needs no download; it differs between Python
    versions, so results record :func:`embedded_text_version`.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def embedded_text_version() -> str:
    return f"pydoc_data.topics (CPython {platform.python_version()})"


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str, count: int | None = None) -> torch.Tensor:
    """``[1, count]`` token ids of ``text`` (all of it when ``count`` is None)."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if count is not None:
        if ids.shape[1] < count:
            raise ValueError(f"the text has {ids.shape[1]} tokens, fewer than the {count} asked for")
        ids = ids[:, :count]
    return ids
