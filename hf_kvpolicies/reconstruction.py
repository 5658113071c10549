"""KVzip's statistic: how much each cached token is needed to reconstruct the context.

Kim et al. (2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction")
score a prefilled context without knowing the question that will follow: the model is asked to
repeat the context (a repeat instruction followed by the context itself, teacher-forced), and a
cached token's score is the largest softmax attention it receives from any query of that
reconstruction, over the query heads that share its KV head. What reconstruction never needs,
no later question is likely to need either.

The reconstruction runs over the prefilled keys through a :class:`ReplayCache`: each forward
returns the context's keys followed by the reconstruction's own, and stores nothing, so the
reconstruction's keys never stay in any cache. Its attention is computed once, for the score and
for the forward alike: while it runs, the model's attention is :func:`replay_attention` (registered
with transformers' ``AttentionInterface``), which takes the softmax probabilities a chunk of
queries at a time with transformers' eager arithmetic, keeps each context key's largest, and
multiplies them with the values, where the model's own sdpa would compute them a second time.
Long contexts are reconstructed chunk by chunk
(``chunk`` context tokens per forward, as in the paper's code); chunks after the first are
introduced by "starting with" and the previous chunk's last ``overlap`` tokens. Memory stays
bounded by one chunk's activations and :data:`~hf_kvpolicies.attention_scores.SCORE_CHUNK_ELEMENTS`
probabilities at a time.

One choice differs from the paper's code and from kvpress, for contexts longer than one chunk:
they normalise each chunk's softmax over the first few tokens, that chunk and the reconstruction
only, and score a token from its own chunk's reconstruction; here the softmax is the one the
model computes (over the whole context and the reconstruction so far) and a token's score is
its maximum over every chunk's queries. Within one chunk (2,048 tokens by default) the two agree.

Cost: the reconstruction processes about as many tokens as the prefill again, each attending to
the whole context: its attention reads twice the keys of the prefill's causal one, in fp32
probabilities rather than a fused kernel, so KVzip's prefill costs 2.85x a full cache's at
2,048 tokens on the embedded model (1 thread, ``python -m eval.benchmarks.eviction``, 2026-12-06:
docs/results.md); kvpress warns of doubling to tripling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, CacheLayerMixin

from . import hooks
from .attention_scores import as_attention_result, max_attention, new_attention_output
from .model_layout import decoder_of, layer_layouts, text_config
from .special_tokens import start_ids

FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
LATER_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"
"""The paper's repeat instructions (the second one is followed by the previous chunk's end)."""
DEFAULT_CHUNK = 2048
DEFAULT_OVERLAP = 8


@dataclass(frozen=True)
class RepeatPrompt:
    """The token ids that turn a chunk of context into its reconstruction prompt."""

    first: tuple[int, ...]
    """Instruction before the first chunk."""
    later: tuple[int, ...]
    """Instruction before later chunks, followed by the previous chunk's last ``overlap`` tokens."""
    suffix: tuple[int, ...]
    """What opens the model's answer (an assistant turn under a chat template, else a newline)."""
    overlap: int = DEFAULT_OVERLAP
    start: tuple[int, ...] = ()
    """What the tokenizer sets before a text (a BOS): a context that opens with it is replayed without it."""

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, overlap: int = DEFAULT_OVERLAP) -> RepeatPrompt:
        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        instructions = encode(FIRST_INSTRUCTION), encode(LATER_INSTRUCTION), encode(answer_opening(tokenizer))
        return cls(*instructions, overlap, tuple(start_ids(tokenizer)))

    def chunks(self, ids: Sequence[int], chunk: int) -> list[list[int]]:
        """The reconstruction prompt of each chunk of ``ids`` (one row's real tokens)."""
        if self.start and tuple(ids[: len(self.start)]) == self.start:
            ids = ids[len(self.start) :]
        prompts = []
        for start in range(0, len(ids), chunk):
            instruction = list(self.first) if start == 0 else [*self.later, *ids[max(0, start - self.overlap) : start]]
            prompts.append([*instruction, *self.suffix, *ids[start : start + chunk]])
        return prompts


