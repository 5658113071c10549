"""What the evaluation harness costs, and what its fast mode saves (``python -m eval.benchmarks.harness``).

* overhead: token-by-token streaming perplexity with FullCache against a bare ``model(...)``
  loop with ``DynamicCache`` over the same tokens (target <= 1.1x);
* fast mode: ``--chunk-size`` C against token by token for the full cache (target >= 5x),
  with the perplexities side by side (they must agree within 0.1%).

Each timing is the best of ``--repeats`` interleaved runs: the machine is shared.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from hf_kvpolicies import FullCache
from hf_kvpolicies.models import load_model

from ..data import embedded_text, tokenize
from ..perplexity import perplexity, streaming_nll


@torch.no_grad()
def bare_loop(model, ids: torch.Tensor) -> None:
    cache = DynamicCache(config=model.config)
    for t in range(ids.shape[1] - 1):
        model(ids[:, t : t + 1], cache=cache, use_cache=True)


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overhead-tokens", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens of the fast-mode comparison")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load_model()
    ids = tokenize(tokenizer, embedded_text(), max(args.tokens, args.overhead_tokens))
    short = ids[:, : args.overhead_tokens]
    bare_loop(model, short[:, :32])  # warm-up
    bare, harness = [], []
    for _ in range(args.repeats):
        bare.append(seconds(lambda: bare_loop(model, short)))
        harness.append(seconds(lambda: streaming_nll(model, short, FullCache(model))))
    per_token = 1000 / (short.shape[1] - 1)
    print(f"| token-by-token over {short.shape[1]} tokens | ms/token | ratio |")
    print("|---|---|---|")
    print(f"| bare model(...) loop, DynamicCache | {min(bare) * per_token:.2f} | 1.00 |")
    print(f"| streaming_nll, FullCache | {min(harness) * per_token:.2f} | {min(harness) / min(bare):.3f} |")

    stream = ids[:, : args.tokens]
    nll = {}
    fast = [seconds(lambda: nll.__setitem__("chunked", streaming_nll(model, stream, FullCache(model), chunk_size=args.chunk_size)))]
    slow = seconds(lambda: nll.__setitem__("token", streaming_nll(model, stream, FullCache(model), progress=True)))
    fast.append(seconds(lambda: streaming_nll(model, stream, FullCache(model), chunk_size=args.chunk_size)))
    token_ppl, chunked_ppl = perplexity(nll["token"]), perplexity(nll["chunked"])
    print(f"\n| FullCache over {stream.shape[1]} tokens | seconds | PPL |")
    print("|---|---|---|")
    print(f"| token by token | {slow:.1f} | {token_ppl:.4f} |")
    print(f"| --chunk-size {args.chunk_size} | {min(fast):.1f} | {chunked_ppl:.4f} |")
    print(
        f"\nspeed-up {slow / min(fast):.1f}x; relative PPL difference {abs(chunked_ppl - token_ppl) / token_ppl:.2e}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


if __name__ == "__main__":
    main()
