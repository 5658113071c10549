"""``hf-kvpolicies``: ``eval`` runs a sweep of cache policies x measurements, ``report`` re-renders it.

Bad input exits with status 2 and one line that names the problem and the fix.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path

from .data import DATASETS, EMBEDDED_TEXT, DataError, check_dataset
from .records import RESULTS, read_records
from .stream import DEFAULT_CHUNK
from .sweep import DEFAULT_POLICIES, DTYPES, TASKS, Settings, UsageError

PROG = "hf-kvpolicies"
EVAL_EXAMPLES = f"""\
examples:
  # the default sweep: embedded SmolLM2-135M and text, full/window/sink/h2o/fp8, every task
  {PROG} eval --out results
  # fast mode: perplexity only, 4,000 tokens, 512 per forward (exact for these two policies)
  {PROG} eval --policy full --policy "sink:sink_tokens=4,window=1020,positions=absolute" --task perplexity --tokens 4000 --chunk-size 512
  # a Hub model on a GPU, on WikiText-2
  {PROG} eval --model Qwen/Qwen2.5-0.5B --dataset wikitext2 --device cuda --dtype bfloat16 --out results-qwen
  # any local text, offline
  {PROG} eval --text-file book.txt --task perplexity --tokens 2000
  # split the sweep over 2 processes (CPU: torchrun-style processes; the records are those of one process)
  accelerate launch --multi_gpu --num_processes 2 -m eval.cli eval --device cpu --out results

