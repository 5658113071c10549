"""Integer storage benchmark: int8/int4/int2 beside transformers' QuantizedCache (quanto) and full precision.

    pip install 'hf-kvpolicies[bench]'   # optimum-quanto, for transformers' QuantizedCache
    python -m eval.benchmarks.quant

One process, the embedded model and text. One table for FullCache (the base of the ratios) and the
full cache in int8, int4 and int2 storage, with transformers' ``QuantizedCache(backend="quanto")``
at the same bits, group size and residual beside each (quanto has no 8-bit layer): decode
ms/token and MiB at 1K and 4K tokens (every contender at every context takes its turn step by
step, ``eval.benchmarks.runner``), streaming perplexity over ``--ppl-tokens`` tokens (one token
per forward). Then the bytes each holds at 4,096 tokens against FullCache holding the same tokens
in bf16 (everything allocated counted: codes, zero points, scales, the residual, slot
positions; quanto's packed tensors by the tensors they hold), for a bf16 model (the target's
figure) and the fp32 model (its residual in fp32); ``--residuals`` adds rows (and perplexities)
for other residuals, KIVI's 128 by default. Then what re-quantising kept tokens costs (a stream in
chunks that window 256 trims at every chunk, beside the full cache, which never trims; each
against its native storage; ``--trim-tokens``). Then the needle task of ``eval.benchmarks.eviction``
(RULER's single needle, 1K and 2K prompts) for window 256 and SnapKV 256 in native and int4
storage. Last, the performance targets, each checked on the figures it rests on.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, QuantizedCache
from transformers.utils import is_optimum_quanto_available

from hf_kvpolicies import FullCache, SlidingWindowCache, SnapKVCache
from hf_kvpolicies.storage.quantized import DEFAULT_GROUP, DEFAULT_RESIDUAL

from ..data import embedded_text, tokenize
from ..perplexity import perplexity, streaming_nll
from .eviction import NEEDLE_LENGTHS, needle_scores
from .fp8 import synthetic_footprint
from .runner import Contender, arguments, run

PPL_VS_FULL = {8: 1.001, 4: 1.01, 2: 1.25}
MEMORY_VS_BF16 = {4: 0.33, 2: 0.21}
SPEED_VS_FULL = 1.5  # decode at the longest context
MEMORY_TOKENS = 4096
NEEDLE_BUDGET = 256
NEEDLE_SLACK = 1  # needles found may differ from native storage's by at most one


def ours(bits: int, residual: int = DEFAULT_RESIDUAL) -> Contender:
    label = f"int{bits}" + ("" if residual == DEFAULT_RESIDUAL else f" residual {residual}")
    return Contender(label, lambda model: FullCache(model, storage=f"int{bits}:residual={residual}"))


def quanto(bits: int, residual: int = DEFAULT_RESIDUAL) -> Contender:
    label = f"quanto int{bits}" + ("" if residual == DEFAULT_RESIDUAL else f" residual {residual}")
    return Contender(
        label,
        lambda model: QuantizedCache("quanto", model.config, nbits=bits, q_group_size=DEFAULT_GROUP, residual_length=residual),
    )


def contenders() -> list[Contender]:
    return [Contender("full", FullCache), ours(8), ours(4), quanto(4), ours(2), quanto(2)]


def memory_lines(model: PreTrainedModel, residuals: list[int]) -> tuple[list[str], dict[str, float]]:
    """Footprints at ``MEMORY_TOKENS`` tokens against FullCache holding them in bf16."""
    rows = [("int8", ours(8))] + [(c.label, c) for residual in [DEFAULT_RESIDUAL, *residuals] for c in (ours(4, residual), quanto(4, residual), ours(2, residual), quanto(2, residual))]
    base = synthetic_footprint(lambda: FullCache(model), model, torch.bfloat16, MEMORY_TOKENS)
    lines = [f"| at {MEMORY_TOKENS} tokens | MiB, bf16 model | vs FullCache in bf16 | MiB, fp32 model | vs FullCache in bf16 |", "|---|---|---|---|---|"]
    lines.append(f"| FullCache | {base / 2**20:.2f} | 1.000 | | |")
    ratios = {}
    for label, contender in rows:
        sizes = [synthetic_footprint(lambda: contender.make(model), model, dtype, MEMORY_TOKENS) for dtype in (torch.bfloat16, torch.float32)]
        ratios[label] = sizes[0] / base
        lines.append(f"| {label} | {sizes[0] / 2**20:.2f} | {sizes[0] / base:.3f} | {sizes[1] / 2**20:.2f} | {sizes[1] / base:.3f} |")
    return lines, ratios


def residual_lines(model: PreTrainedModel, tokenizer, residuals: list[int], ppl_tokens: int, full: Contender) -> list[str]:
    """Streaming perplexity of int4 and int2 at other residuals, beside the full cache's."""
    ids = tokenize(tokenizer, embedded_text(), ppl_tokens)
    base = full.figures[f"ppl ({ppl_tokens} tok)"]
    lines = [f"| other residuals | ppl ({ppl_tokens} tok) | vs full |", "|---|---|---|"]
    for contender in (c for residual in residuals for c in (ours(4, residual), ours(2, residual))):
        ppl = perplexity(streaming_nll(model, ids, contender.make(model), progress=False))
        lines.append(f"| {contender.label} | {ppl:.3f} | {ppl / base:.4f} |")
    return lines