def answer_opening(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text between a user turn's content and the model's answer (what KVzip appends
    to the instruction): the chat template's end of turn and assistant header, or a newline."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "\n"
    marker = "\n@@@KVZIP-CONTEXT-END@@@"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "context" + marker}], add_generation_prompt=True, tokenize=False
    )
    return text.split(marker, 1)[1]


def check_reconstructable(model: PreTrainedModel, policy: str = "KVzipCache") -> None:
    """Refuse what the reconstruction cannot replay: models with sliding-window layers (their
    caches hold only the window, not the whole context that the reconstruction attends to),
    attention that :func:`replay_attention` does not compute (logit soft-capping, learned
    attention sinks), and attention whose queries cannot be read (decoding scores from them:
    :func:`~hf_kvpolicies.hooks.attention_modules`)."""
    name = model.config.model_type
    sliding = [layout.index for layout in layer_layouts(model) if layout.is_sliding]
    if sliding:
        raise ValueError(
            f"{policy} replays the whole context through every layer, but layers {sliding} of "
            f"{name} are sliding-window layers that keep only their window: "
            "use a policy that scores without a replay (h2o) or a model without sliding-window layers"
        )
    modules = hooks.attention_modules(model)
    extras = ["logit soft-capping"] if getattr(text_config(model), "attn_logit_softcapping", None) else []
    extras += ["learned attention sinks"] if any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in modules) else []
    if extras:
        raise ValueError(
            f"{policy} computes the reconstruction's attention as plain softmax attention, and {name}'s attention "
            f"adds {' and '.join(extras)}: use a policy that scores without a replay (h2o, snapkv)"
        )
    hooks.attach(model).serve_queries(model)


REPLAY_ATTENTION = "hf_kvpolicies_replay"
"""The attention implementation the model runs while it reconstructs (:func:`replay_attention`)."""
_replaying: list[ReplayCache] = []
"""The reconstruction under way (the attention function receives no cache)."""


def replay_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs
) -> tuple[torch.Tensor, None]:
    """The reconstruction's attention (an ``AttentionInterface`` function): its layer scores the
    context and computes the output from the same probabilities (:meth:`ReplayLayer.attend`).
    No mask comes in (transformers builds none for an implementation it does not know): the
    layer knows the causal structure and the padding."""
    replay = _replaying[-1]
    layer = replay.layers[module.layer_idx]
    scaling = module.scaling if scaling is None else scaling
    if module.layer_idx == len(replay.layers) - 1:  # the rest of the forward serves no score
        layer.attend(query, key, value, scaling, output=False)
        raise _LastLayerScored
    return layer.attend(query, key, value, scaling), None


class _LastLayerScored(Exception):
    """Ends a reconstruction forward once its last layer has scored (its output projection, MLP
    and final norm would compute what nothing reads)."""


AttentionInterface.register(REPLAY_ATTENTION, replay_attention)


