"""FP8 storage benchmark: memory, decode speed and streaming perplexity against full precision.

    python -m eval.benchmarks.fp8

One process, the embedded model and text. First the float8 decoders this storage could use, timed
on one layer's keys and values at 2K tokens (the cost every decode step pays per layer) and
checked bit for bit against PyTorch's own conversion. Then one table for FullCache (the base of
the ratios), FP8Cache, SinkCache with native and fp8 storage, and transformers'
``QuantizedCache(backend="fp8")`` (one per-tensor scale frozen at the first update: the anchor
to beat): decode ms/token and MiB at each context, streaming perplexity (one token per forward,
the cache never reset). Then the footprint against the same cache held in bf16, and the thresholds,
each checked on the figures it rests on and printed with its reason.

``--residual-sweep 0 8 32 128`` adds the measurement the default residual was chosen from: after
a 1K prefill, 300 teacher-forced decode steps per residual, KL divergence and NLL against
FullCache on the same tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel, QuantizedCache
from transformers.cache_utils import Cache

from hf_kvpolicies import from_spec
from hf_kvpolicies.storage.fp8 import DEFAULT_RESIDUAL, float8_format

from ..memory import footprint
from .runner import Contender, arguments, contender, run
from .thresholds import Threshold, reasons

MEMORY_VS_BF16 = Threshold(0.55, (
    "FP8Cache's bytes / a bf16 FullCache's, everything included, at the longest context: fp8 halves each key and "
    "value, and the per-token scales and the native residual may add at most a tenth of that half"
))
PPL_VS_FULL = Threshold(1.01, "streaming perplexity of FP8Cache / FullCache's: fp8 storage is meant to be near-lossless, within 1%")
SPEED_VS_FULL = Threshold(1.5, (
    "decode ms/token of FP8Cache / FullCache's at 2K tokens on the CPU: dequantising at every step costs time, but the "
    "halved memory must not be bought with most of the speed"
))
NOT_WORSE = Threshold(1.0, (
    "streaming perplexity of FP8Cache / transformers' QuantizedCache('fp8')'s (one per-tensor scale frozen at the "
    "first update): the storage must be at least as accurate as the fp8 cache transformers ships"
))
SPEED_CONTEXT = 2048


def contenders() -> list[Contender]:
    return [
        contender("full"),
        contender("fp8"),
        contender("sink:storage=native", label="sink 4+1020"),  # the defaults: 4 sinks + a 1020-token window
        contender("sink:storage=fp8", label="sink 4+1020 fp8"),
        Contender("transformers fp8", lambda m: QuantizedCache("fp8", m.config)),
    ]


# --- float8 decoding ---------------------------------------------------------------------------
def decoders(fmt) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Ways to turn a payload of fp8 bytes (int8) and E8M0 scale codes into float32."""
    table = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()

    def scale(codes: torch.Tensor) -> torch.Tensor:
        return (codes.to(torch.int32) << 23).view(torch.float32)  # 2**(code - 127), exactly

    def stock(payload, codes):
        return payload.view(fmt.dtype).float().mul_(scale(codes))

    def lookup(payload, codes):
        values = table.index_select(0, payload.reshape(-1).view(torch.uint8).to(torch.int32)).view(payload.shape)
        return values.mul_(scale(codes))

    return {
        "tensor.to(float32) (stock)": stock,
        "256-entry table, index_select": lookup,
        "bit manipulation via float16 (used)": lambda payload, codes: fmt.dequantise(payload, codes, torch.float32),
    }


def decoder_table(heads: int, head_dim: int, tokens: int = SPEED_CONTEXT, repeats: int = 20) -> str:
    fmt = float8_format("float8_e4m3fn")
    x = torch.randn(2, 1, heads, tokens, head_dim)
    payload, codes = fmt.quantise(x)
    reference = None
    lines = [
        f"| float8 -> float32, keys+values of one layer at {tokens} tokens | ms (best of 5) | exact |",
        "|---|---|---|",
    ]
    for label, decode in decoders(fmt).items():
        out = decode(payload, codes)
        reference = out if reference is None else reference
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                decode(payload, codes)
            best = min(best, (time.perf_counter() - start) / repeats)
        lines.append(f"| {label} | {best * 1e3:.3f} | {torch.equal(out, reference)} |")
    return "\n".join(lines)


# --- memory against bf16 -----------------------------------------------------------------------
def synthetic_footprint(make: Callable[[], Cache], model: PreTrainedModel, dtype: torch.dtype, tokens: int) -> int:
    """Footprint after ``tokens`` keys/values of ``dtype`` reach every layer in 1024-token chunks
    (as the benchmark's prefill sends them): the same capacity growth, no forward needed."""
    config = model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = make()
    for start in range(0, tokens, 1024):
        chunk = torch.randn(1, heads, min(1024, tokens - start), head_dim).to(dtype)
        for index in range(len(cache.layers)):
            cache.update(chunk, chunk, index)
    return footprint(cache)


