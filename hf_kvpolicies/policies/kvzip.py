"""KVzip's statistic (Kim et al., 2025): the largest attention a token receives.

A prompt's tokens are scored by the context reconstruction (:mod:`hf_kvpolicies.reconstruction`),
which the cache runs once its first forward has ended (:class:`~hf_kvpolicies.policies.kvzip.KVzipCache`);
that forward's own attention is not scored. Every prompt token competes by its reconstruction
score, the prompt's last tokens included, as the paper and kvpress rank them. From then on,
every query that attends to a kept token (each decode step, each later chunk) may raise its
score: a score is the maximum over the reconstruction's queries and every later one, over the
query heads of its KV head. Of the tokens after the prompt, the ``recent`` newest are never
evicted, so a decoded token is scored by ``recent`` queries before it competes with the context
(unprotected, each answer token would be evicted as it is written: its score starts at zero).
Each row's first ``sinks`` tokens are kept in every head, as the paper's code keeps the prompt's
system prefix and kvpress its first 4 tokens: they hold the attention sink, which layers whose
reconstruction attends elsewhere would otherwise evict. They win their places by their score
(:data:`SINK_SCORE`), so an adaptive layer budget counts them as tokens its heads won.
Slots, eviction and trims are :class:`~hf_kvpolicies.retention.scored.ScoredRetention`'s.

The preset, :class:`KVzipCache`, builds it in every governed layer.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..attention_scores import max_attention
from ..reconstruction import DEFAULT_CHUNK, RepeatPrompt, check_reconstructable, reconstruction_scores
from ..retention.layer_budgets import busiest_head_budgets
from ..retention.scored import ScoredRetention
from ..retention.scoring import Attended, out_for
from ..storage import StorageFactory
from ..validation import check_int
from .scored import HeadBudgets, LayerBudgets, ScoredCache


SINK_SCORE = 2.0
"""A sink's score: above every attention probability (at most 1), so a sink ranks first at the
trim and its running maximum never falls below any other token's, so decoding never evicts it."""


class KVzipRetention(ScoredRetention):
    """Reconstruction scores for the prompt, then the running maximum of the attention received."""

    def __init__(self, budget: int, recent: int, sinks: int = 0, **options) -> None:
        super().__init__(budget=budget, protected=recent, **options)
        self.sinks = sinks
        self.awaiting_reconstruction = True
        """True until the cache has written the first forward's reconstruction scores."""

    def computes_attention(self) -> bool:
        return not self.awaiting_reconstruction

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.awaiting_reconstruction:
            return scores  # the first forward's scores come from the reconstruction that follows it
        received = max_attention(
            seen.query, seen.keys, seen.scaling, seen.first_new, None, seen.key_mask, seen.query_mask, seen.values, seen.output
        )
        return torch.maximum(scores, received, out=out_for(scores))

    def take_reconstruction(self, scores: torch.Tensor) -> None:
        """The first forward's scores ``[batch, kv_heads, tokens]``, from the cache's reconstruction."""
        self.awaiting_reconstruction = False
        self.waiting = self.pending is not None  # a prompt over the budget waits for its trim; later forwards do not wait
        self.protected_from = self.seen  # the prompt's tokens rank by these scores alone
        if self.sinks:
            positions = self.positions[..., : self.live] if self.pending is None else self.pending.positions
            real = positions >= 0  # in order, pads first: a row's first real tokens are its sinks
            scores = scores.masked_fill(real & (real.cumsum(dim=-1) <= self.sinks), SINK_SCORE)
        if self.pending is not None:  # over budget: the trim that follows ranks by them
            self.pending.scores = scores
            return
        self.scores[..., : self.live] = scores  # the prompt fits: stored in order, one slot per token
        if self.has_free:  # it filled budget + 1 slots: the slot to free is chosen again, now by score
            self.free = self.next_free(self.positions, self.scores)

    def reset(self) -> None:
        super().reset()
        self.awaiting_reconstruction = True