class ReplayLayer(CacheLayerMixin):
    """One layer's context, replayed read-only: every forward attends to the context followed by
    its own keys, which are scored and then dropped."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.device = keys.device
        self.scores = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
        """``[batch, kv_heads, context]`` the largest attention each context token has received."""
        self.key_mask: torch.Tensor | None = None
        self.query_mask: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The context's keys and values followed by the reconstruction's (kept nowhere)."""
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, output: bool = True
    ) -> torch.Tensor | None:
        """Attention of the reconstruction's ``query`` (``[batch, heads, q, head_dim]``) over the
        context and itself (causal, pads hidden), ``[batch, q, heads, value_dim]`` as transformers'
        attention functions return it (with ``output``; else ``None``); on the way, each context
        key's largest probability over the queries that count and the query heads of its KV head
        is folded into ``scores``."""
        context = self.keys.shape[-2]
        out = new_attention_output(query, values) if output else None
        scores = max_attention(
            query, keys, scaling, context, None, self.key_mask, self.query_mask, values if output else None, out
        )
        torch.maximum(self.scores, scores[..., :context], out=self.scores)
        return as_attention_result(out) if output else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never needed: the layer starts with the context."""

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2] + query_length, 0

    def get_max_length(self) -> int:
        return -1


class ReplayCache(Cache):
    """The prefilled context of every layer, attended to by the reconstruction and never extended."""

    def __init__(self, layers_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__(layers=[ReplayLayer(keys, values) for keys, values in layers_kv])

    def set_masks(self, key_mask: torch.Tensor | None, query_mask: torch.Tensor | None) -> None:
        """Which keys are real tokens and which reconstruction queries count, for the next forward."""
        key_mask = None if key_mask is None else key_mask[:, None, :]  # one mask for every KV head
        for layer in self.layers:
            layer.key_mask, layer.query_mask = key_mask, query_mask


@torch.no_grad()
def reconstruction_scores(
    model: PreTrainedModel,
    layers_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    context_ids: torch.Tensor,
    prompt: RepeatPrompt,
    padding: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> list[torch.Tensor]:
    """Per layer, fp32 ``[batch, kv_heads, context]``: KVzip's score of each prefilled token.

    ``layers_kv`` holds each layer's prefilled keys and values (``[batch, kv_heads, context,
    head_dim]``, as the attention stored them), ``context_ids`` ``[batch, context]`` the prefilled
    ids, ``padding`` the prefill's 2-D attention mask (left or any padding; pads score 0). A padded
    row is reconstructed from its real tokens at the positions it had (``cumsum - 1``, as
    ``generate()`` numbers them), so it scores as it would alone. The model must be one
    :func:`check_reconstructable` accepts (its attention must be ``sdpa`` or ``eager``).
    """
    batch, context = context_ids.shape
    stored = {tuple(keys.shape[::2]) for keys, _ in layers_kv}
    if stored != {(batch, context)}:
        raise ValueError(f"the cached keys hold {sorted(stored)} (batch, tokens); the context ids are {(batch, context)}")
    device = layers_kv[0][0].device
    real = torch.ones(batch, context, dtype=torch.bool) if padding is None else padding.to("cpu", torch.bool)
    rows = [ids[mask].tolist() for ids, mask in zip(context_ids.cpu(), real)]
    per_row = [prompt.chunks(ids, chunk) for ids in rows]
    replay = ReplayCache(layers_kv)
    decoder = decoder_of(model)
    own = model.config._attn_implementation
    _replaying.append(replay)
    model.set_attn_implementation(REPLAY_ATTENTION)
    try:
        for index in range(max(len(prompts) for prompts in per_row)):
            chunk_prompts = [prompts[index] if index < len(prompts) else [] for prompts in per_row]
            ids, query_mask, positions = _left_padded(chunk_prompts, [len(ids) for ids in rows])
            key_mask = torch.cat([real, query_mask], dim=1)
            uniform = bool(key_mask.all())
            replay.set_masks(None if uniform else key_mask.to(device), None if uniform else query_mask.to(device))
            try:
                decoder(input_ids=ids.to(device), position_ids=positions.to(device), cache=replay, use_cache=True)
            except _LastLayerScored:
                pass
    finally:
        model.set_attn_implementation(own)
        _replaying.pop()
    return [layer.scores for layer in replay.layers]


def _left_padded(prompts: list[list[int]], offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, real-token mask and positions of rows of different lengths, padded on the left;
    row ``b`` continues its context, so its first real token sits at position ``offsets[b]``."""
    width = max(len(ids) for ids in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    positions = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, (prompt, offset) in enumerate(zip(prompts, offsets)):
        pad = width - len(prompt)
        if prompt:
            ids[row, pad:] = torch.tensor(prompt)
        mask[row, pad:] = True
        positions[row] = (torch.arange(width) - pad + offset).clamp(min=0)
    return ids, mask, positions

