"""GPU decode benchmark: every policy eager and compiled against DynamicCache and compiled StaticCache.

    python -m eval.benchmarks.gpu                       # on a CUDA machine: the full table
    python -m eval.benchmarks.gpu --tiny --device cpu   # every code path on a tiny model (what the tests run)
    python -m eval.benchmarks.gpu --cpu                 # the embedded SmolLM2-135M on the CPU, 1K and 4K tokens

On a GPU, launching kernels, not arithmetic, is the cost of a small-batch decode step; a cache
whose decode step has static shapes compiles (``torch.compile``, CUDA graphs) and removes it.
This measures, for models of real shapes built from configs with random weights (no download;
random weights time exactly like trained ones), decode ms/token at each context for:
``DynamicCache`` (eager), ``StaticCache`` (compiled, as ``generate()`` compiles it), and every
policy at each budget, eager and, where its cache declares ``is_compileable``, compiled (the
caches that keep every token, full and FP8, pre-sized with ``max_length`` as ``StaticCache`` is). Timing
is synchronised step by step; memory is ``torch.cuda.max_memory_allocated`` above the weights.
Ratios are to ``DynamicCache`` and to compiled ``StaticCache`` at the same context.

Before the timings, each shape's table of aten operations per eager decode step
(:mod:`eval.benchmarks.ops`): the launches compiling removes, counted, so a CPU run shows them too.
Without CUDA (and without ``--device cpu``) it says so in one line and exits 0. ``--max-minutes``
(default 8) stops starting new measurements once the time is spent and lists what was skipped.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)
from transformers.cache_utils import Cache

from hf_kvpolicies import available_policies, from_spec
from hf_kvpolicies.models import load_model
from hf_kvpolicies.specs import policy_constructor

from ..budgets import expand
from ..speed import prefill, synchronize
from . import ops

SHAPES: dict[str, Callable[[], PreTrainedModel]] = {
    "llama3-8b": lambda: LlamaForCausalLM(
        LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        )
    ),
    "qwen2.5-7b": lambda: Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072, rope_theta=1000000.0,
        )
    ),
    "smollm2": lambda: load_model()[0],
    "tiny": lambda: LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096,
        )
    ),
}
"""Model shapes of Llama-3-8B and Qwen2.5-7B (their published configs' sizes), the embedded
SmolLM2-135M (trained weights, for CPU figures), and a tiny one."""
HEADROOM = 64
"""Slots beyond the context for pre-sized caches (StaticCache, full, FP8): warm-up plus timed steps."""

@dataclass
class Row:
    label: str
    context: int
    ms: float | None
    """Median decode ms/token; ``None`` where the cache cannot be compiled."""
    peak_mib: float | None = None
    note: str = ""


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=["llama3-8b", "qwen2.5-7b"], choices=sorted(SHAPES))
    parser.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384, 32768])
    parser.add_argument("--budgets", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--policies", nargs="*", default=None, help="registered policy names (default: all)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps (compilation happens here)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--mode", default="reduce-overhead", help="torch.compile mode (CUDA graphs by default)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend ('eager' to test paths)")
    parser.add_argument("--max-minutes", type=float, default=8.0)
    parser.add_argument("--tiny", action="store_true", help="tiny shape, short contexts: check every code path")
    parser.add_argument("--progress", action="store_true", help="print each measurement as it is made")
    parser.add_argument("--cpu", action="store_true", help="the embedded SmolLM2-135M on the CPU (fp32, inductor), "
                        "contexts 1K and 4K, budget 256: the CPU figures of compiled decoding")
    return parser


def contenders(policies: list[str], budgets: list[int]) -> list[tuple[str, Callable[[PreTrainedModel, int], Cache]]]:
    """(label, make(model, context)) for every cache to time, eager ones before compiled ones."""
    made: list[tuple[str, Callable[[PreTrainedModel, int], Cache]]] = [
        ("DynamicCache", lambda model, context: DynamicCache(config=model.config)),
        ("StaticCache", lambda model, context: StaticCache(config=model.config, max_cache_len=context + HEADROOM)),
    ]
    for run in expand(list(policies), tuple(budgets)):  # each bounded policy at each budget, as the sweep builds it
        if run.budget is None:  # keeps every token: once per context, pre-sized where it can be
            presized = "max_length" in inspect.signature(policy_constructor(run.policy)).parameters
            made.append((run.policy, lambda model, context, name=run.policy, presized=presized: from_spec(
                model, f"{name}:max_length={context + HEADROOM}" if presized else name)))
            continue
        spec = run.spec(run.budget)
        made.append((spec, lambda model, context, spec=spec: from_spec(model, spec)))
    return made


@torch.no_grad()
def time_decode(
    model: PreTrainedModel, cache: Cache, ids: torch.Tensor, context: int, steps: int, warmup: int, step_call
) -> list[float]:
    """Prefill ``context`` tokens (eager, in chunks), then ms of each greedy decode step via ``step_call``."""
    logits = prefill(model, ids[:, :context], cache, chunk=4096)
    token = logits.argmax(-1, keepdim=True)
    position = torch.full((1, 1), context, dtype=torch.long, device=model.device)
    times = []
    for step in range(warmup + steps):
        synchronize(model.device)
        start = time.perf_counter()
        out = step_call(input_ids=token, cache=cache, position_ids=position, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        synchronize(model.device)
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
        position = position + 1
    return times


def measure(args: argparse.Namespace, shape: str, deadline: float, skipped: list[str]) -> list[Row]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = SHAPES[shape]().to(dtype).eval()
    model.set_attn_implementation("sdpa")
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, max(args.contexts) + 2), device=device)  # the operation count decodes two steps
    policies = args.policies or [name for name in available_policies()]
    context = min(args.contexts)  # the launch budget first: a count, the same on every machine
    counts = ops.count(model, ids, context, min(args.budgets), policies)
    print(f"**{shape}: aten operations per eager decode step**\n\n{ops.table(counts, model.config.num_hidden_layers, context)}\n", flush=True)
    rows = []
    for context in args.contexts:
        for label, make in contenders(policies, args.budgets):
            for compile_it in (False, True):
                if label == "StaticCache" and not compile_it:
                    continue  # transformers compiles it; eager StaticCache is not a contender
                if label == "DynamicCache" and compile_it:
                    continue  # not compileable (generate() never compiles it)
                name = f"{label} compiled" if compile_it else label
                if time.monotonic() > deadline:
                    skipped.append(f"{shape} {name} @{context}")
                    continue
                try:
                    cache = make(model, context)
                except ValueError as error:  # a policy that cannot serve this model says why
                    rows.append(Row(name, context, None, note=f"refused: {str(error).splitlines()[0][:80]}"))
                    continue
                if compile_it and not cache.is_compileable:
                    rows.append(Row(name, context, None, note="is_compileable is False"))
                    continue
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                step_call = model.forward
                if compile_it:
                    torch._dynamo.reset()  # each compiled cache gets its own graphs, not a shared recompile budget
                    step_call = torch.compile(model.forward, fullgraph=True, backend=args.backend,
                                              mode=args.mode if args.backend == "inductor" else None)
                try:
                    times = time_decode(model, cache, ids, context, args.steps, args.warmup, step_call)
                except (RuntimeError, ValueError, NotImplementedError) as error:
                    rows.append(Row(name, context, None, note=f"failed: {str(error).splitlines()[0][:80]}"))
                    continue
                peak = (torch.cuda.max_memory_allocated(device) - weights) / 2**20 if device.type == "cuda" else None
                rows.append(Row(name, context, statistics.median(times), peak))
                if args.progress:
                    print(f"  {shape} {name} @{context}: {rows[-1].ms:.2f} ms/token", flush=True)
                del cache
    return rows


def table(shape: str, rows: list[Row]) -> str:
    """Markdown table with ratios to DynamicCache and to compiled StaticCache at the same context."""
    lines = [
        f"**{shape}**", "",
        "| cache | context | ms/token | vs DynamicCache | vs StaticCache compiled | peak MiB above weights |",
        "|---|---|---|---|---|---|",
    ]
    reference = {(row.label, row.context): row.ms for row in rows}
    for row in rows:
        if row.ms is None:
            lines.append(f"| {row.label} | {row.context} | n/a ({row.note}) | | | |")
            continue
        ratios = []
        for base in ("DynamicCache", "StaticCache compiled"):
            value = reference.get((base, row.context))
            ratios.append(f"{row.ms / value:.2f}x" if value else "")
        peak = "" if row.peak_mib is None else f"{row.peak_mib:.0f}"
        lines.append(f"| {row.label} | {row.context} | {row.ms:.2f} | {ratios[0]} | {ratios[1]} | {peak} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    if args.tiny:
        args.shapes, args.contexts, args.budgets, args.steps, args.warmup = ["tiny"], [64], [16], 4, 2
    if args.cpu:  # the preset's values, where the command line left the defaults
        defaults = arguments().parse_args([])
        preset = dict(shapes=["smollm2"], contexts=[1024, 4096], budgets=[256], device="cpu", dtype="float32",
                      mode="default", steps=16, max_minutes=60.0)
        for key, value in preset.items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"eval.benchmarks.gpu: no CUDA device visible to torch {torch.__version__}; nothing measured "
              "(run it on a GPU machine, or --tiny --device cpu to check the code paths)")
        return 0
    deadline = time.monotonic() + 60 * args.max_minutes
    skipped: list[str] = []
    for shape in args.shapes:
        print(table(shape, measure(args, shape, deadline, skipped)), "\n", flush=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{device_name}, torch {torch.__version__}, {args.dtype}, compile mode {args.mode!r} backend "
          f"{args.backend!r}, {args.steps} timed steps after {args.warmup} warm-up, median ms/token")
    if skipped:
        print(f"skipped (--max-minutes {args.max_minutes} spent): {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
