"""Eviction benchmark: every eviction policy at one budget, side by side, plus a needle task.

    python -m eval.benchmarks.eviction [--budget 256] [--needle-cases 40]

One process, the embedded model and text. For the sliding window (the baseline of the ratios),
FullCache, sink and every scored policy at ``--budget`` kept tokens per layer (each spec built at
that budget as the sweep builds it, :func:`eval.budgets.expand`): decode ms/token and MiB at each
context (1K and 4K tokens), streaming perplexity over ``--ppl-tokens`` tokens, and prefill
seconds of a ``--prefill-tokens`` prompt in one forward with each policy's ratio to FullCache's
(the policies take turns, ``--rounds`` rounds, medians; :func:`prefill_seconds`). The prefill
timing alone, on one thread: ``--threads 1 --ppl-tokens 0 --contexts --needle-cases 0
--rounds 5``. Then the needle task: RULER's single needle (a 7-digit number, ``eval.recall``) in
prompts of 1,024 and 2,048 tokens with the question at the end, answered greedily under a protocol
of :mod:`eval.protocols` (``--needle-protocol at-once``: ``prefill``; ``last-token-kept``:
kvpress's pipeline); exact matches and the fraction of the number's digits right (position by
position) for ``NEEDLE_POLICIES``; ``--needle-misses`` then lists each contender's missed
prompts and answers.

Contenders are policy specs: a new eviction policy joins by its registered name in ``POLICIES``
(and ``NEEDLE_POLICIES`` for the needle task); a policy with keywords changed is a spec that sets
them (``kvzip:layer_budgets=uniform``: KVzip with uniform layer budgets, its KV heads sharing
each layer's; ``kvzip:layer_budgets=uniform,head_budgets=uniform``: one budget per layer and KV
head; ``snapkv:kernel=7``: SnapKV with the paper's kernel 7, which pools too narrowly to carry
the question's attention from a needle's key over the 7 digits after it;
``snapkv:pooling=avg``: SnapKV pooling by average, as the paper's code and kvpress do). A spec
that sets its budget keywords keeps them. The needle table also gives the bytes each cache holds
after its longest answer (``eval.memory.held_bytes``). KVzip's prefill includes its
reconstruction pass: its ratio to FullCache is stated, with no threshold.
"""

from __future__ import annotations

import re
import statistics
import time

import torch

from hf_kvpolicies import FullCache, parse_spec

from ..data import embedded_text, tokenize
from ..protocols import answer
from ..recall import make_case, score_answer
from ..speed import prefill
from .runner import Contender, arguments, contender, run
from .thresholds import Threshold, reasons

POLICIES = ("window", "full", "sink", "h2o", "snapkv", "tova", "knorm", "kvzip", "expected_attention", "keydiff")
"""Every contender's spec, the baseline (window) first; bare specs are built at ``--budget``."""
SCORED = ("h2o", "snapkv", "tova", "knorm", "expected_attention", "keydiff")
"""The scored families whose prefill is held to :data:`PREFILL_VS_FULL`; KVzip's is stated."""
NEEDLE_POLICIES = ("full", "window", "h2o", "snapkv", "snapkv:kernel=7", "snapkv:pooling=avg", "snapkv:chunk=16", "kvzip", "kvzip:layer_budgets=uniform", "expected_attention", "keydiff")
NEEDLE_LENGTHS = (1024, 2048)
NEEDLE_PROTOCOLS = {"at-once": "prefill", "last-token-kept": "last-token-kept"}
"""``--needle-protocol`` choices and the protocols of :mod:`eval.protocols` they name."""
DECODE_VS_WINDOW = Threshold(1.3, (
    "decode ms/token of a scored policy / the sliding window's at the same budget: scoring and choosing a slot at every "
    "step may cost up to 30% over the cheapest bounded cache, still well under the full cache's cost at 4K tokens "
    "(about 1.5x the window's, docs/results.md)"
))
PREFILL_VS_FULL = Threshold(1.3, (
    "one-forward prefill of a scored policy / FullCache's: the attention statistics a scored policy gathers over the "
    "prompt may add at most 30% to the prefill (KVzip's reconstruction is a second pass by design: stated, not held to it)"
))
FLAT = Threshold(1.05, (
    "decode at the longest / the shortest context for a bounded cache: it holds the same tokens at any context, so its "
    "step must not grow; 5% allows for timing noise, while a growing cost (the full cache's 1.4x from 1K to 4K) exceeds it"
))


