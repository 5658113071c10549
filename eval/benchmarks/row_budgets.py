"""What budgets of each row's own cost (``python -m eval.benchmarks.row_budgets``).

Adaptive layer budgets rank each row's layers apart, so that a row of a batch keeps what it keeps
alone; a layer's storage is one tensor for the batch, sized for its largest row, so the other
rows leave slots unused. For each policy, on ``--rows`` rows of ``--tokens`` tokens of the
embedded text, prefilled at once: the slots the batch allocates against the slots its rows'
own budgets hold (the same total per row).
"""

from __future__ import annotations

import argparse

import torch

from hf_kvpolicies import from_spec
from hf_kvpolicies.models import load_model

from ..data import embedded_text, embedded_text_version, tokenize

POLICIES = ("kvzip:budget=128", "snapkv:budget=128,layer_budgets=adaptive", "h2o:heavy=64,recent=64,layer_budgets=adaptive")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--policy", action="append", help=f"spec with adaptive layer budgets (default: {' '.join(POLICIES)})")
    args = parser.parse_args()
    model, tokenizer = load_model()
    ids = tokenize(tokenizer, embedded_text(), args.rows * args.tokens)[0, : args.rows * args.tokens].view(args.rows, args.tokens)
    print(f"| policy ({args.rows} rows x {args.tokens} tokens) | slots per row | allocated / rows' own |")
    print("|---|---|---|")
    for spec in args.policy or POLICIES:
        cache = from_spec(model, spec)
        with torch.no_grad():
            model(ids, cache=cache, logits_to_keep=1)
        own = sum(sum(row) for row in cache.row_layer_budgets())
        allocated = args.rows * sum(cache.layer_budget_sizes())
        print(f"| {spec} | {own // args.rows} | {allocated / own:.3f}x |")
    print(f"\nmodel smollm2-135m, text {embedded_text_version()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