class KVzipCache(ScoredCache):
    """KVzip (Kim et al., 2025) inside an unmodified ``model.generate()``.

    When the first forward (the prompt) has ended, the model is made to repeat it (the paper's
    repeat instruction, the tokenizer's answer opening, then the prompt, ``replay_chunk`` tokens per
    forward) over the prompt's keys, and each prompt token is scored by the largest attention it
    receives from those queries (:mod:`hf_kvpolicies.reconstruction`). Each layer then keeps
    the best-scoring prompt tokens, the prompt's last ones competing like the rest (as the paper
    and kvpress rank them): ``heads x budget`` in all, shared among its KV heads by their scores
    (``head_budgets="adaptive"``, the paper's head-level ranking: one head may keep 500 tokens,
    another 30), held in one pooled storage
    row of ``heads x (budget + 1)`` slots (:mod:`~hf_kvpolicies.retention.pooled_heads`); the
    rest is freed. ``head_budgets="uniform"`` keeps ``budget`` per head instead (and compiles).
    ``layer_budgets="adaptive"`` (the paper's choice) lets the tokens of every layer and head
    compete for the total, raw, each layer sized for what its heads won;
    ``"uniform"`` gives every layer ``budget`` per head, ``"pyramid"`` more to lower layers.

    Decoding then evicts one token per row and head per step (with pooled heads, the ``heads``
    lowest-scoring tokens of the layer, whichever heads hold them): a kept token's score can only grow
    with the attention later queries give it (the maximum, as for the reconstruction), and a token
    after the prompt is never evicted while among the ``recent`` newest (each layer's budget
    keeps room for them). Each row's first ``sinks`` tokens are kept in every head (the attention
    sink; the paper's code keeps the system prefix, kvpress the first 4 tokens). The prompt costs a second pass
    (about 2-3x the prefill's work, once per prompt); decode steps cost what H2O's do.

    The repeat prompt is written with ``tokenizer`` (default: the one saved with the model). The
    prompt must come as ``input_ids``. Left-padded batches give each row what it keeps alone;
    beams reorder the scores. Models with sliding-window layers, and attention whose queries
    cannot be read, are refused at construction.
    """

    waits_for_cache = True
    """The first forward waits for its reconstruction scores, fitting the budget or not."""
    adaptive_rule = staticmethod(busiest_head_budgets)
    """KVzip ranks raw reconstruction scores of every layer and head together; a layer is sized
    for what its heads won together (pooled heads), or for the head that wins most (uniform heads)."""

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """A budget of ``budget`` tokens: at most half of it (8 at most) the recent window of decoded
        tokens, at most a quarter (4 at most) the sinks."""
        return {"budget": budget, "recent": min(8, budget // 2), "sinks": min(4, budget // 4)}

    def __init__(
        self,
        model: PreTrainedModel,
        budget: int = 1024,
        recent: int = 8,
        sinks: int = 4,
        layer_budgets: LayerBudgets = "adaptive",
        head_budgets: HeadBudgets = "adaptive",
        chunk: int = 1,
        replay_chunk: int = DEFAULT_CHUNK,
        tokenizer: PreTrainedTokenizerBase | str | None = None,
        storage: str | StorageFactory = "native",
    ) -> None:
        check_int("budget", budget, 1)
        check_int("recent", recent, 0)
        check_int("sinks", sinks, 0)
        check_int("replay_chunk", replay_chunk, 1)
        if recent + sinks >= budget:
            raise ValueError(
                f"recent={recent} plus sinks={sinks} must be below budget={budget}: the budget holds the recent "
                "window of decoded tokens, the sinks and the best-scoring prompt tokens; lower recent or sinks, "
                "or raise budget"
            )
        check_reconstructable(model)
        self.prompt = RepeatPrompt.from_tokenizer(resolve_tokenizer(model, tokenizer))
        self.replay_chunk = replay_chunk
        self._model = model
        self.context_ids: torch.Tensor | None = None
        """The first forward's ``input_ids`` (seen by :meth:`before_forward`), until its reconstruction."""
        self.reconstructed = False
        super().__init__(
            model, lambda **options: KVzipRetention(budget, recent, sinks, **options),
            layer_budgets=layer_budgets, storage=storage, head_budgets=head_budgets, chunk=chunk,
        )

    def before_forward(self, token: str, inputs: torch.Tensor, attention_mask: Any, config, dtype: torch.dtype) -> Any:
        """The first forward's token ids are the context the reconstruction repeats."""
        mask = super().before_forward(token, inputs, attention_mask, config, dtype)
        if not self.reconstructed and self.get_seq_length() == 0:
            if inputs.is_floating_point():
                raise ValueError(
                    "KVzipCache reconstructs the prompt from its token ids: call the model with input_ids, not inputs_embeds"
                )
            self.context_ids = inputs
        return mask

    def finish_prefill(self) -> None:
        """After the first forward, score its tokens by their reconstruction; then trim as usual."""
        if not self.reconstructed and self.context_ids is not None:
            self.reconstructed = True
            self._score_by_reconstruction()
        super().finish_prefill()

    def _score_by_reconstruction(self) -> None:
        layers = [(layer.retention, layer.storage) for layer in self.layers]
        held = []
        for retention, storage in layers:
            if retention.pending is not None:  # the prompt exceeded the budget: everything is pending
                held.append((retention.pending.keys, retention.pending.values, retention.pending.positions))
            else:  # the prompt fits: stored in order, one slot per position
                keys, values = storage.read(retention.live)
                held.append((keys, values, retention.positions[..., : retention.live]))
        padding = held[0][2][:, 0] >= 0
        scores = reconstruction_scores(
            self._model, [(keys, values) for keys, values, _ in held], self.context_ids, self.prompt, padding, self.replay_chunk
        )
        self.context_ids = None
        for (retention, _), score in zip(layers, scores):
            retention.take_reconstruction(score)

    def reset(self) -> None:
        super().reset()
        self.context_ids, self.reconstructed = None, False


def resolve_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | str | None) -> PreTrainedTokenizerBase:
    """The tokenizer to write the repeat prompt with: the one given, one loaded by name or path
    (as ``AutoTokenizer.from_pretrained`` takes it), or the one saved beside the model's weights."""
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise ValueError(
            f"KVzipCache takes tokenizer= as a transformers tokenizer or a name or path AutoTokenizer loads, "
            f"not {type(tokenizer).__name__}: pass tokenizer=AutoTokenizer.from_pretrained(...)"
        )
    source = tokenizer if tokenizer is not None else getattr(model.config, "name_or_path", "") or ""
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as error:
        where = f"tokenizer={source!r}" if tokenizer is not None else f"model.config.name_or_path={source!r}"
        raise ValueError(
            f"KVzipCache writes its repeat prompt with the model's tokenizer, and none loads from {where} "
            f"({type(error).__name__}): pass tokenizer= a tokenizer object, or a Hub id or local folder that has one"
        ) from None
