"""Shared-context benchmark: several questions of one long context, per turn, every policy.

    python -m eval.benchmarks.shared_context [--budget 256] [--length 2048] [--turns 4] [--prompts 20]
        [--policies full window sink h2o snapkv kvzip] [--protocols multiturn multiquery] [--chat-template]

One process, the embedded model and text. ``--prompts`` ``niah_multiturn`` cases (``eval.recall``:
``--turns`` needles of 7-digit numbers under distinct keys; prompt ``i`` is seed ``i`` with its
first needle at depth ``(i + 0.5) / prompts``, the others spread after it), whose context and
first question take ``--length`` tokens. Each contender is a policy spec built at ``--budget`` as
the sweep builds it (:func:`eval.budgets.expand`: any registered policy, e.g. ``snapkv:kernel=7``
or ``kvzip:layer_budgets=uniform``), and answers every case under each ``--protocols`` of
:mod:`eval.protocols`: ``multiturn`` asks the questions in turn of one cache, each answer decoded
through it before the next question; ``multiquery`` asks each of its own copy of the cache the
context left. The table gives, per policy and protocol, the exact matches of each turn (answers
holding their needle's number), their mean over turns, the most KV bytes the cache held once a
question was in (per sequence) and the seconds the policy took; then the target is checked: KVzip keeps every turn after the first
within 10% of the full cache's exact matches, under each protocol.

``--copy-cost`` instead times, per policy, what ``multiquery`` does once per question against
what it avoids: a copy of the cache the first prompt's context left (``eval.cache_copy``)
against prefilling that context again (for KVzip, with its reconstruction pass).
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date

import torch
import transformers

from ..asking import ask
from ..cache_copy import copy_cache
from ..data import embedded_text, embedded_text_version, tokenize
from ..dialogue import framing_for
from ..protocols import PROTOCOLS, protocol_named
from ..recall import make_case, score_answer
from .runner import contender
from .thresholds import Threshold, reasons

POLICIES = ("full", "window", "sink", "h2o", "snapkv", "kvzip")
"""The contenders by default: every policy of the library at ``--budget`` and the full cache; any
registered spec joins with ``--policies`` (``expected_attention``, ``keydiff``, ``snapkv:chunk=20``)."""
PROTOCOLS_RUN = ("multiturn", "multiquery")
LATER_TURNS_VS_FULL = Threshold(0.9, (
    "exact matches of KVzip / the full cache's at each turn after the first: a query-agnostic cache compressed once "
    "for the context must serve the later questions of a conversation nearly as the full cache does (within 10%), "
    "where query-aware selection keeps what the first question needs"
), floor=True)


def per_turn(model, tokenizer, spec: str, budget: int, cases: list, protocol: str, framing) -> tuple[list[int], int | None, float]:
    """``(exact matches per turn, most bytes held once a question was in, seconds)`` of one
    contender under ``protocol``."""
    built = contender(spec, budget)
    start = time.perf_counter()
    found = ask(model, tokenizer, cases, protocol_named(protocol), lambda: built.make(model), framing)
    exact = [0] * len(cases[0].turns)
    for asked in found:
        exact[asked.turn] += score_answer(asked.text, cases[asked.case].turns[asked.turn].expected) == 1.0
    held = [asked.answers.held_bytes for asked in found]
    return exact, None if None in held else max(held), time.perf_counter() - start


@torch.no_grad()
def copy_cost(model, spec: str, budget: int, context: torch.Tensor) -> tuple[float, float]:
    """``(seconds to prefill context, seconds to copy the cache it left)``."""
    cache = contender(spec, budget).make(model)
    start = time.perf_counter()
    model(context, cache=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    copy_cache(cache, model)
    return prefill, time.perf_counter() - start


def target_lines(results: dict[tuple[str, str], list[int]], protocols: list[str]) -> list[str]:
    """One line per later turn and protocol: KVzip's exact matches over the full cache's."""
    lines = []
    for protocol in protocols:
        full, kvzip = results.get(("full", protocol)), results.get(("kvzip", protocol))
        if full is None or kvzip is None:
            continue
        for turn in range(1, len(full)):
            figure = f"kvzip {protocol} turn {turn + 1}: {kvzip[turn]} / full's {full[turn]}"
            lines.append(LATER_TURNS_VS_FULL.check(figure, kvzip[turn] / full[turn]) if full[turn] else f"{figure} (no ratio: the full cache found none)")
    return lines


def main() -> None:
    from hf_kvpolicies.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=256, help="tokens kept per layer by every bounded cache")
    parser.add_argument("--length", type=int, default=2048, help="tokens of the context and the first question")
    parser.add_argument("--turns", type=int, default=4, help="needles, each asked in a turn of its own")
    parser.add_argument("--prompts", type=int, default=20, help="cases (seeds 0.., depths spread over the context)")
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), help="contenders as policy specs (bare ones at --budget), e.g. snapkv:kernel=7")
    parser.add_argument("--protocols", nargs="*", default=list(PROTOCOLS_RUN), choices=[name for name, p in PROTOCOLS.items() if p.shares_context])
    parser.add_argument("--chat-template", action="store_true", help="each question a user message of the tokenizer's chat template (default: plain text)")
    parser.add_argument("--copy-cost", action="store_true", help="time a copy of each policy's cache against prefilling the context again, and stop")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    try:
        framing = framing_for(tokenizer, args.chat_template)
        haystack = tokenize(tokenizer, embedded_text()[-200_000:], start=False)
        cases = [
            make_case(tokenizer, haystack, "niah_multiturn", args.length, (seed + 0.5) / args.prompts, seed, framing, turns=args.turns)
            for seed in range(args.prompts)
        ]
        for spec in args.policies:
            contender(spec, args.budget).make(model)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    versions = (
        f"model {args.model}, text {embedded_text_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {date.today().isoformat()}"
    )
    if args.copy_cost:
        print(f"the context of a {args.length}-token prompt prefilled, then its cache copied; budget {args.budget}")
        print("| policy | prefill s | copy s | copy / prefill |\n|---|---|---|---|")
        for spec in args.policies:
            prefill, copied = copy_cost(model, spec, args.budget, cases[0].context_ids)
            print(f"| {contender(spec, args.budget).label} | {prefill:.2f} | {copied:.3f} | {copied / prefill:.4f} |", flush=True)
        print(f"\n{versions}")
        return
    turns = [f"turn {turn}" for turn in range(1, args.turns + 1)]
    print(f"niah_multiturn: {args.prompts} prompts of {args.length} tokens, {args.turns} needles asked in turn, budget {args.budget}, "
          f"{'chat template' if args.chat_template else 'plain text'}; exact matches of {args.prompts} per turn", flush=True)
    print("| policy | protocol | " + " | ".join(turns) + " | mean | MiB held | seconds |", flush=True)
    print("|---" * (len(turns) + 5) + "|", flush=True)
    results: dict[tuple[str, str], list[int]] = {}
    for spec in args.policies:
        for protocol in args.protocols:
            exact, held, seconds = per_turn(model, tokenizer, spec, args.budget, cases, protocol, framing)
            results[spec, protocol] = exact
            mean = sum(exact) / len(exact) / args.prompts
            mib = "" if held is None else f"{held / 2**20:.2f}"
            print(f"| {contender(spec, args.budget).label} | {protocol} | " + " | ".join(map(str, exact)) + f" | {mean:.2f} | {mib} | {seconds:.0f} |", flush=True)
    print(f"\n{versions}")
    lines = target_lines(results, args.protocols)
    if lines:
        print("\n" + "\n".join(lines))
        print("thresholds:\n" + "\n".join(reasons([("kvzip / full, each later turn", LATER_TURNS_VS_FULL)])))


if __name__ == "__main__":
    main()
