"""The sweep's options and their defaults: what ``hf-kvpolicies eval`` runs when told nothing.

The default policies, budgets and tasks are here and nowhere else; the CLI's help, the docs'
default run and the tests read them from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_kvpolicies import available_policies
from hf_kvpolicies.models import DEFAULT_MODEL

from .data import EMBEDDED_TEXT
from .protocols import DEFAULT_PROTOCOLS

DEFAULT_POLICIES = ("full", "window", "sink:positions=absolute", "h2o", "fp8", "full:storage=int4", "full:storage=int2")
"""The full cache in native, FP8, int4 and int2 storage, and one of each bounded family, swept
over ``--budgets`` (each class maps a budget onto its parameters); bare specs, so the sweep gives
them their budgets. A policy that the
library does not register is skipped with a note (:func:`default_policies`).

The sinks keep absolute positions: within the model's trained context that is the StreamingLLM
layout, and chunked feeding is exact for it (``positions=cache`` re-rotates, and streams token by token).
"""
DEFAULT_BUDGETS = (64, 128)
DEFAULT_TASKS = ("perplexity", "memory", "niah_single", "niah_multikey", "passkey")
"""Recall tasks the embedded model answers with a full cache at 512 tokens (measured: niah_single
0.67, niah_multikey 1.00 over depths 0.1/0.5/0.9); variable tracking scored 0.07 there, which
would measure the model rather than the policies, so it is left to the frontier command. ``speed``
(``--task speed``) is left out to keep the default run within 10 minutes on 2 CPU cores."""


class UsageError(ValueError):
    """Bad input: the CLI prints the message on one line and exits with status 2."""


@dataclass
class Settings:
    """Everything a sweep needs besides its policies and tasks (the CLI's options)."""

    model: str = DEFAULT_MODEL
    gguf_file: str | None = None
    dataset: str = EMBEDDED_TEXT
    text_file: str | None = None
    tokens: int = 512
    chunk_size: int | None = None
    contexts: tuple[int, ...] = (512, 2048)
    steps: int = 16
    lengths: tuple[int, ...] = (512,)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    seeds: tuple[int, ...] = (0,)
    protocol: tuple[str, ...] = DEFAULT_PROTOCOLS
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    ratios: tuple[float, ...] = ()
    qa_samples: int = 20
    qa_max_tokens: int = 2048
    chat_template: bool = False
    """Whether recall and QA prompts are wrapped in the tokenizer's chat template, turn by turn."""
    device: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None
    attn_implementation: str | None = None
    out: Path = Path("results")
    progress: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    """The options that registered tasks add to the command line (:meth:`Task.add_arguments`), by
    their ``dest``."""


def default_policies(note: Callable[[str], None]) -> list[str]:
    """The default set, less the policies that are not registered (one note each)."""
    registered = set(available_policies())
    chosen = []
    for spec in DEFAULT_POLICIES:
        if spec.partition(":")[0] in registered:
            chosen.append(spec)
        else:
            note(f"note: skipping default policy {spec!r}: no policy {spec.partition(':')[0]!r} is registered")
    return chosen
