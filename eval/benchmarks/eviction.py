"""Eviction benchmark: every eviction policy at one budget, side by side, plus a needle task.

    flock /tmp/kvp-bench.lock python -m eval.benchmarks.eviction [--budget 256] [--needle-cases 40]

One process, the embedded model and text. For the sliding window (the baseline of the ratios),
FullCache, sink and every scored policy at ``--budget`` kept tokens per layer (each built with
its class's ``budget_parameters``): decode ms/token and MiB at each context (1K and 4K tokens),
streaming perplexity over ``--ppl-tokens`` tokens, and prefill seconds of a ``--prefill-tokens``
prompt in one forward with each policy's ratio to FullCache's (the policies take turns,
``--rounds`` rounds, medians; :func:`prefill_seconds`). The prefill timing alone, on one thread:
``--threads 1 --ppl-tokens 0 --contexts --needle-cases 0 --rounds 5``. Then the needle
task: RULER's single needle (a 7-digit number, ``eval.recall``) in prompts of 1,024 and 2,048
tokens with the question at the end, prefilled at once (or, ``--needle-protocol last-token-kept``,
as kvpress's pipeline: all but the last token) and answered greedily; exact matches and
the fraction of the number's digits right (position by position) for ``NEEDLE_POLICIES``;
``--needle-misses`` then lists each contender's missed prompts and answers.

A new eviction policy joins by adding its class to ``POLICIES`` (and its name to
``NEEDLE_POLICIES`` for the needle task); a policy with keywords changed joins ``VARIANTS``
(KVzip with uniform layer budgets, its KV heads sharing each layer's; KVzip with one budget per
layer and KV head, ``kvzip-per-head``; SnapKV with the paper's kernel 7, which pools too
narrowly to carry the question's attention from a needle's key over the 7 digits after it; SnapKV
pooling by average, as the paper's code and kvpress do, ``snapkv-avg``).
The needle table also gives the bytes each cache holds after its longest answer
(``eval.memory.held_bytes``). KVzip's prefill includes its
reconstruction pass: its ratio to FullCache is stated, with no target.
"""

from __future__ import annotations

import re
import statistics
import time

import torch

from hf_kvpolicies import (
    FullCache,
    H2OCache,
    KNormCache,
    KVzipCache,
    SinkCache,
    SlidingWindowCache,
    SnapKVCache,
    TOVACache,
    from_spec,
)
from hf_kvpolicies.cache import PolicyCache

from ..data import embedded_text, tokenize
from ..memory import held_bytes
from ..recall import make_case, score_answer
from ..speed import prefill
from .runner import Contender, arguments, run

POLICIES: dict[str, type[PolicyCache]] = {
    "window": SlidingWindowCache,
    "full": FullCache,
    "sink": SinkCache,
    "h2o": H2OCache,
    "snapkv": SnapKVCache,
    "tova": TOVACache,
    "knorm": KNormCache,
    "kvzip": KVzipCache,
}
"""Every contender by name, the baseline (window) first; bounded ones take ``budget_parameters``."""
VARIANTS: dict[str, tuple[str, dict]] = {
    "kvzip-uniform": ("kvzip", {"layer_budgets": "uniform"}),
    "kvzip-per-head": ("kvzip", {"layer_budgets": "uniform", "head_budgets": "uniform"}),
    "snapkv-k7": ("snapkv", {"kernel": 7}),
    "snapkv-avg": ("snapkv", {"pooling": "avg"}),
}
"""Contenders that are a policy with keywords changed: name -> (policy, keywords)."""
SCORED = ("h2o", "snapkv", "tova", "knorm")
"""The scored policies whose prefill has a target (<= SPEED_RATIO x FullCache's); KVzip's is stated."""
NEEDLE_POLICIES = ["full", "window", "h2o", "snapkv", "snapkv-k7", "snapkv-avg", "kvzip", "kvzip-uniform"]
NEEDLE_LENGTHS = (1024, 2048)
SPEED_RATIO = 1.3  # decode vs the sliding window at the same budget; prefill vs FullCache
FLAT_RATIO = 1.05  # decode at the longest vs the shortest context


def contender(name: str, budget: int) -> Contender:
    base, keywords = VARIANTS.get(name, (name, {}))
    policy = POLICIES[base]
    parameters = {**(policy.budget_parameters(budget) or {}), **keywords}
    label = name if not parameters else f"{name} " + ",".join(f"{k}={v}" for k, v in parameters.items())
    return Contender(label, lambda model: policy(model, **parameters))


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
def greedy_answer(model, ids: torch.Tensor, cache, new_tokens: int, last_token_kept: bool = False) -> torch.Tensor:
    """The answer's token ids, greedy. Prefilled at once, the prompt's last token attends to every
    prompt token, so the first answer token is the full cache's; with ``last_token_kept`` (kvpress's
    pipeline) all but the last token are prefilled and trimmed first, and the last is decoded from
    what was kept."""
    if last_token_kept:
        model(ids[:, :-1], cache=cache, use_cache=True)
    out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1] :]


