"""ScoredCache: the cache side of every score-based eviction policy (H2O, SnapKV, TOVA, KNorm, ...).

It builds one :class:`~hf_kvpolicies.retention.scored.ScoredRetention` per governed layer, installs
the hooks the statistic needs (the query hooks of :mod:`hf_kvpolicies.attention_scores` when it
reads queries; the finishing hook always), and shares the budget among layers
(``layer_budgets``: ``"uniform"``, ``"pyramid"`` or ``"adaptive"``) and, within a layer, among
its KV heads (``head_budgets``: ``"uniform"``, every head ``budget`` tokens, or ``"adaptive"``,
the heads' tokens competing for ``heads x budget``, held in pooled storage:
:mod:`~hf_kvpolicies.retention.pooled_heads`). ``chunk`` > 1 keeps and evicts whole chunks of
neighbouring positions (ChunkKV: :mod:`~hf_kvpolicies.retention.chunks`), whatever the statistic.

**Finishing a forward.** After each forward the model's dispatcher (:mod:`hf_kvpolicies.hooks`)
calls ``after_forward``, which calls :meth:`ScoredCache.finish_prefill`. Layers whose
retention deferred its trim (adaptive budgets need every layer's scores first) hold a
:class:`~hf_kvpolicies.retention.scored.Pending` then; ``finish_prefill`` calls
:meth:`ScoredCache.rescore` with them (a subclass, e.g. KVzip, may run a reconstruction pass over
``pending.keys``/``pending.values`` and replace ``pending.scores``), decides the layer budgets and
trims every layer. Setting ``defer_every_prefill = True`` in a subclass makes every over-budget
forward wait for it, not only the first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from transformers import PreTrainedModel

from ..cache import PolicyCache
from ..hooks import check_attention_implementation
from ..masks import MASK_FORMATS
from ..model_layout import layer_layouts
from ..retention.layer_budgets import adaptive_budgets, budgets_by_row, pyramid_budgets
from ..retention.head_layouts import HEAD_LAYOUTS
from ..retention.scored import ScoredRetention
from ..retention.scoring import Pending
from ..storage import StorageFactory
from ..validation import check_choice, check_int

LayerBudgets = Literal["uniform", "pyramid", "adaptive"]
LAYER_BUDGETS = ("uniform", "pyramid", "adaptive")
HeadBudgets = Literal["uniform", "adaptive"]


class ScoredCache(PolicyCache):
    """A :class:`PolicyCache` whose governed layers each hold a scored retention from
    ``retention(**options)``: the statistic's own arguments are the policy's, the options (the
    head layout, whether the first forward waits for the cache, the layer's budget share) the
    cache's, passed to every layer's retention at construction."""

    waits_for_cache = False
    """True in a subclass whose first forward needs the cache-level step whatever its budgets (KVzip)."""
    adaptive_rule = staticmethod(adaptive_budgets)
    """How ``layer_budgets="adaptive"`` shares the total (normalised scores of all layers compete;
    KVzip sizes layers by their busiest head instead: :func:`~hf_kvpolicies.retention.layer_budgets.busiest_head_budgets`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        retention: Callable[..., ScoredRetention],
        layer_budgets: LayerBudgets = "uniform",
        storage: str | StorageFactory = "native",
        head_budgets: HeadBudgets = "uniform",
        chunk: int = 1,
    ) -> None:
        try:
            check_choice("layer_budgets", layer_budgets, LAYER_BUDGETS)
        except ValueError as error:
            raise ValueError(f"{error}: write layer_budgets='uniform', 'pyramid' or 'adaptive'") from None
        try:
            check_choice("head_budgets", head_budgets, tuple(HEAD_LAYOUTS))
        except ValueError as error:
            raise ValueError(f"{error}: write head_budgets='uniform' or 'adaptive'") from None
        implementation = model.config._attn_implementation
        if head_budgets == "adaptive" and implementation not in MASK_FORMATS:
            raise ValueError(
                f"{type(self).__name__} with head_budgets='adaptive' shows each KV head its own tokens through a "
                f"per-head attention mask, which {implementation!r} attention does not take: call "
                "model.set_attn_implementation('sdpa') before building the cache, or use head_budgets='uniform'"
            )
        check_int("chunk", chunk, minimum=1)
        probe = retention()
        budget = probe.token_budget()
        if budget is not None and chunk > budget:
            raise ValueError(
                f"chunk={chunk} is larger than budget={budget}: a chunk is kept or evicted whole, so give "
                "chunk <= budget (chunk=1 ranks single tokens)"
            )
        needs_queries = probe.needs_queries
        if needs_queries and not probe.queries_before_rope:  # it computes attention probabilities beside the kernel
            check_attention_implementation(type(self).__name__, model.config._attn_implementation)
        governed = [layout.index for layout in layer_layouts(model) if not layout.is_sliding]

        def make(layout) -> ScoredRetention:
            share = None
            if layer_budgets == "pyramid":
                index, count = governed.index(layout.index), len(governed)
                share = lambda budget, protected: pyramid_budgets(budget, protected, count)[index]  # noqa: E731
            return retention(
                layout=HEAD_LAYOUTS[head_budgets],
                waits_for_cache=layer_budgets == "adaptive" or self.waits_for_cache,
                layer_budget=share,
                chunk=chunk,
            )

        self.layer_budgets, self.head_budgets, self.chunk = layer_budgets, head_budgets, chunk
        super().__init__(model, make, storage=storage)
        if needs_queries:
            self.dispatcher.serve_queries(model)  # raises ValueError for a model whose attention it cannot serve
        if layer_budgets != "uniform" or head_budgets == "adaptive":
            self.sizes_differ_by_layer = True
            self.dispatcher.serve_attention()  # layers then return different numbers of keys, or per-head ones

    budget_keys = ("budget",)
    """``budget`` sizes it; a protected window, sinks or a pooling width only shape it."""

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """A budget of ``budget`` kept tokens per layer (the protected ones included)."""
        return {"budget": budget}

    def scored_layers(self) -> list[ScoredRetention]:
        return [layer.retention for layer in self.layers if isinstance(layer.retention, ScoredRetention)]

    def rescore(self, pending: list[Pending]) -> None:
        """Replace the scores of the layers waiting for their trim (nothing by default; KVzip's pass)."""

    def after_forward(self) -> None:
        super().after_forward()
        self.finish_prefill()

    def finish_prefill(self) -> None:
        """Trim every layer that waits for the cache-level step (called after each forward)."""
        waiting = [layer for layer in self.layers if getattr(layer.retention, "pending", None) is not None]
        if not waiting:
            return
        retentions = [layer.retention for layer in waiting]
        self.rescore([retention.pending for retention in retentions])
        budgets: list = [retention.row_budgets or retention.budget for retention in retentions]
        if self.layer_budgets == "adaptive" and len(waiting) == len(self.scored_layers()):
            # per row, by layer: the budgets and protected tokens it resolved to, from its own tokens
            lengths = retentions[0].real_lengths()
            fitting = [[r.budget if r.row_budgets is None else r.row_budgets[row] for r in retentions] for row in range(len(lengths))]
            protected = [[r.protected if r.row_protected is None else int(r.row_protected[row]) for r in retentions] for row in range(len(lengths))]
            # a row whose tokens fit every layer (pending only because pooled heads always trim) keeps them
            over = [any(length > budget for budget in row) for length, row in zip(lengths, fitting)]
            if any(over):
                # at least the protected tokens, and whatever else the trim keeps unranked (sinks, an open chunk)
                anyway = [retention.kept_unranked() for retention in retentions]
                reserve = [[max(1, p, anyway[i][row]) for i, p in enumerate(row_p)] for row, row_p in enumerate(protected)]
                candidates = [retention.candidate_scores() for retention in retentions]
                budgets = budgets_by_row(self.adaptive_rule, candidates, reserve, fitting, over, self.head_budgets == "adaptive")
        for layer, budget in zip(waiting, budgets):
            layer.retention.finish(layer.storage, budget)
        for layer in self.layers:  # the trims (and rescoring) may have replaced the static state
            layer.enter_static_if_ready()

    @property
    def per_head_masks(self) -> bool:
        """Pooled heads show each head its own slots; rows with their own budgets leave slots unused."""
        return self.head_budgets == "adaptive" or any(r.row_budgets is not None for r in self.scored_layers())

    def static_layout(self) -> bool:
        """Pyramid and adaptive budgets give layers different sizes, and pooled heads show each head
        its own slots: in static steps each such layer's attention module gets its own mask, built
        on the device from the layer's state (:meth:`PolicyCache.layer_mask`), in a format sdpa and
        eager attention take."""
        uniform = self.layer_budgets == "uniform" and self.head_budgets == "uniform"
        return (uniform or self.attn_implementation in MASK_FORMATS) and super().static_layout()

    def layer_budget_sizes(self) -> list[int | None]:
        """Each scored layer's budget (``None`` until the first forward fixes it): the largest row's,
        where rows have their own (adaptive budgets: :meth:`row_layer_budgets`)."""
        return [retention.budget for retention in self.scored_layers()]

    def row_layer_budgets(self) -> list[list[int | None]]:
        """Per row, each scored layer's budget (adaptive budgets rank each row's layers apart)."""
        layers = self.scored_layers()
        rows = next((r.positions.shape[0] for r in layers if r.positions is not None), 1)
        return [[r.budget if r.row_budgets is None else r.row_budgets[row] for r in layers] for row in range(rows)]
