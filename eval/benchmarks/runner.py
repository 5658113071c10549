"""What every benchmark does: the same tokens, the same timing, one table, side by side.

A benchmark module names its contenders (label -> cache factory; policies as specs built at a
budget, :func:`contender`) and calls :func:`run`.
Runs time on a shared machine drift, so every figure of one table is measured in one process,
decode steps are timed with every contender at every context taking turns step by step (their
caches prefilled side by side), in ``--rounds`` rounds whose medians' median is the figure, so that neither
drift nor one disturbed round decides a ratio; ratios are taken against the first contender.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import transformers
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from hf_kvpolicies import from_spec
from hf_kvpolicies.storage import cpu_kernels

from ..budgets import expand
from ..data import embedded_text, embedded_text_version, tokenize
from ..memory import footprint
from ..perplexity import perplexity, streaming_nll
from ..speed import decode_step_times, prefill

CacheFactory = Callable[[PreTrainedModel], Cache]


@dataclass
class Contender:
    label: str
    make: CacheFactory
    figures: dict[str, float] = field(default_factory=dict)


def contender(spec: str, budget: int | None = None, label: str | None = None) -> Contender:
    """A policy spec built at ``budget`` as the sweep builds it (:func:`eval.budgets.expand`: a
    bare bounded spec gets the budget's keywords, any other keeps its own), labelled ``label`` or
    with the spec built."""
    [policy] = expand([spec], () if budget is None else (budget,))
    built = policy.spec(budget or 0)
    return Contender(label or built, lambda model: from_spec(model, built))


def arguments(description: str, ppl_tokens: int = 2000, contexts: Sequence[int] = (1024, 2048, 4096)):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ppl-tokens", type=int, default=ppl_tokens, help="tokens of streaming perplexity (0: skip)")
    parser.add_argument("--contexts", type=int, nargs="*", default=list(contexts), help="decode-latency context lengths")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per context")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median of their medians)")
    parser.add_argument("--model", default="smollm2-135m")
    return parser


def run(
    contenders: list[Contender],
    ppl_tokens: int,
    contexts: Sequence[int],
    steps: int = 16,
    model_name: str = "smollm2-135m",
    progress: bool = True,
    rounds: int = 3,
) -> list[Contender]:
    """Measure decode ms/token (contenders side by side, median over ``rounds``) and the
    footprint at each context, and streaming perplexity."""
    from hf_kvpolicies.models import load_model

    model, tokenizer = load_model(model_name)
    needed = max([ppl_tokens, *[c + steps + 4 for c in contexts]])
    ids = tokenize(tokenizer, embedded_text(), needed)
    medians: dict[tuple[str, int], list[float]] = {}
    sizes: dict[tuple[str, int], int] = {}
    for _ in range(rounds):
        caches, starts, keys = [], [], []
        for context in contexts:
            for contender in contenders:
                cache = contender.make(model)
                prefill(model, ids[:, :context], cache)
                sizes[contender.label, context] = footprint(cache)
                caches.append(cache)
                starts.append(ids[:, context : context + 1])
                keys.append((contender.label, context))
        # every contender at every context takes its turn in one loop: drift falls on the contexts
        # alike too, so that a ratio of contexts (is decoding flat?) is as steady as one of contenders
        times = decode_step_times(model, caches, starts, steps)
        for key, series in zip(keys, times):
            medians.setdefault(key, []).append(statistics.median(series))
        del caches
    for context in contexts:
        for contender in contenders:
            contender.figures[f"ms/token @{context}"] = statistics.median(medians[contender.label, context])
            contender.figures[f"MiB @{context}"] = sizes[contender.label, context] / 2**20
    if ppl_tokens:
        for contender in contenders:
            nll = streaming_nll(model, ids[:, :ppl_tokens], contender.make(model), progress=progress, desc=contender.label)
            contender.figures[f"ppl ({ppl_tokens} tok)"] = perplexity(nll)
            contender.figures["ppl after 1K"] = perplexity(nll[1000:]) if ppl_tokens > 1100 else float("nan")
    if contenders[0].figures:  # nothing to tabulate when both timing and perplexity are skipped
        print(table(contenders))
    timed = f", {rounds} rounds x {steps} decode steps" if contexts else ""
    kernels = cpu_kernels.serves(model.device, model.dtype)
    print(
        f"\nmodel {model_name}, text {embedded_text_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads{timed}, integer storage reads through "
        f"{'its CPU kernels' if kernels else 'PyTorch operations'}; ratios vs {contenders[0].label}",
        file=sys.stdout,
    )
    return contenders


def table(contenders: list[Contender]) -> str:
    columns = list(contenders[0].figures)
    base = contenders[0].figures
    lines = ["| policy | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for contender in contenders:
        cells = []
        for column in columns:
            value = contender.figures.get(column, float("nan"))
            ratio = value / base[column] if base.get(column) else float("nan")
            exact = column.startswith("ppl")  # perplexity targets are set within a thousandth
            shown = f"{value:.3f}" if exact else f"{value:.3g}"
            if contender is not contenders[0]:
                shown += f" ({ratio:.4f}x)" if exact else f" ({ratio:.2f}x)"
            cells.append(shown)
        lines.append(f"| {contender.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