def memory_lines(model: PreTrainedModel, tokens: int) -> tuple[list[str], float]:
    bf16_full = synthetic_footprint(lambda: from_spec(model, "full"), model, torch.bfloat16, tokens)
    rows = [
        ("FP8Cache, fp32 model (residual in fp32)", lambda: from_spec(model, "fp8"), torch.float32),
        ("FP8Cache, bf16 model", lambda: from_spec(model, "fp8"), torch.bfloat16),
        ("FullCache, fp32 model", lambda: from_spec(model, "full"), torch.float32),
    ]
    lines = [f"| at {tokens} tokens | MiB | vs FullCache in bf16 |", "|---|---|---|"]
    lines.append(f"| FullCache, bf16 model | {bf16_full / 2**20:.2f} | 1.000 |")
    worst = 0.0
    for label, make, dtype in rows:
        size = synthetic_footprint(make, model, dtype, tokens)
        lines.append(f"| {label} | {size / 2**20:.2f} | {size / bf16_full:.3f} |")
        if label.startswith("FP8Cache"):
            worst = max(worst, size / bf16_full)
    return lines, worst


# --- the residual ------------------------------------------------------------------------------
@torch.no_grad()
def residual_sweep(
    model: PreTrainedModel, ids: torch.Tensor, residuals: Sequence[int], prefill: int = 1024, steps: int = 300
) -> str:
    """KL(full || fp8) and NLL over ``steps`` teacher-forced decode steps after a ``prefill``."""

    def log_probs(cache: Cache) -> torch.Tensor:
        model(ids[:, :prefill], cache=cache, use_cache=True)
        rows = [
            torch.log_softmax(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[0, -1].float(), -1)
            for t in range(prefill, prefill + steps)
        ]
        return torch.stack(rows)

    targets = ids[0, prefill + 1 : prefill + steps + 1]

    def nll(lp: torch.Tensor) -> float:
        return float(-lp[torch.arange(steps), targets].mean())

    reference = log_probs(from_spec(model, "full"))
    lines = [
        f"| residual | KL(full, fp8) mean | KL max | NLL - full NLL | top-1 agreement | ({steps} steps after {prefill}) |",
        "|---|---|---|---|---|---|",
    ]
    for residual in residuals:
        lp = log_probs(from_spec(model, f"fp8:residual={residual}"))
        kl = (reference.exp() * (reference - lp)).sum(-1)
        agree = float((lp.argmax(-1) == reference.argmax(-1)).float().mean())
        lines.append(f"| {residual} | {kl.mean():.2e} | {kl.max():.2e} | {nll(lp) - nll(reference):+.4f} | {agree:.3f} | |")
    return "\n".join(lines)


# --- targets -----------------------------------------------------------------------------------
def targets(results: list[Contender], contexts: list[int], ppl_tokens: int, memory_ratio: float) -> list[str]:
    """One line per threshold checked, with the figures it rests on."""
    full, fp8, _, _, anchor = (c.figures for c in results)
    lines = [MEMORY_VS_BF16.check(f"memory, all included: fp8 / bf16 full {memory_ratio:.3f}", memory_ratio)]
    if SPEED_CONTEXT in contexts:
        key = f"ms/token @{SPEED_CONTEXT}"
        ratio = fp8[key] / full[key]
        lines.append(SPEED_VS_FULL.check(f"decode @{SPEED_CONTEXT}: fp8 / full {ratio:.2f}x", ratio, " on the CPU"))
    if ppl_tokens:
        key = f"ppl ({ppl_tokens} tok)"
        ratio = fp8[key] / full[key]
        lines.append(PPL_VS_FULL.check(f"perplexity: fp8 / full {ratio:.4f}", ratio))
        lines.append(NOT_WORSE.check(f"perplexity: fp8 {fp8[key]:.3f}, transformers fp8 {anchor[key]:.3f}", fp8[key] / anchor[key]))
    return lines


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--residual-sweep", type=int, nargs="*", default=[], help="residuals to compare (KL vs full)")
    args = parser.parse_args()
    from hf_kvpolicies.models import load_model

    from ..data import embedded_text, tokenize

    model, tokenizer = load_model(args.model)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    print(decoder_table(config.num_key_value_heads, head_dim), "\n")
    if args.residual_sweep:
        print(residual_sweep(model, tokenize(tokenizer, embedded_text(), 1400), args.residual_sweep), "\n")
    results = run(contenders(), args.ppl_tokens, args.contexts, steps=args.steps, model_name=args.model, rounds=args.rounds)
    longest = max(args.contexts, default=4096)
    lines, ratio = memory_lines(model, longest)
    print("\n" + "\n".join(lines))
    print(f"\nfp8: e4m3fn, power-of-two scale per token and KV head, residual {DEFAULT_RESIDUAL} native tokens")
    print("\n".join(targets(results, args.contexts, args.ppl_tokens, ratio)))
    named = [("memory / bf16", MEMORY_VS_BF16), ("decode / full", SPEED_VS_FULL), ("perplexity / full", PPL_VS_FULL), ("perplexity / transformers fp8", NOT_WORSE)]
    print("thresholds:\n" + "\n".join(reasons(named)))


if __name__ == "__main__":
    main()
