"""Expected Attention's statistic (Devoto et al., 2025): the attention future queries are expected to pay.

No attention weights are read. Per layer and row, the statistic keeps the mean and covariance of
the queries before their rotation, ``q_norm(q_proj(x))`` (one per query head), and scores each key
by the softmax of the logit a query drawn from them would give it on average over the next
positions, times its value's norm (kvpress's ``ExpectedAttentionPress``; its ``epsilon`` is 0).

Definition, per layer, row, KV head and each query head ``h`` of its group:

* **Query statistics**: the mean ``mu_h`` and covariance ``S_h`` (divided by ``N``) of the queries of
  every real token the row has seen but its first ``sinks`` (kvpress leaves them out as outliers),
  kept as running sums (a mean and a centred second moment, each forward's merged in: Chan et
  al.'s update), so that no step holds past queries.
* **Window**: the ``n_future_positions`` positions ``a, ..., a + n - 1`` after the row's tokens
  seen (``a`` counts from the row's first real token: a left-padded row has the window it has
  alone); ``R`` is the mean over them of the model's rotation, ``s (diag(cos) + diag(sin) P)``
  (:meth:`~hf_kvpolicies.rope.Rotary.mean_rotation_transposed`, closed form). Which queries
  count and the window's rotation are the same in every layer: the first layer computes them in
  each forward and the others take them (:class:`~hf_kvpolicies.retention.step_share.StepShare`).
* **Expected logit** of a key ``k`` (as the model computed it, rotated at its position):
  ``z_h(k) = c (R mu_h) . k + c^2 / 2 k^T (R S_h R^T) k``, ``c`` the module's own ``scaling``
  (``1 / sqrt(head_dim)`` in Llama-like models, as kvpress writes it; Gemma's differs).
* **Score** of a kept key ``j`` that is not a sink: ``||v_j|| mean_h softmax(z_h)_j``, the softmax
  over the kept keys of its head that are not sinks (``use_vnorm=False``: no ``||v_j||``;
  ``use_covariance=False``: no ``S_h`` term). Each row's first ``sinks`` real tokens score
  ``+inf``: they stay (kvpress pads them with the largest score plus one).

**Decoding.** Each token's ``z_h`` is computed once, when it arrives, with the statistics after
its forward's queries and the window after its forward, and kept per slot (``[kv_heads, group]``
floats per token, beside its value's norm); every step redoes the softmax over the kept keys,
the mean over the group and the value-norm scaling. At a prefill this is kvpress's score exactly;
later tokens are scored with the statistics of the moment they arrive, which recomputing every
kept key's ``z`` at every step (``O(slots x head_dim^2)`` per head) would only refresh. A step
costs one query's outer product (the covariance), one key's quadratic form per query head, and a
softmax over the slots: no attention probabilities, so any attention kernel serves it (padded
batches need ``sdpa`` or ``eager`` for their exact mask).

The statistics cost ``heads x head_dim^2`` fp32 per layer and row (``state_nbytes`` counts them):
on Llama-3-8B (32 query heads of 128) 2 MiB per layer, the bf16 keys and values of 512 tokens.

The preset, :class:`ExpectedAttentionCache`, builds it in every governed layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..model_layout import text_config
from ..rope import Rotary, rotary_of
from ..retention.scored import ScoredRetention
from ..retention.scoring import Attended, out_for
from ..retention.step_share import StepShare
from ..storage import Storage, StorageFactory
from ..validation import check_int
from .scored import HeadBudgets, LayerBudgets, ScoredCache

HIDDEN = torch.finfo(torch.float32).min
"""The logit of a key no softmax counts (a sink, a pad, an empty slot): the lowest finite one, so
that a head holding only such keys gives uniform weights rather than NaN."""


@dataclass(frozen=True)
class Arrivals:
    """What one forward's queries bring to every layer's statistics alike (the layer's queries aside)."""

    weight: torch.Tensor
    """``[batch, q]`` 1 for a query the statistics count."""
    arrived: torch.Tensor
    """``[batch]`` the queries counted."""
    total: torch.Tensor
    """``[batch]`` the queries counted once they are merged in."""
    share: torch.Tensor
    """``[batch, 1, 1]`` the new queries' share of the merged count."""
    carried: torch.Tensor
    """``[batch, 1, 1]`` the earlier count times ``share``: the weight of the means' shift in the moment."""
    spread: torch.Tensor
    """``[batch, 1, 1, 1, 1]`` ``scaling**2 / (2 total)``: the covariance term's factor."""
    turn: tuple[torch.Tensor, torch.Tensor]
    """The window's mean rotation (:meth:`~hf_kvpolicies.rope.Rotary.mean_turn`)."""
    scaling: float
    """The attention modules' ``scaling``."""


class ExpectedAttentionRetention(ScoredRetention):
    """Expected attention of the coming queries, from running query statistics, per (row, KV head)."""

    queries_before_rope = True
    sets_new_state = True  # the new key's logits and value norm are written, every score taken anew

    def __init__(
        self,
        budget: int,
        rotary: Rotary,
        groups: int,
        n_future_positions: int,
        sinks: int,
        use_covariance: bool,
        use_vnorm: bool,
        share: StepShare | None = None,
        **options,
    ) -> None:
        """``share``: the per-forward values shared with the cache's other layers."""
        super().__init__(budget, protected=0, **options)
        self.share = share or StepShare()
        self.rotary, self.groups, self.future = rotary, groups, n_future_positions
        self.sinks, self.use_covariance, self.use_vnorm = sinks, use_covariance, use_vnorm
        self.count: torch.Tensor | None = None
        """``[batch]`` queries counted in the statistics (a row's first ``sinks`` and pads are not)."""
        self.mean: torch.Tensor | None = None
        """``[batch, query_heads, head_dim]`` their mean."""
        self.moment: torch.Tensor | None = None
        """``[batch, query_heads, head_dim, head_dim]`` the sum of their centred outer products."""
        self.held_sinks: torch.Tensor | None = None
        """``[batch, kv_heads, slots]`` where the sinks are, while static steps run after every row
        has seen its sinks: a sink is never evicted and no token is written over it, so its slot
        and its hidden logits hold until the steps end (``None`` otherwise)."""

    def extra_state(self, batch: int, heads: int, slots: int, device: torch.device) -> dict[str, torch.Tensor]:
        state = {"expected_logits": torch.zeros(batch, heads, self.groups, slots, device=device)}
        if self.use_vnorm:
            state["value_norm"] = torch.zeros(batch, heads, slots, device=device)
        return state

    def score(self, seen: Attended, scores: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.count is None:
            batch, heads, _, dim = seen.query.shape
            self.count = seen.query.new_zeros(batch, dtype=torch.float32)
            self.mean = seen.query.new_zeros(batch, heads, dim, dtype=torch.float32)
            self.moment = seen.query.new_zeros(batch, heads, dim, dim, dtype=torch.float32) if self.use_covariance else None
        static = isinstance(seen.first_position, torch.Tensor)
        key = (None if static else seen.first_position, seen.q, seen.keys.shape[0], seen.scaling)
        arrivals = self.share.take(self, key, lambda: self._arrivals(seen))
        self._observe(seen.query, arrivals)
        seen.write_new(extra["expected_logits"], self._expected_logits(seen.new_keys, arrivals))
        if self.use_vnorm:
            seen.write_new(extra["value_norm"], seen.new_values.float().norm(dim=-1))
        return self._expected_attention(extra, seen.positions, seen.key_mask, out_for(scores))

    def _arrivals(self, seen: Attended) -> Arrivals:
        """What a forward's new queries bring, the same in every layer (:class:`StepShare`): which
        count (a real token past the row's first ``sinks``), the merged counts (every layer's
        statistics have counted the same queries) and the window's mean rotation."""
        if isinstance(seen.first_position, torch.Tensor):  # a static step: one token, real in every row
            positions = seen.first_position.view(1, 1)
        else:
            positions = seen.new_positions()[:, 0]  # [batch, q], -1 for pads
        relative = positions - self.row_start[:, 0]
        counted = relative >= self.sinks
        if positions.shape[-1] > 1:  # a decoded token is real in every row; a prompt may hold pads
            counted &= positions >= 0
        weight = counted.float()
        arrived = weight[:, 0] if seen.q == 1 else weight.sum(dim=-1)
        total = self.count + arrived
        share = (arrived / total.clamp(min=1))[:, None, None]  # of the merged count, the new queries' share
        spread = total.clamp(min=1).reciprocal().mul_(seen.scaling**2 / 2)[:, None, None, None, None]
        carried = self.count[:, None, None] * share
        turn = self.rotary.mean_turn(relative[:, -1] + 1, self.future)
        return Arrivals(weight, arrived, total, share, carried, spread, turn, seen.scaling)

    def _observe(self, query: torch.Tensor, arrivals: Arrivals) -> None:
        """Merge this forward's counted queries (``[batch, heads, q, dim]``) into the running
        statistics, in place (static steps hold their addresses)."""
        query = query.float()
        if query.shape[-2] == 1:  # one query: its own mean, no spread of its own
            mean = query[:, :, 0]
        else:
            weight = arrivals.weight
            mean = torch.einsum("bq,bhqd->bhd", weight, query) / arrivals.arrived.clamp(min=1)[:, None, None]
            centred = query - mean[:, :, None]
            if self.use_covariance:
                self.moment.add_(torch.matmul(centred.transpose(-1, -2), centred * weight[:, None, :, None]))
        delta = mean - self.mean
        self.mean.addcmul_(delta, arrivals.share)
        if self.use_covariance:  # + delta delta^T n_old n_new / n
            self.moment.addcmul_((delta * arrivals.carried)[..., :, None], delta[..., None, :])
        self.count.copy_(arrivals.total)

    def _expected_logits(self, keys: torch.Tensor, arrivals: Arrivals) -> torch.Tensor:
        """``[batch, kv_heads, groups, q]`` expected logits of ``keys`` ``[batch, kv_heads, q, dim]``
        under the statistics, rotated on average over each row's window."""
        batch, kv_heads, q, dim = keys.shape
        scaling = arrivals.scaling
        turned = self.rotary.turn_back(keys, arrivals.turn).transpose(-1, -2)  # R^T k, [.., dim, q]
        if not self.use_covariance:
            return torch.matmul(self.mean.view(batch, kv_heads, self.groups, dim), turned).mul_(scaling)
        # c mu . k' + c^2 / 2 k'^T S k' = k' . (c mu + c^2 / (2 N) M k'), k' = R^T k, S = M / N
        moved = torch.bmm(self.moment.view(batch * kv_heads, self.groups * dim, dim), turned.reshape(batch * kv_heads, dim, q))
        pull = torch.addcmul((self.mean * scaling).view(batch, kv_heads, self.groups, dim, 1), moved.view(batch, kv_heads, self.groups, dim, q), arrivals.spread)
        return (pull * turned[:, :, None]).sum(dim=-2)

    def _expected_attention(
        self, extra: dict[str, torch.Tensor], positions: torch.Tensor, key_mask: torch.Tensor | None, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The scores of every key seen: the softmax of the kept expected logits over the keys that are
        no sinks, averaged over the group, times the value norms; sinks ``+inf`` (in ``out`` where given)."""
        logits = extra["expected_logits"]
        sink = hidden = None
        if key_mask is None and self.held_sinks is not None:  # their logits were hidden when the steps began
            return self._weighted(logits, extra, out).masked_fill_(self.held_sinks, float("inf"))
        if self.sinks:
            sink = self._sink_slots(positions)  # pads and empty slots too, where key_mask hides them
            hidden, sink = (sink, sink) if key_mask is None else (sink | ~key_mask, sink & key_mask)
        elif key_mask is not None:
            hidden = ~key_mask
        if hidden is not None:
            logits = logits.masked_fill(hidden[:, :, None], HIDDEN)
        weights = self._weighted(logits, extra, out)
        return weights if sink is None else weights.masked_fill_(sink, float("inf"))

    def _sink_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Where ``positions`` are among their row's first ``sinks`` (an empty slot's ``-1`` too)."""
        return positions - self.row_start < self.sinks

    def _weighted(self, logits: torch.Tensor, extra: dict[str, torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        """The softmax of ``logits`` over the slots, averaged over the group, times the value norms."""
        weights = torch.mean(torch.softmax(logits, dim=-1), dim=2, out=out)
        return weights.mul_(extra["value_norm"]) if self.use_vnorm else weights

    # --- the statistics are per row: they follow the rows, and static steps update them in place ---
    @property
    def state_nbytes(self) -> int:
        statistics = [t for t in (self.count, self.mean, self.moment) if t is not None]
        return super().state_nbytes + sum(t.nbytes for t in statistics)

    def reorder(self, batch_index: torch.Tensor) -> None:
        super().reorder(batch_index)
        batch_index = batch_index.to(self.count.device)
        self.count, self.mean = self.count.index_select(0, batch_index), self.mean.index_select(0, batch_index)
        if self.moment is not None:
            self.moment = self.moment.index_select(0, batch_index)
        if self.held_sinks is not None:
            self.held_sinks = self.held_sinks.index_select(0, batch_index)

    def reset(self) -> None:
        super().reset()
        self.count = self.mean = self.moment = self.held_sinks = None

    def _enter_static(self, storage: Storage) -> list[torch.Tensor]:
        """Also, where every row has seen its sinks (static steps run on unpadded rows, so every
        row has seen ``seen`` tokens), where they are, their logits hidden once for every step."""
        statistics = [t for t in (self.count, self.mean, self.moment) if t is not None]
        tensors = super()._enter_static(storage) + statistics
        if self.sinks and self.seen >= self.sinks:
            self.held_sinks = (self.positions >= 0) & self._sink_slots(self.positions)
            self.extra["expected_logits"].masked_fill_(self.held_sinks[:, :, None], HIDDEN)
        return tensors

    def _leave_static(self, storage: Storage, steps: int) -> None:
        super()._leave_static(storage, steps)
        self.held_sinks = None


SINKS = 4
FUTURE = 512
REFUSED = (
    "ExpectedAttentionCache averages the model's rotation of the queries over the coming positions",
    "use a policy that reads no rotation (keydiff, knorm, snapkv)",
)


class ExpectedAttentionCache(ScoredCache):
    """Expected Attention (Devoto et al., 2025) inside an unmodified ``model.generate()``.

    Per layer and KV head, keeps the first ``sinks`` tokens and the ``budget - sinks`` others that
    the coming queries are expected to attend to most (over the next ``n_future_positions``
    positions, from the mean and covariance of the queries seen, before RoPE), scaled by their
    values' norms; the statistics follow the stream while decoding (see
    :mod:`hf_kvpolicies.policies.expected_attention`). No attention weights are read, so every
    attention implementation serves it (``flash_attention_2``, ``flex_attention``; padded batches
    need ``sdpa`` or ``eager`` for their exact mask). Models whose rotation is not one per position
    (dynamic NTK, LongRoPE, multi-axis RoPE, latent attention) are refused at construction.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        budget: int = 1024,
        n_future_positions: int = FUTURE,
        sinks: int = SINKS,
        use_covariance: bool = True,
        use_vnorm: bool = True,
        layer_budgets: LayerBudgets = "uniform",
        head_budgets: HeadBudgets = "uniform",
        chunk: int = 1,
        storage: str | StorageFactory = "native",
    ) -> None:
        check_int("budget", budget, minimum=1)
        check_int("n_future_positions", n_future_positions, minimum=1)
        check_int("sinks", sinks, minimum=0)
        if sinks >= budget:
            raise ValueError(
                f"sinks={sinks} must be below budget={budget}: the budget holds the sinks and the tokens the "
                "statistic keeps; lower sinks or raise budget"
            )
        for name, value in (("use_covariance", use_covariance), ("use_vnorm", use_vnorm)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        rotary = rotary_of(model, "full_attention", need=REFUSED)
        config = text_config(model)
        groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.budget, self.n_future_positions, self.sinks = budget, n_future_positions, sinks
        self.use_covariance, self.use_vnorm = use_covariance, use_vnorm
        share = StepShare()  # a forward's counted queries and window rotation, computed by the first layer
        super().__init__(
            model,
            lambda **options: ExpectedAttentionRetention(
                budget, rotary, groups, n_future_positions, sinks, use_covariance, use_vnorm, share, **options
            ),
            layer_budgets=layer_budgets, storage=storage, head_budgets=head_budgets, chunk=chunk,
        )

    @classmethod
    def budget_parameters(cls, budget: int) -> dict[str, int]:
        """``budget`` kept tokens, the sinks among them: the default 4, but never more than a quarter
        of the budget, so that most of it is chosen by the statistic at every budget."""
        return {"budget": budget, "sinks": min(SINKS, budget // 4)}
