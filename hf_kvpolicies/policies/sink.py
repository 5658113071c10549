"""SinkCache: StreamingLLM's attention sinks plus a sliding window (Xiao et al., ICLR 2024)."""

from __future__ import annotations

from typing import Literal

from transformers import PreTrainedModel

from ..cache import PolicyCache
from ..model_layout import LayerLayout
from ..retention import RingRetention
from ..retention.sink import SharedRotation, SinkRetention
from ..rope import Rotary, rotary_of
from ..storage import StorageFactory
from ..validation import check_choice, check_int

POSITIONS = ("cache", "absolute")


class SinkCache(PolicyCache):
    """Each layer keeps the first ``sink_tokens`` tokens and the ``window`` most recent ones.

    Decoding: a new token attends to the ``sink_tokens + window`` stored tokens and itself; the
    ring of ``sink_tokens + window + 1`` slots is written in place, so a step costs O(1) in the
    window and memory stays constant once the budget is reached. A prompt longer than the
    budget is prefilled with ordinary causal attention over the whole prompt and trimmed
    afterwards (token-by-token streaming would let each prompt token see only the sinks and the
    ``window`` before it). ``get_seq_length()`` counts every token seen, so positions stay absolute.

    ``positions``:

    * ``"cache"`` (default, the paper's §3.2): distances are measured inside the cache, so a sink
      sits just before the oldest window token and a stream can run far past the trained context.
      The sink keys are re-rotated with the model's own RoPE by the number of evicted tokens,
      O(sink_tokens) per step. Needs RoPE whose frequencies do not depend on the length:
      dynamic NTK, LongRoPE and models without RoPE get a ``ValueError``.
    * ``"absolute"``: keys keep the rotation the model gave them (sinks sit at their true,
      ever more distant, positions); works for every model.

    Padded batches: the sinks are each row's first ``sink_tokens`` *real* tokens (after its left
    padding), so every row keeps and sees exactly what it would alone.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        sink_tokens: int = 4,
        window: int = 1020,
        positions: Literal["cache", "absolute"] = "cache",
        storage: str | StorageFactory = "native",
    ) -> None:
        sink_tokens = check_int("sink_tokens", sink_tokens, minimum=0)
        window = check_int("window", window, minimum=1)
        check_choice("positions", positions, POSITIONS)
        self.sink_tokens, self.window, self.positions = sink_tokens, window, positions
        rotaries: dict[str, Rotary] = {}  # one per layer type
        shared: dict[str, SharedRotation] = {}  # one per layer type: a step's cos/sin is computed once

        def retention(layout: LayerLayout) -> RingRetention:
            if sink_tokens == 0:
                return RingRetention(window)  # nothing to pin or re-rotate
            rotary = None
            if positions == "cache":
                if layout.layer_type not in rotaries:
                    rotaries[layout.layer_type] = rotary_of(model, layout.layer_type)
                rotary = rotaries[layout.layer_type]
            return SinkRetention(window, sink_tokens, rotary, shared.setdefault(layout.layer_type, SharedRotation()))

        super().__init__(model, retention, storage=storage)

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """Four sinks (the paper's) and the rest of ``budget`` as the window; fewer sinks below 8 tokens."""
        sinks = min(4, budget // 2)
        return {"sink_tokens": sinks, "window": budget - sinks}