policy specs are NAME[:key=value,...] with the constructor's keywords, e.g. "window:window=256",
"h2o:heavy=128,recent=128", "sink:sink_tokens=4,window=252,positions=cache", "full:storage=fp8".
"""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit 2 (argparse prints usage first)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value}")
    return value


def _dataset(text: str) -> str:
    try:
        return check_dataset(text)
    except DataError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> Parser:
    defaults = Settings()
    parser = Parser(prog=PROG, description="Evaluate KV-cache policies: perplexity, memory, speed and recall.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="{eval,report}")
    run = commands.add_parser(
        "eval",
        help="run policies x tasks and write results.jsonl, tables and plots",
        description="Run every --policy on every --task on the same tokens. Results go to --out/results.jsonl\n"
        "(runs already there are skipped, so an interrupted sweep resumes), with summary tables and plots.",
        epilog=EVAL_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--model", default=defaults.model, help="embedded name (smollm2-135m, gemma3-270m), Hub id or local folder (default: %(default)s); e.g. --model Qwen/Qwen2.5-0.5B")
    run.add_argument("--gguf-file", help="GGUF file inside --model to load, e.g. --gguf-file model-q8_0.gguf")
    source = run.add_mutually_exclusive_group()
    source.add_argument("--dataset", type=_dataset, default=EMBEDDED_TEXT, help=f"text to evaluate on: {', '.join(DATASETS)} (default: {EMBEDDED_TEXT}, CPython's pydoc topics, offline; the others load from the Hub through datasets), e.g. --dataset wikitext2")
    source.add_argument("--text-file", help="a local UTF-8 text file instead of --dataset (works offline), e.g. --text-file book.txt")
    run.add_argument("--policy", action="append", metavar="SPEC", help=f"policy spec, repeatable (default: {' '.join(DEFAULT_POLICIES)}); e.g. --policy full --policy window:window=512")
    run.add_argument("--task", action="append", choices=TASKS, help="measurement, repeatable (default: all); e.g. --task perplexity --task memory")
    run.add_argument("--tokens", type=_integer(2), default=defaults.tokens, help="tokens of the perplexity and memory stream (default: %(default)s); e.g. --tokens 4000")
    run.add_argument("--chunk-size", type=_integer(1), help=f"tokens per forward in the stream and passkey prompts; exact (same result as 1) for full, window and sink positions=absolute, approximate and labelled so for the others (default: {DEFAULT_CHUNK} where exact, 1 elsewhere); e.g. --chunk-size 512")
    run.add_argument("--contexts", type=_integer(1), nargs="+", default=list(defaults.contexts), metavar="N", help="context lengths of the speed task (default: %(default)s); e.g. --contexts 1024 4096")
    run.add_argument("--steps", type=_integer(1), default=defaults.steps, help="timed decode steps per context (default: %(default)s); e.g. --steps 32")
    run.add_argument("--passkey-lengths", type=_integer(1), nargs="+", default=list(defaults.passkey_lengths), metavar="N", help="passkey prompt lengths in tokens (default: %(default)s); e.g. --passkey-lengths 1024 4096")
    run.add_argument("--passkey-depths", type=_fraction, nargs="+", default=list(defaults.passkey_depths), metavar="D", help="depths of the passkey in the filler, 0 = start, 1 = end (default: %(default)s); e.g. --passkey-depths 0 0.5 1")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default=defaults.device, help="where to run (default: %(default)s: cuda if available); e.g. --device cpu")
    run.add_argument("--dtype", choices=("auto", *DTYPES), default=defaults.dtype, help="model dtype (default: %(default)s: float32 on CPU, bfloat16 on CUDA); e.g. --dtype float16")
    run.add_argument("--device-map", help="spread a large model over the GPUs with accelerate, e.g. --device-map auto")
    run.add_argument("--attn-implementation", help="attention kernel of the model (default: the model's, sdpa); e.g. --attn-implementation eager")
    run.add_argument("--threads", type=_integer(1), help="CPU threads for torch (default: torch's choice, one per core); on a busy shared machine 1 avoids OpenMP's spin-waiting, e.g. --threads 1")
    run.add_argument("--seed", type=int, default=defaults.seed, help="seed of the passkey prompts (default: %(default)s); e.g. --seed 1")
    run.add_argument("--out", type=Path, default=defaults.out, help="output folder (default: %(default)s); e.g. --out results-gpu")
    run.add_argument("--no-progress", action="store_true", help="no progress bars, for logs and CI; e.g. --no-progress")
    report = commands.add_parser(
        "report",
        help="re-render tables and plots from DIR/results.jsonl",
        description="Re-render summary.md/.csv/.tex and the PNG plots from DIR/results.jsonl alone.",
        epilog=f"example:\n  {PROG} report results",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("dir", type=Path, metavar="DIR", help="a folder written by hf-kvpolicies eval --out DIR")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    """The sweep's settings from the options of the same names (lists become tuples)."""
    named = {field.name: getattr(args, field.name) for field in fields(Settings) if field.name != "progress"}
    values = {name: tuple(value) if isinstance(value, list) else value for name, value in named.items()}
    return Settings(**values, progress=not args.no_progress)


def _eval(args: argparse.Namespace) -> int:
    from .sweep import check_policies, default_policies, run_sweep

    def note(message: str) -> None:
        print(message, file=sys.stderr)

    policies = check_policies(args.policy) if args.policy else default_policies(note)
    tasks = list(dict.fromkeys(args.task)) if args.task else list(TASKS)
    if args.no_progress:
        _quiet_libraries()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    sweep = run_sweep(_settings(args), policies, tasks)
    if sweep.complete:
        print(sweep.table, end="")
        print(f"\nresults, tables and plots in {args.out}/ ({RESULTS}, summary.md/.csv/.tex, *.png)")
    else:
        note(f"this process ran {len(sweep.ran)} of {len(sweep.jobs)} runs; the process that finishes last writes the report")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import write_report

    records = read_records(args.dir / RESULTS)
    if not records:
        raise UsageError(f"no records in {args.dir / RESULTS}: run `{PROG} eval --out {args.dir}` first")
    print(write_report(args.dir, records), end="")
    return 0


def _quiet_libraries() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _eval(args) if args.command == "eval" else _report(args)
    except (UsageError, DataError) as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