@torch.no_grad()
def prefill_seconds(model, ids: torch.Tensor, contenders: list[Contender], rounds: int) -> None:
    """Seconds to prefill ``ids`` in one forward, and each contender's ratio to FullCache's.

    Every round times each contender once, in turn, starting one further along each round (so
    that neither a slow stretch of a shared machine nor going first falls on one contender);
    the figures are medians over rounds, the ratio the median of each round's ratio to the full
    cache of the same round (drift between rounds cancels in it).
    """
    times: dict[str, list[float]] = {c.label: [] for c in contenders}
    prefill(model, ids[:, :64], FullCache(model))  # warm-up
    for turn in range(rounds):
        for c in contenders[turn % len(contenders) :] + contenders[: turn % len(contenders)]:
            cache = c.make(model)
            start = time.perf_counter()
            prefill(model, ids, cache, chunk=ids.shape[1])
            times[c.label].append(time.perf_counter() - start)
            del cache
    full = next((c.label for c in contenders if c.label == "full"), None)
    for c in contenders:
        c.figures[f"prefill s @{ids.shape[1]}"] = statistics.median(times[c.label])
        if full is not None:
            ratios = [mine / theirs for mine, theirs in zip(times[c.label], times[full])]
            c.figures[f"prefill / full @{ids.shape[1]}"] = statistics.median(ratios)


def digits_right(answer: str, expected: str) -> float:
    """Fraction of ``expected``'s digits that the answer's first number has at the same place."""
    found = re.search(r"\d+", answer)
    got = found.group(0) if found else ""
    return sum(a == b for a, b in zip(got, expected)) / len(expected)


