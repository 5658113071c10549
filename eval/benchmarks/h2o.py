"""H2O benchmark: streaming perplexity, decode speed and memory at one total budget.

    flock /tmp/kvp-bench.lock python -m eval.benchmarks.h2o

One table from one process, on the embedded model and text, for SlidingWindowCache(budget) (the
baseline of the ratios), FullCache, SinkCache(4 sinks + budget - 4) and H2OCache(heavy = recent =
budget / 2): decode ms/token and MiB (``get_memory_footprint``, H2O's score and position buffers
included) at each context (1K and 4K tokens by default), and streaming perplexity (one token per
forward, the cache never reset) over ``--ppl-tokens`` tokens. Then the issue's targets, each
checked on the figures it rests on.
"""

from __future__ import annotations

from hf_kvpolicies import FullCache, H2OCache, SinkCache, SlidingWindowCache

from .runner import Contender, arguments, run

SINKS = 4
SPEED_RATIO = 1.3  # H2O decode vs the sliding window at the same budget
FLAT_RATIO = 1.05  # H2O decode at the longest vs the shortest context


def contenders(budget: int) -> list[Contender]:
    heavy = budget // 2
    return [
        Contender(f"window {budget}", lambda m: SlidingWindowCache(m, window=budget)),
        Contender("full", FullCache),
        Contender(f"sink {SINKS}+{budget - SINKS}", lambda m: SinkCache(m, sink_tokens=SINKS, window=budget - SINKS)),
        Contender(f"h2o {heavy}+{budget - heavy}", lambda m: H2OCache(m, heavy=heavy, recent=budget - heavy)),
    ]


def targets(results: list[Contender], contexts: list[int], ppl_tokens: int) -> list[str]:
    """One line per target of the issue, with the figures it rests on."""
    window, _, sink, h2o = (c.figures for c in results)
    lines = []
    for context in contexts:
        ratio = h2o[f"ms/token @{context}"] / window[f"ms/token @{context}"]
        verdict = "met" if ratio <= SPEED_RATIO else "MISSED"
        lines.append(f"decode @{context}: h2o / window {ratio:.2f}x ({verdict}, target <= {SPEED_RATIO})")
    if len(contexts) > 1:
        short, long = min(contexts), max(contexts)
        flat = h2o[f"ms/token @{long}"] / h2o[f"ms/token @{short}"]
        verdict = "met" if flat <= FLAT_RATIO else "MISSED"
        lines.append(f"h2o decode {long} vs {short} tokens: {flat:.3f}x ({verdict}, target <= {FLAT_RATIO})")
        memory = [h2o[f"MiB @{c}"] for c in contexts]
        shown = " = ".join(f"{m:.4f}" for m in memory)
        constant = "constant" if len(set(memory)) == 1 else "NOT constant"
        lines.append(f"h2o memory at {contexts}: {shown} MiB ({constant})")
    if ppl_tokens:
        column = f"ppl ({ppl_tokens} tok)"
        versus_window = h2o[column] / window[column]
        versus_sink = h2o[column] / sink[column]
        lines.append(
            f"perplexity, h2o {h2o[column]:.2f} vs window {window[column]:.2f}: {versus_window:.3f}x "
            f"({'met' if versus_window < 1 else 'MISSED'}, target < 1)"
        )
        lines.append(
            f"perplexity, h2o vs sink {sink[column]:.2f}: {versus_sink:.3f}x "
            f"(h2o is {'lower' if versus_sink < 1 else 'higher'}; reported, no target)"
        )
    return lines


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], contexts=(1024, 4096))
    parser.add_argument("--budget", type=int, default=256, help="tokens kept by every bounded cache (sinks included)")
    args = parser.parse_args()
    contexts = sorted(args.contexts)
    results = run(contenders(args.budget), args.ppl_tokens, contexts, steps=args.steps, model_name=args.model, rounds=args.rounds)
    print("\n" + "\n".join(targets(results, contexts, args.ppl_tokens)))


if __name__ == "__main__":
    main()