@torch.no_grad()
def needle_scores(
    model,
    tokenizer,
    contenders: list[Contender],
    cases: int,
    haystack: torch.Tensor,
    last_token_kept: bool = False,
    misses: bool = False,
) -> list[str]:
    """Exact matches and digit accuracy of each contender over ``cases`` needle prompts
    (``last_token_kept``: see :func:`greedy_answer`); with ``full`` among the contenders, how many
    of the needles the full cache finds each one finds too (:func:`beside_full`); with
    ``misses``, each contender's missed prompts and answers (:func:`miss_line`)."""
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
            ids = torch.cat([case.context_ids, case.question_ids], dim=1).to(model.device)
            cache = c.make(model)
            answer = tokenizer.decode(greedy_answer(model, ids, cache, case.answer_tokens, last_token_kept), skip_special_tokens=True)
            answers.append(answer)
            if score_answer(answer, case.expected) == 1.0:
                found.add(index)
            digits.append(digits_right(answer, case.expected[0]))
            if case.length == max(NEEDLE_LENGTHS):
                held = max(held, held_bytes(cache) or 0)
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
    """One line per performance target, with the figures it rests on."""
    window = results["window"].figures
    lines = []
    for name in [*SCORED, "kvzip", *VARIANTS]:
        if name not in results:
            continue
        figures = results[name].figures
        for context in contexts:
            ratio = figures[f"ms/token @{context}"] / window[f"ms/token @{context}"]
            lines.append(f"{name} decode @{context} / window: {ratio:.2f}x ({'met' if ratio <= SPEED_RATIO else 'MISSED'}, <= {SPEED_RATIO})")
        if len(contexts) > 1:
            flat = figures[f"ms/token @{max(contexts)}"] / figures[f"ms/token @{min(contexts)}"]
            memory = {figures[f"MiB @{c}"] for c in contexts}
            lines.append(
                f"{name} decode {max(contexts)} vs {min(contexts)}: {flat:.3f}x ({'met' if flat <= FLAT_RATIO else 'MISSED'}, "
                f"<= {FLAT_RATIO}); memory {'constant' if len(memory) == 1 else 'NOT constant'} ({', '.join(f'{m:.3f}' for m in sorted(memory))} MiB)"
            )
        if prefill_column:
            ratio = figures[prefill_column]
            verdict = f"{'met' if ratio <= SPEED_RATIO else 'MISSED'}, <= {SPEED_RATIO}" if name in SCORED else "stated: the reconstruction pass"
            lines.append(f"{name} {prefill_column}: {ratio:.2f}x ({verdict})")
    return lines


def main() -> None:
    from hf_kvpolicies.models import load_model

    parser = arguments(__doc__.splitlines()[0], contexts=(1024, 4096))
    parser.add_argument("--budget", type=int, default=256, help="tokens kept per layer by every bounded cache")
    parser.add_argument("--prefill-tokens", type=int, default=2048, help="prompt of the prefill timing (0: skip)")
    parser.add_argument("--needle-cases", type=int, default=40, help="needle prompts, split over 1K and 2K (0: skip)")
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), help="subset of the contenders (window first)")
    parser.add_argument("--needle-specs", nargs="*", default=[], help="more needle contenders as specs, e.g. snapkv:budget=256,kernel=15")
    parser.add_argument("--needle-policies", nargs="*", default=NEEDLE_POLICIES, help="needle contenders by name (budget applied)")
    parser.add_argument("--needle-protocol", choices=("at-once", "last-token-kept"), default="at-once", help="needle prompts prefilled at once, or all but the last token prefilled and trimmed first, the last decoded from what was kept (kvpress's pipeline)")
    parser.add_argument("--needle-misses", action="store_true", help="after the needle table, each contender's missed prompts (length/seed, expected, answer)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every timing (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = sorted(args.contexts)
    names = ["window"] + [name for name in args.policies if name != "window"]
    contenders = [contender(name, args.budget) for name in names]
    results = dict(zip(names, run(contenders, args.ppl_tokens, contexts, steps=args.steps, model_name=args.model, rounds=args.rounds)))
    model, tokenizer = load_model(args.model)
    column = None
    if args.prefill_tokens:
        ids = tokenize(tokenizer, embedded_text(), args.prefill_tokens)
        prefill_seconds(model, ids, contenders, args.rounds)
        seconds = f"prefill s @{args.prefill_tokens}"
        column = f"prefill / full @{args.prefill_tokens}" if "full" in names else None
        print(f"\nprefill of {args.prefill_tokens} tokens in one forward, {args.rounds} rounds in turn, {torch.get_num_threads()} threads:")
        print("| policy | seconds (median) | / full (median of rounds) |\n|---|---|---|")
        print("\n".join(f"| {c.label} | {c.figures[seconds]:.2f} | {c.figures[column]:.2f}x |" if column else f"| {c.label} | {c.figures[seconds]:.2f} | |" for c in contenders))
    if {"window", "full"} <= set(names):
        print("\n" + "\n".join(targets(results, contexts if args.steps else [], column)))
    if args.needle_cases:
        haystack = tokenize(tokenizer, embedded_text()[-200_000:], start=False)
        chosen = [name for name in args.needle_policies if VARIANTS.get(name, (name,))[0] in POLICIES]
        needles = [contender(name, args.budget) for name in chosen]
        needles += [Contender(spec, lambda model, spec=spec: from_spec(model, spec)) for spec in args.needle_specs]
        kept = args.needle_protocol == "last-token-kept"
        how = "all but the last token prefilled, the last decoded from what was kept" if kept else "prefilled at once"
        print(f"\nneedle (niah_single, 7 digits, question at the end, {how}), budget {args.budget}:")
        print("\n".join(needle_scores(model, tokenizer, needles, args.needle_cases, haystack, kept, args.needle_misses)))


if __name__ == "__main__":
    main()
