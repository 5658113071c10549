"""The ``hf-kvpolicies`` lm-eval model: lm-eval's ``HFLM`` with every request answered through a
policy cache built from ``policy=`` and fed under ``protocol=`` (``import hf_kvpolicies.lm_eval``
registers it; ``hf-kvpolicies lm-eval`` runs lm-eval's command line with it).

- ``generate_until``: a fresh cache per batch. Under ``prefill``, ``generate()`` takes the
  left-padded batch in one forward (the policies give each row what it gets alone) and the
  policy trims; under ``streamed`` and ``last-token-kept``, rows of one length go together,
  unpadded: every prompt token but the last is fed first (through the budget in exact chunks, or
  in one forward the policy trims after), then ``generate()`` feeds the last one and decodes.
- ``loglikelihood``: each continuation token scored from what the cache kept (:mod:`.scoring`).
- ``loglikelihood_rolling``: the document (after lm-eval's prefix token) streamed through the
  budget as the perplexity task streams it (:func:`eval.perplexity.streaming_nll`), whatever
  the protocol; not cut into lm-eval's windows of ``max_length``.

Everything else (tokenising, truncating, stop sequences, response caching) is ``HFLM``'s. The
records of the results (:data:`.results.SECTION` in the results' ``config``) say the spec built,
the protocol, the budget, and per task what the cache held once the prompts were in.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import Cache

from hf_kvpolicies.models import pretrained_path

from ..perplexity import streaming_nll
from ..records import environment
from ..stream import resolve_chunk
from ..sweep import policy_fields
from .arguments import ModelArgumentError, check_arguments
from .held import HeldLog
from .results import SECTION
from .scoring import prime, score_contexts

logger = logging.getLogger(__name__)

HFLM_ARGUMENTS = set(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}


class FirstStep(LogitsProcessor):
    """Calls ``seen()`` at ``generate()``'s first step: the prompt is in and trimmed, no token chosen yet."""

    def __init__(self, seen: Callable[[], None]) -> None:
        self.seen: Callable[[], None] | None = seen

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.seen is not None:
            self.seen()
            self.seen = None
        return scores


