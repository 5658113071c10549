"""What the prompted tasks share about ``--chat-template``: the framing of their cases, made once
per process, and the param it adds to their records (only when set, so that plain-text records
keep their identity)."""

from __future__ import annotations

from ..dialogue import Framing, framing_for
from ..settings import Settings
from .base import Bench


def framing(bench: Bench) -> Framing:
    """The chat template's framing under ``--chat-template``, plain text otherwise (``ValueError``
    for a tokenizer whose template cannot frame a conversation)."""
    return bench.cached(("framing", bench.settings.chat_template), lambda: framing_for(bench.tokenizer, bench.settings.chat_template))


def chat_params(settings: Settings) -> dict:
    """``{"chat_template": True}`` under ``--chat-template``: a setting of its own."""
    return {"chat_template": True} if settings.chat_template else {}
