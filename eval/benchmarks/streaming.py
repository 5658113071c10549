"""Streaming benchmark: bounded decode cost, and the StreamingLLM finding on the embedded model.

    python -m eval.benchmarks.streaming

Two tables from one process, then the thresholds checked on their figures (each printed with
its reason):

1. decode ms/token and MiB at each stream length (``--contexts``) for DynamicCache, FullCache,
   SlidingWindowCache, SinkCache in both position modes and transformers' own
   ``DynamicSlidingWindowLayer`` cache, all bounded ones at the same budget (``--budget``, the
   shortest context by default, so "at a stream length equal to the budget" is a column);
2. streaming perplexity (one token per forward, the cache never reset) over ``--ppl-tokens``
   tokens for full, window 252 and sink 4+252 in both position modes (``--ppl-window``).
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from .runner import Contender, arguments, contender, run
from .thresholds import Threshold, reasons

SINKS = 4
FLAT = Threshold(1.05, (
    "decode at the longest / the shortest stream for a bounded cache: it holds the same tokens however long the "
    "stream, so its step must not grow; 5% allows for timing noise on a shared CPU"
))
OVERHEAD = Threshold(1.05, (
    "decode of a bounded cache / DynamicCache's holding the same number of tokens: a policy's bookkeeping on top of "
    "transformers' own cache must stay within timing noise"
))
SINK_PPL = Threshold(1.15, (
    "streaming perplexity with 4 sinks / the full cache's: StreamingLLM's finding is that a few sink tokens keep a "
    "window's perplexity near the full cache's where the window alone loses it; 'near' is within 15%"
))


def transformers_window(model: PreTrainedModel, window: int) -> Cache:
    """transformers' own sliding-window layers on every layer: ``sliding_window - 1`` tokens kept,
    so ``window + 1`` keeps ``window`` tokens, as SlidingWindowCache(window) does."""
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[DynamicSlidingWindowLayer(sliding_window=window + 1) for _ in range(layers)])


def bounded(window: int, sink_window: int) -> list[Contender]:
    """The window at ``window`` tokens, then 4 sinks and ``sink_window`` in both position modes,
    each built at its budget as the sweep builds it."""
    sink = f"sink {SINKS}+{sink_window}"
    return [
        contender("window", window, f"window {window}"),
        contender("sink:positions=cache", sink_window + SINKS, f"{sink} cache"),
        contender("sink:positions=absolute", sink_window + SINKS, f"{sink} absolute"),
    ]


def speed_contenders(budget: int) -> list[Contender]:
    """Every bounded cache holds ``budget`` tokens (sinks included)."""
    return [
        Contender("DynamicCache", lambda m: DynamicCache(config=m.config)),
        contender("full"),
        *bounded(budget, budget - SINKS),
        Contender(f"transformers window {budget}", lambda m: transformers_window(m, budget)),
    ]


def ppl_contenders(window: int) -> list[Contender]:
    """The paper's comparison: window W against 4 sinks + the same W."""
    return [contender("full"), *bounded(window, window)]


def targets(speed: list[Contender], quality: list[Contender], contexts: list[int], budget: int) -> list[str]:
    """One line per threshold checked, with the figures it rests on."""
    lines = []
    if contexts:
        short, long = min(contexts), max(contexts)
        baseline = speed[0].figures.get(f"ms/token @{budget}")  # DynamicCache
        for contender in (c for c in speed if c.label.startswith(("window", "sink"))):
            figures = contender.figures
            ratio = figures[f"ms/token @{long}"] / figures[f"ms/token @{short}"]
            lines.append(FLAT.check(f"bounded decode, {contender.label}: {long} vs {short} tokens {ratio:.3f}x", ratio))
            if baseline:
                overhead = figures[f"ms/token @{budget}"] / baseline
                lines.append(OVERHEAD.check(f"policy overhead, {contender.label} at {budget} tokens vs DynamicCache: {overhead:.3f}x", overhead))
    if quality:
        full = quality[0].figures
        for contender in quality[1:]:
            for column in (c for c in full if c.startswith("ppl") and not math.isnan(full[c])):
                ratio = contender.figures[column] / full[column]
                text = f"{column}, {contender.label} vs full: {ratio:.3f}x"
                lines.append(SINK_PPL.check(text, ratio) if contender.label.startswith("sink") else text)
    return lines


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=int, default=None, help="tokens kept by the timed bounded caches (default: shortest context)"
    )
    parser.add_argument("--ppl-window", type=int, default=252, help="window of the perplexity contenders (sinks add 4)")
    parser.set_defaults(steps=32)  # the 1.05x targets need medians steadier than 16 steps give here
    args = parser.parse_args()
    contexts = sorted(args.contexts)
    budget = args.budget or (contexts[0] if contexts else 1024)
    speed, quality = [], []
    if contexts:
        speed = run(speed_contenders(budget), 0, contexts, steps=args.steps, model_name=args.model, rounds=args.rounds)
    if args.ppl_tokens:
        # perplexity is not timed: one thread keeps it from stalling when other processes share
        # the cores (oversubscribed intra-op threads made it several times slower)
        torch.set_num_threads(1)
        quality = run(ppl_contenders(args.ppl_window), args.ppl_tokens, [], steps=args.steps, model_name=args.model, rounds=args.rounds)
    print("\n" + "\n".join(targets(speed, quality, contexts, budget)))
    print("thresholds:\n" + "\n".join(reasons([("decode flatness", FLAT), ("policy overhead", OVERHEAD), ("sink perplexity / full", SINK_PPL)])))


if __name__ == "__main__":
    main()