@register_model("hf-kvpolicies")
class PolicyLM(HFLM):
    """``HFLM`` plus ``policy=SPEC`` (any spec, ``storage=`` included), ``protocol=`` (``prefill``,
    ``streamed``, ``last-token-kept``) and ``budget=`` (a bare bounded spec built at that budget,
    as ``hf-kvpolicies eval --budgets`` builds it); ``pretrained=`` also takes the embedded
    models' names (``smollm2-135m``, ``gemma3-270m``)."""

    def __init__(self, pretrained, policy: str = "full", protocol: str = "prefill", budget: int | None = None, **kwargs) -> None:
        self.arguments = check_arguments(policy, protocol, budget, {k: v for k, v in kwargs.items() if k not in HFLM_ARGUMENTS})
        named = isinstance(pretrained, str)
        self.model_name = pretrained if named else getattr(pretrained, "name_or_path", type(pretrained).__name__)
        if named:
            try:
                pretrained = pretrained_path(pretrained)
            except (ModuleNotFoundError, FileNotFoundError) as error:
                raise ModelArgumentError(f"pretrained={self.model_name!r}: {error}") from error
        super().__init__(pretrained=pretrained, **kwargs)
        self.described = policy_fields(self.arguments.build(self.model), self.arguments.spec, budget)
        self.held = HeldLog()
        self._task = ""

    def new_cache(self) -> Cache:
        return self.arguments.build(self.model)

    def _by_task(self, requests: list[Instance], run: Callable[[list[Instance]], list]) -> list:
        """``run`` over each task's requests in turn, answers back in the requests' order: what the
        cache holds is filed under the task being run."""
        parts: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            parts.setdefault(request.task_name or "", []).append(index)
        found: list = [None] * len(requests)
        for task, indices in parts.items():
            self._task = task
            for index, answer in zip(indices, run([requests[i] for i in indices])):
                found[index] = answer
        return found

    def _held(self, cache: Cache, fed: int, rows: int) -> None:
        self.held.add(self._task, cache, fed, rows)

    # --- log-likelihoods ---------------------------------------------------------------------
    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        run = super().loglikelihood
        return self._by_task(requests, lambda part: run(part, disable_tqdm=disable_tqdm))

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        """Contexts (left-truncated as ``HFLM`` does) fed once for all their continuations; those of
        one length, up to ``batch_size`` of them, together."""
        by_context: dict[tuple[int, ...], list[int]] = {}
        for index, (_, context, continuation) in enumerate(requests):
            whole = (context + continuation)[-(self.max_length + 1) :]
            by_context.setdefault(tuple(whole[: len(whole) - len(continuation)]), []).append(index)
        by_length: dict[int, list[tuple[int, ...]]] = {}
        for context in by_context:
            by_length.setdefault(len(context), []).append(context)
        batch = self.batch_size if self.batch_size != "auto" else self._detect_batch_size([max(requests, key=lambda r: len(r[1]) + len(r[2]))])
        found: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        for length in sorted(by_length, reverse=True):
            contexts = by_length[length]
            for at in range(0, len(contexts), batch):
                part = contexts[at : at + batch]
                continuations = [[requests[i][2] for i in by_context[context]] for context in part]
                scores = score_contexts(
                    self.model, part, continuations, self.new_cache, self.arguments.feeding.streams, self.softmax_dtype, self._held
                )
                for context, answers in zip(part, scores):
                    for index, answer in zip(by_context[context], answers):
                        found[index] = answer
                        if requests[index][0] is not None:
                            self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
                        bar.update(1)
        bar.close()
        return found

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        return self._by_task(requests, lambda part: self._rolling(part, disable_tqdm))

    def _rolling(self, requests: list[Instance], disable_tqdm: bool) -> list[float]:
        found = []
        for (text,) in tqdm([request.args for request in requests], disable=disable_tqdm or self.rank != 0):
            ids = torch.tensor([[self.prefix_token_id, *self.tok_encode(text)]])
            if ids.shape[1] > self.max_length + 1 and not self.described["bounded"]:
                logger.warning(
                    "a document of %d tokens goes whole through %s, past max_length=%d (lm-eval's hf model scores it in windows)",
                    ids.shape[1] - 1, self.arguments.spec, self.max_length,
                )
            cache = self.new_cache()
            chunk, _ = resolve_chunk(cache, self.model, None)
            total = -float(streaming_nll(self.model, ids, cache, chunk_size=chunk).sum())
            self._held(cache, ids.shape[1] - 1, 1)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            found.append(total)
        return found

    # --- generation ----------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        run = super().generate_until
        return self._by_task(requests, lambda part: run(part, disable_tqdm=disable_tqdm))

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        mask = generation_kwargs.pop("attention_mask")
        if self.arguments.feeding.generate_prefills:
            return self._generate(context, mask, max_length, stop, self.new_cache(), generation_kwargs)
        width, lengths = context.shape[1], mask.sum(dim=1).tolist()
        outputs: list[torch.Tensor | None] = [None] * len(lengths)
        for length in sorted(set(lengths), reverse=True):
            rows = [row for row, n in enumerate(lengths) if n == length]
            ids = context[rows, width - length :]
            cache = self.new_cache()
            prime(self.model, ids[:, :-1], cache, self.arguments.feeding.streams, resolve_chunk(cache, self.model, None)[0])
            out = self._generate(ids, torch.ones_like(ids), max_length - (width - length), stop, cache, generation_kwargs)
            for row, tokens in zip(rows, out):
                outputs[row] = torch.cat([context[row, : width - length], tokens])  # back at the batch's width
        longest = max(len(tokens) for tokens in outputs)
        return torch.stack([F.pad(tokens, (0, longest - len(tokens)), value=self.tokenizer.pad_token_id) for tokens in outputs])

    def _generate(
        self, ids: torch.Tensor, mask: torch.Tensor, max_length: int, stop: list[str], cache: Cache, generation_kwargs: dict
    ) -> torch.Tensor:
        fed, rows = int(mask.sum(dim=1).max()), ids.shape[0]
        seen = LogitsProcessorList([FirstStep(lambda: self._held(cache, fed, rows))])
        return super()._model_generate(
            ids, max_length, stop, attention_mask=mask, cache=cache, logits_processor=seen, **dict(generation_kwargs)
        )

    # --- records -----------------------------------------------------------------------------
    def get_model_info(self) -> dict:
        """``HFLM``'s, plus what the records of these results say about the cache (:data:`SECTION`)."""
        run = self.arguments.run
        return {
            **super().get_model_info(),
            SECTION: {
                **self.described,
                "policy": run.policy,
                "label": run.label,
                "family": run.family,
                "protocol": self.arguments.protocol,
                "model": self.model_name,
                "device": self.device.type,
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "versions": environment()["versions"],
                "tasks": self.held.fields(),
            },
        }