def trim_lines(model: PreTrainedModel, tokenizer, tokens: int, chunk: int = 64) -> list[str]:
    """What re-quantising kept tokens costs: a stream fed in chunks of ``chunk``, so that every chunk
    over window 256's budget trims (its kept tokens decoded and quantised again in new groups),
    beside the full cache fed the same chunks (which never trims), each as a ratio to the same
    retention in native storage."""
    ids = tokenize(tokenizer, embedded_text(), tokens)
    lines = [f"| {tokens} tokens in chunks of {chunk} | native | int4 | int2 |", "|---|---|---|---|"]
    for label, make in (("full", FullCache), ("window 256 (trims every chunk)", lambda model, **kw: SlidingWindowCache(model, window=NEEDLE_BUDGET, **kw))):
        native = perplexity(streaming_nll(model, ids, make(model), chunk_size=chunk, progress=False))
        cells = [f"{native:.3f}"]
        for storage in ("int4", "int2"):
            ppl = perplexity(streaming_nll(model, ids, make(model, storage=storage), chunk_size=chunk, progress=False))
            cells.append(f"{ppl:.3f} ({ppl / native:.4f}x)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def needle_contenders() -> list[Contender]:
    window = {"window": NEEDLE_BUDGET}
    snapkv = SnapKVCache.budget_parameters(NEEDLE_BUDGET)
    return [
        Contender("window 256", lambda model: SlidingWindowCache(model, **window)),
        Contender("window 256 int4", lambda model: SlidingWindowCache(model, **window, storage="int4")),
        Contender("snapkv 256", lambda model: SnapKVCache(model, **snapkv)),
        Contender("snapkv 256 int4", lambda model: SnapKVCache(model, **snapkv, storage="int4")),
    ]


def found(line: str) -> int:
    """Needles found in a row of the needle table: its exact matches at each length, summed."""
    cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
    return sum(int(cell.split("/")[0]) for cell in cells[1 : 1 + len(NEEDLE_LENGTHS)])


def targets(results: dict[str, Contender], contexts: list[int], ppl_tokens: int, memory: dict[str, float], needles: list[str]) -> list[str]:
    """One line per performance target, with the figures it rests on."""

    def check(label: str, met: bool, target: str) -> str:
        return f"{label} ({'met' if met else 'MISSED'}, target {target})"

    full = results["full"].figures
    lines = []
    if ppl_tokens:
        key = f"ppl ({ppl_tokens} tok)"
        for bits, bound in PPL_VS_FULL.items():
            ratio = results[f"int{bits}"].figures[key] / full[key]
            lines.append(check(f"perplexity: int{bits} / full {ratio:.4f}", ratio <= bound, f"<= {bound}"))
        mine, theirs = results["int4"].figures[key], results["quanto int4"].figures[key]
        lines.append(check(f"perplexity: int4 {mine:.3f}, quanto int4 {theirs:.3f}", mine <= theirs, "no worse than quanto"))
    for bits, bound in MEMORY_VS_BF16.items():
        ratio = memory[f"int{bits}"]
        lines.append(check(f"memory at {MEMORY_TOKENS} tokens, all allocated: int{bits} / bf16 full {ratio:.3f}", ratio <= bound, f"<= {bound}"))
    if contexts:
        longest = f"ms/token @{max(contexts)}"
        for bits in (8, 4, 2):
            ratio = results[f"int{bits}"].figures[longest] / full[longest]
            lines.append(check(f"decode @{max(contexts)}: int{bits} / full {ratio:.2f}x", ratio <= SPEED_VS_FULL, f"<= {SPEED_VS_FULL}"))
        for bits in (4, 2):
            for context in contexts:
                key = f"ms/token @{context}"
                ratio = results[f"int{bits}"].figures[key] / results[f"quanto int{bits}"].figures[key]
                lines.append(check(f"decode @{context}: int{bits} / quanto int{bits} {ratio:.2f}x", ratio < 1, "< 1"))
    if needles:
        counts = {line.split("|")[1].strip(): found(line) for line in needles if line.startswith("| ") and "@" not in line}
        for policy in ("window 256", "snapkv 256"):
            native, quantised = counts[policy], counts[f"{policy} int4"]
            lines.append(check(f"needles: {policy} int4 finds {quantised}, native {native}", abs(quantised - native) <= NEEDLE_SLACK, f"within {NEEDLE_SLACK}"))
    return lines


QUANTO_MISSING = (
    "the integer storage benchmark sets transformers' QuantizedCache(backend='quanto') beside each format, which "
    "needs optimum-quanto: pip install 'hf-kvpolicies[bench]' (or pip install optimum-quanto)"
)


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__.splitlines()[0], contexts=(1024, 4096))
    parser.add_argument("--residuals", type=int, nargs="*", default=[128], help="other residuals: perplexity and bytes (KIVI's 128)")
    parser.add_argument("--needle-cases", type=int, default=40, help="needle prompts, split over 1K and 2K (0: skip)")
    parser.add_argument("--trim-tokens", type=int, default=2000, help="tokens of the trim-cost streams (0: skip)")
    args = parser.parse_args(argv)
    if not is_optimum_quanto_available():  # before minutes of work, not at the first quanto contender
        parser.error(QUANTO_MISSING)
    from hf_kvpolicies.models import load_model

    chosen = contenders()
    results = {c.label: c for c in run(chosen, args.ppl_tokens, args.contexts, steps=args.steps, model_name=args.model, rounds=args.rounds)}
    model, tokenizer = load_model(args.model)
    if args.residuals and args.ppl_tokens:
        print("\n" + "\n".join(residual_lines(model, tokenizer, args.residuals, args.ppl_tokens, results["full"])))
    lines, memory = memory_lines(model, args.residuals)
    print("\n" + "\n".join(lines))
    if args.trim_tokens:
        print("\n" + "\n".join(trim_lines(model, tokenizer, args.trim_tokens)))
    needles = []
    if args.needle_cases:
        haystack = tokenize(tokenizer, embedded_text()[-200_000:], start=False)
        needles = needle_scores(model, tokenizer, needle_contenders(), args.needle_cases, haystack)
        print(f"\nneedle (niah_single, 7 digits, question at the end, prefilled at once), budget {NEEDLE_BUDGET}:")
        print("\n".join(needles))
    print(f"\nint storage: group {DEFAULT_GROUP}, residual {DEFAULT_RESIDUAL}, keys per channel, values per token")
    print("\n".join(targets(results, sorted(args.contexts), args.ppl_tokens, memory, needles)))


if __name__ == "__main__":
    main()