@torch.no_grad()
def needle_scores(
    model,
    tokenizer,
    contenders: list[Contender],
    cases: int,
    haystack: torch.Tensor,
    protocol: str = "prefill",
    misses: bool = False,
) -> list[str]:
    """Exact matches and digit accuracy of each contender over ``cases`` needle prompts answered
    under ``protocol`` (:mod:`eval.protocols`); with ``full`` among the contenders, how many of
    the needles the full cache finds each one finds too (:func:`beside_full`); with ``misses``,
    each contender's missed prompts and answers (:func:`miss_line`)."""
    per_length = max(1, cases // len(NEEDLE_LENGTHS))
    prompts = [
        make_case(tokenizer, haystack, "niah_single", length=length, depth=(seed + 0.5) / per_length, seed=seed)
        for length in NEEDLE_LENGTHS
        for seed in range(per_length)
    ]
    rows: list[tuple[str, set[int], list[str]]] = []
    missed: list[str] = []
    for c in contenders:
        found, digits, held, answers = set(), [], 0, []
        for index, case in enumerate(prompts):
            ids = torch.cat([case.context_ids, case.question_ids], dim=1)
            out = answer(model, tokenizer, ids, ids[:, :0], lambda: c.make(model), protocol, case.answer_tokens)
            answers.append(out.texts[0])
            if score_answer(out.texts[0], case.expected) == 1.0:
                found.add(index)
            digits.append(digits_right(out.texts[0], case.expected[0]))
            if case.length == max(NEEDLE_LENGTHS):
                held = max(held, out.decoded_held_bytes or 0)
        exact = [sum(prompts[i].length == n for i in found) for n in NEEDLE_LENGTHS]
        cells = [f"{e}/{per_length}" for e in exact] + [f"{100 * statistics.mean(digits):.0f}%", f"{held / 2**20:.2f}"]
        rows.append((c.label, found, cells))
        if misses:
            missed.append(miss_line(c.label, [(p.length, p.seed, p.expected[0], a) for i, (p, a) in enumerate(zip(prompts, answers)) if i not in found]))
    full = next((found for label, found, _ in rows if label == "full"), None)
    header = [f"exact @{n}" for n in NEEDLE_LENGTHS] + ["digits right", f"MiB held @{max(NEEDLE_LENGTHS)}"]
    header += [] if full is None else ["of full's found (+ others)"]
    lines = ["| policy | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for label, found, cells in rows:
        lines.append(f"| {label} | " + " | ".join(cells + ([] if full is None else [beside_full(found, full)])) + " |")
    return lines + missed


def miss_line(label: str, missed: list[tuple[int, int, str, str]]) -> str:
    """``"kvzip missed 2: 2048/4 '1234567' -> '1234560', ..."``: the (length, seed, expected,
    answer) of each prompt a contender missed, to compare policies prompt by prompt."""
    cases = ", ".join(f"{length}/{seed} {expected!r} -> {answer.strip()!r}" for length, seed, expected, answer in missed)
    return f"{label} missed {len(missed)}" + (f": {cases}" if missed else "")


def beside_full(found: set[int], full: set[int]) -> str:
    """``"34/35 +1"``: of the needles the full cache finds, how many a policy finds too, and how
    many it finds that the full cache misses (eviction can remove a distractor)."""
    others = len(found - full)
    return f"{len(found & full)}/{len(full)}" + (f" +{others}" if others else "")


def targets(results: dict[str, Contender], contexts: list[int], prefill_column: str | None) -> list[str]:
    """One line per threshold checked, with the figures it rests on (``results`` by spec given)."""
    window = results["window"].figures
    lines = []
    for spec, contender_ in results.items():
        family = parse_spec(spec)[0]
        if family not in (*SCORED, "kvzip"):
            continue
        figures = contender_.figures
        for context in contexts:
            ratio = figures[f"ms/token @{context}"] / window[f"ms/token @{context}"]
            lines.append(DECODE_VS_WINDOW.check(f"{spec} decode @{context} / window: {ratio:.2f}x", ratio))
        if len(contexts) > 1:
            flat = figures[f"ms/token @{max(contexts)}"] / figures[f"ms/token @{min(contexts)}"]
            memory = {figures[f"MiB @{c}"] for c in contexts}
            lines.append(
                FLAT.check(f"{spec} decode {max(contexts)} vs {min(contexts)}: {flat:.3f}x", flat)
                + f"; memory {'constant' if len(memory) == 1 else 'NOT constant'} ({', '.join(f'{m:.3f}' for m in sorted(memory))} MiB)"
            )
        if prefill_column:
            ratio = figures[prefill_column]
            if family in SCORED:
                lines.append(PREFILL_VS_FULL.check(f"{spec} {prefill_column}: {ratio:.2f}x", ratio))
            else:
                lines.append(f"{spec} {prefill_column}: {ratio:.2f}x (stated: the reconstruction pass)")
    return lines


def main() -> None:
    from hf_kvpolicies.models import load_model

    parser = arguments(__doc__.splitlines()[0], contexts=(1024, 4096))
    parser.add_argument("--budget", type=int, default=256, help="tokens kept per layer by every bounded cache")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="prompt of the prefill timing (0: skip)")
    parser.add_argument("--needle-cases", type=int, default=40, help="needle prompts, split over 1K and 2K (0: skip)")
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), help="contenders as policy specs (window first), e.g. snapkv:kernel=7")
    parser.add_argument("--needle-policies", nargs="*", default=list(NEEDLE_POLICIES), help="needle contenders as policy specs (bare ones at --budget)")
    parser.add_argument("--needle-specs", nargs="*", default=[], help="more needle contenders as specs, e.g. snapkv:budget=256,kernel=15")
    parser.add_argument("--needle-protocol", choices=list(NEEDLE_PROTOCOLS), default="at-once", help="needle prompts prefilled at once (protocol prefill), or all but the last token prefilled and trimmed first, the last decoded from what was kept (protocol last-token-kept, kvpress's pipeline)")
    parser.add_argument("--needle-misses", action="store_true", help="after the needle table, each contender's missed prompts (length/seed, expected, answer)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every timing (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = sorted(args.contexts)
    specs = ["window"] + [spec for spec in args.policies if spec != "window"]
    contenders = [contender(spec, args.budget) for spec in specs]
    results = dict(zip(specs, run(contenders, args.ppl_tokens, contexts, steps=args.steps, model_name=args.model, rounds=args.rounds)))
    model, tokenizer = load_model(args.model)
    column = None
    if args.prefill_tokens:
        ids = tokenize(tokenizer, embedded_text(), args.prefill_tokens)
        prefill_seconds(model, ids, contenders, args.rounds)
        seconds = f"prefill s @{args.prefill_tokens}"
        column = f"prefill / full @{args.prefill_tokens}" if "full" in specs else None
        print(f"\nprefill of {args.prefill_tokens} tokens in one forward, {args.rounds} rounds in turn, {torch.get_num_threads()} threads:")
        print("| policy | seconds (median) | / full (median of rounds) |\n|---|---|---|")
        print("\n".join(f"| {c.label} | {c.figures[seconds]:.2f} | {c.figures[column]:.2f}x |" if column else f"| {c.label} | {c.figures[seconds]:.2f} | |" for c in contenders))
    if {"window", "full"} <= set(specs):
        print("\n" + "\n".join(targets(results, contexts if args.steps else [], column)))
        print("thresholds:\n" + "\n".join(reasons([("decode / window", DECODE_VS_WINDOW), ("decode flatness", FLAT), ("prefill / full", PREFILL_VS_FULL)])))
    if args.needle_cases:
        haystack = tokenize(tokenizer, embedded_text()[-200_000:], start=False)
        needles = [contender(spec, args.budget) for spec in [*args.needle_policies, *args.needle_specs]]
        protocol = NEEDLE_PROTOCOLS[args.needle_protocol]
        how = "all but the last token prefilled, the last decoded from what was kept" if protocol == "last-token-kept" else "prefilled at once"
        print(f"\nneedle (niah_single, 7 digits, question at the end, {how}: protocol {protocol}), budget {args.budget}:")
        print("\n".join(needle_scores(model, tokenizer, needles, args.needle_cases, haystack, protocol, args.needle_misses)))


if __name__ == "__main__":
    main()
