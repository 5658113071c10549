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
from .protocols import DEFAULT_PROTOCOLS, PROTOCOLS
from .qa import is_qa_dataset
from .recall import TASKS as RECALL_TASKS
from .recall import parse_task
from .records import RESULTS
from .settings import DEFAULT_POLICIES, DEFAULT_TASKS, Settings, UsageError
from .stream import DEFAULT_CHUNK
from .sweep import DTYPES
from .tasks import TASKS, check_task_name

PROG = "hf-kvpolicies"
EVAL_EXAMPLES = f"""\
examples:
  # the default sweep: embedded SmolLM2-135M and text; full, FP8, and window/sink/H2O at budgets 64 and 128;
  # perplexity, memory and the recall suite (niah_single, niah_multikey, passkey) at 512 tokens, streamed and prefill
  {PROG} eval --out results
  # the full frontier: every registered policy family at four budgets, three protocols, three seeds
  {PROG} eval --policy full --policy window --policy sink:positions=absolute --policy h2o --policy fp8 \\
      --budgets 64 128 256 512 --lengths 1024 2048 --seeds 0 1 2 --protocol streamed --protocol prefill --protocol context \\
      --task perplexity --task memory --task niah_single --task niah_multikey --task niah_multivalue \\
      --task niah_multiquery --task vt --task cwe --out results-frontier
  # fractions of the context kept instead of budgets, kvpress's protocol
  {PROG} eval --ratios 0.5 0.25 0.125 --protocol context --task niah_single --out results-ratios
  # long-document QA from a local JSONL of {{context, input, answers}} (or --dataset longbench:qasper with the Hub)
  {PROG} eval --dataset qa.jsonl --task qa --out results-qa
  # one context, several questions: 4 needles asked in turn of one cache, and each of its own copy, in the chat template
  {PROG} eval --policy full --policy snapkv --policy kvzip --budgets 256 --lengths 2048 --task niah_multiturn:turns=4 \
      --protocol multiturn --protocol multiquery --chat-template --out results-turns
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
A bare spec ("window") is swept over --budgets; a spec that sets its budget keeps it.
"""

EXPORT_EXAMPLES = f"""\
examples:
  # the default run's recall tasks at 512 tokens for the embedded model's tokenizer, then one of them through lm-eval
  {PROG} export-lm-eval lm-tasks
  {PROG} lm-eval --model hf-kvpolicies --model_args pretrained=smollm2-135m,policy=window:window=128 \\
      --include_path lm-tasks --tasks kvp_passkey_512 --output_path runs/lm-eval
  # two recall tasks at two lengths, three seeds; a QA JSONL adds the task kvp_qa
  {PROG} export-lm-eval lm-tasks --task niah_single --task vt --lengths 1024 2048 --seeds 0 1 2 --dataset qa.jsonl
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
    if is_qa_dataset(text):
        return text
    try:
        return check_dataset(text)
    except DataError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _ratio(text: str) -> float:
    value = _fraction(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError("must be a fraction in (0, 1], got 0")
    return value


def _recall_task(text: str) -> str:
    try:
        parse_task(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _task(text: str) -> str:
    try:
        return check_task_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _check_loading_options(args: argparse.Namespace) -> None:
    """``--attn-implementation`` and ``--device-map`` checked before the model loads, so that a
    bad value is blamed on the option, not on the model."""
    from transformers import AttentionInterface

    known = ["eager", *AttentionInterface().valid_keys()]
    name = args.attn_implementation
    if name is not None and name not in known and "/" not in name:  # "/": a kernel from the Hub
        raise UsageError(f"--attn-implementation {name!r} is not an attention implementation: choose one of {', '.join(known)}")
    device_map = args.device_map
    if device_map is not None and device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        import torch

        try:
            torch.device(device_map)
        except RuntimeError:
            raise UsageError(
                f"--device-map {device_map!r} is neither a strategy (auto, balanced, balanced_low_0, sequential) nor a device (cpu, cuda, cuda:1)"
            ) from None


def _input_options(parser: argparse.ArgumentParser, defaults: Settings) -> None:
    """The model and the text (or QA dataset), shared by ``eval`` and ``export-lm-eval``."""
    parser.add_argument("--model", default=defaults.model, help="embedded name (smollm2-135m, gemma3-270m), Hub id or local folder (default: %(default)s); e.g. --model Qwen/Qwen2.5-0.5B")
    parser.add_argument("--gguf-file", help="GGUF file inside --model to load, e.g. --gguf-file model-q8_0.gguf")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--dataset", type=_dataset, default=EMBEDDED_TEXT, help=f"text to evaluate on: {', '.join(DATASETS)} (default: {EMBEDDED_TEXT}, CPython's pydoc topics, offline; the others load from the Hub through datasets), or a QA dataset for --task qa: longbench:SUBSET (THUDM/LongBench) or a JSONL file of {{context, input, answers}} rows, whose contexts are then the text; e.g. --dataset wikitext2, --dataset longbench:qasper")
    source.add_argument("--text-file", help="a local UTF-8 text file instead of --dataset (works offline), e.g. --text-file book.txt")


def _recall_options(parser: argparse.ArgumentParser, defaults: Settings) -> None:
    """The recall cases' lengths, depths and seeds, shared by ``eval`` and ``export-lm-eval``."""
    parser.add_argument("--lengths", type=_integer(1), nargs="+", default=list(defaults.lengths), metavar="N", help="recall prompt lengths in tokens, context and question (default: %(default)s); e.g. --lengths 1024 2048 4096")
    parser.add_argument("--depths", type=_fraction, nargs="+", default=list(defaults.depths), metavar="D", help="depths of the needles in the haystack, 0 = start, 1 = end (default: %(default)s); e.g. --depths 0 0.25 0.5 0.75 1")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(defaults.seeds), metavar="S", help="seeds of the recall cases: each seed is an independent sample; tables give mean +- 95%% bootstrap intervals over the cells (default: %(default)s); e.g. --seeds 0 1 2")


def _qa_options(parser: argparse.ArgumentParser, defaults: Settings) -> None:
    """The QA samples and their longest prompt, shared by ``eval`` and ``export-lm-eval``."""
    parser.add_argument("--qa-samples", type=_integer(1), default=defaults.qa_samples, help="QA samples evaluated (default: %(default)s); e.g. --qa-samples 100")
    parser.add_argument("--qa-max-tokens", type=_integer(32), default=defaults.qa_max_tokens, help="longest QA prompt; longer documents lose their middle, as LongBench truncates (default: %(default)s); e.g. --qa-max-tokens 4096")


def build_parser() -> Parser:
    defaults = Settings()
    parser = Parser(prog=PROG, description="Evaluate KV-cache policies: perplexity, memory, speed and recall.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="{eval,report,lm-eval,export-lm-eval}")
    run = commands.add_parser(
        "eval",
        help="run policies x tasks and write results.jsonl, tables and plots",
        description="Run every --policy on every --task on the same tokens. Results go to --out/results.jsonl\n"
        "(runs already there are skipped, so an interrupted sweep resumes), with summary tables and plots.",
        epilog=EVAL_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _input_options(run, defaults)
    run.add_argument("--policy", action="append", metavar="SPEC", help=f"policy spec, repeatable (default: {' '.join(DEFAULT_POLICIES)}); e.g. --policy full --policy window:window=512")
    run.add_argument("--task", action="append", type=_task, metavar="TASK", help=f"measurement, repeatable: {'; '.join(task.summary for task in TASKS)}. Default: {' '.join(DEFAULT_TASKS)}, plus qa on a QA dataset")
    run.add_argument("--tokens", type=_integer(2), default=defaults.tokens, help="tokens of the perplexity and memory stream (default: %(default)s); e.g. --tokens 4000")
    run.add_argument("--chunk-size", type=_integer(1), help=f"tokens per forward in the stream and streamed prompts; exact (same result as 1) for full, window and sink positions=absolute, approximate and labelled so for the others (default: {DEFAULT_CHUNK} where exact, 1 elsewhere); e.g. --chunk-size 512")
    run.add_argument("--contexts", type=_integer(1), nargs="+", default=list(defaults.contexts), metavar="N", help="context lengths of the speed task (default: %(default)s); e.g. --contexts 1024 4096")
    run.add_argument("--steps", type=_integer(1), default=defaults.steps, help="timed decode steps per context (default: %(default)s); e.g. --steps 32")
    _recall_options(run, defaults)
    run.add_argument("--protocol", action="append", choices=list(PROTOCOLS), help=f"how the prompt meets the cache, repeatable: {'; '.join(protocol.summary for protocol in PROTOCOLS.values())} (default: {' '.join(DEFAULT_PROTOCOLS)}); e.g. --protocol context")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--budgets", type=_integer(1), nargs="*", default=list(defaults.budgets), metavar="B", help="total kept tokens per layer at which each bounded policy without explicit budget parameters runs (each class maps a budget onto its parameters; a spec with them keeps them); none: no sweep (default: %(default)s); e.g. --budgets 64 128 256 512")
    budget.add_argument("--ratios", type=_ratio, nargs="+", metavar="R", help="fractions of the context kept, instead of --budgets; e.g. --ratios 0.5 0.25 0.125")
    _qa_options(run, defaults)
    run.add_argument("--chat-template", action="store_true", help="wrap recall and QA prompts in the tokenizer's chat template, each question a user message and each answer the assistant's (default: plain text); e.g. --chat-template --protocol multiturn --task niah_multiturn")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default=defaults.device, help="where to run (default: %(default)s: cuda if available); e.g. --device cpu")
    run.add_argument("--dtype", choices=("auto", *DTYPES), default=defaults.dtype, help="model dtype (default: %(default)s: float32 on CPU, bfloat16 on CUDA); e.g. --dtype float16")
    run.add_argument("--device-map", help="spread a large model over the GPUs with accelerate, e.g. --device-map auto")
    run.add_argument("--attn-implementation", help="attention kernel of the model (default: the model's, sdpa); e.g. --attn-implementation eager")
    run.add_argument("--threads", type=_integer(1), help="CPU threads for torch (default: torch's choice, one per core); on a busy shared machine 1 avoids OpenMP's spin-waiting, e.g. --threads 1")
    run.add_argument("--out", type=Path, default=defaults.out, help="output folder (default: %(default)s); e.g. --out results-gpu")
    run.add_argument("--no-progress", action="store_true", help="no progress bars, for logs and CI; e.g. --no-progress")
    for task in TASKS:
        task.add_arguments(run)
    report = commands.add_parser(
        "report",
        help="re-render tables and plots from DIR/results.jsonl",
        description="Re-render summary.md/.csv/.tex and the PNG plots from DIR/results.jsonl alone.",
        epilog=f"example:\n  {PROG} report results",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("dir", type=Path, metavar="DIR", help="a folder written by hf-kvpolicies eval --out DIR (lm-eval results files under it are read too)")
    lm_eval = commands.add_parser(
        "lm-eval",
        help="run lm-evaluation-harness (every lm-eval flag passes through) with the hf-kvpolicies model registered",
        add_help=False,  # --help is lm-eval's
        prefix_chars="\0",  # every argument is lm-eval's
    )
    lm_eval.add_argument("args", nargs=argparse.REMAINDER)
    export = commands.add_parser(
        "export-lm-eval",
        help="write the recall suite (and a QA dataset) as lm-eval tasks over local JSONL files",
        description="Write each recall --task at each --lengths (a document per depth and seed) as an lm-eval task\n"
        "YAML over a local JSONL file in DIR, with the harness's prompts and scoring; a QA --dataset adds kvp_qa.",
        epilog=EXPORT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("dir", type=Path, metavar="DIR", help="the folder to write the task YAMLs and JSONL files into (created if missing)")
    _input_options(export, defaults)
    export.add_argument("--task", action="append", type=_recall_task, metavar="TASK", help=f"recall task, repeatable, with options as TASK:key=value: {', '.join(RECALL_TASKS)} (default: the default run's, {' '.join(t for t in DEFAULT_TASKS if t in RECALL_TASKS)}); e.g. --task vt --task niah_single:value=uuid")
    _recall_options(export, defaults)
    _qa_options(export, defaults)
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    """The sweep's settings from the options of the same names (lists become tuples; an option
    left out keeps the default); the options tasks added go to ``options``."""
    names = {field.name for field in fields(Settings)} - {"progress", "options"}
    named = {name: getattr(args, name) for name in names}
    values = {name: tuple(dict.fromkeys(value)) if isinstance(value, list) else value for name, value in named.items() if value is not None}
    if args.ratios:
        values["budgets"] = ()
    own = names | {"command", "policy", "task", "threads", "no_progress"}
    options = {name: value for name, value in vars(args).items() if name not in own}
    return Settings(**values, progress=not args.no_progress, options=options)


def _eval(args: argparse.Namespace) -> int:
    from .settings import default_policies
    from .sweep import check_policies, run_sweep

    def note(message: str) -> None:
        print(message, file=sys.stderr)

    _check_loading_options(args)
    policies = check_policies(args.policy) if args.policy else default_policies(note)
    tasks = list(dict.fromkeys(args.task)) if args.task else [*DEFAULT_TASKS, *(["qa"] if is_qa_dataset(args.dataset) else [])]
    if args.no_progress:
        _quiet_libraries()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    sweep = run_sweep(_settings(args), policies, tasks, _warning("eval"))
    if sweep.complete:
        print(sweep.table, end="")
        print(f"\nresults, tables and plots in {args.out}/ ({RESULTS}, summary.md/.csv/.tex, *.png)")
    else:
        note(f"this process ran {len(sweep.ran)} of {len(sweep.jobs)} runs; the process that finishes last writes the report")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import read_results, write_report

    records = read_results(args.dir, _warning("report"))
    if not records:
        raise UsageError(
            f"no records in {args.dir / RESULTS} nor lm-eval results under {args.dir}: run `{PROG} eval --out {args.dir}` "
            f"or `{PROG} lm-eval --model hf-kvpolicies ... --output_path {args.dir}` first"
        )
    print(write_report(args.dir, records), end="")
    return 0


def _lm_eval(args: argparse.Namespace) -> int:
    from .lm_eval.command import run_lm_eval

    return run_lm_eval(args.args)


def _export(args: argparse.Namespace) -> int:
    from .lm_eval.export import QA_TASK, RECALL_TAG, export_tasks
    from .sweep import check_out

    check_out(args.dir)
    settings = Settings(
        model=args.model, gguf_file=args.gguf_file, dataset=args.dataset, text_file=args.text_file,
        lengths=tuple(dict.fromkeys(args.lengths)), depths=tuple(dict.fromkeys(args.depths)), seeds=tuple(dict.fromkeys(args.seeds)),
        qa_samples=args.qa_samples, qa_max_tokens=args.qa_max_tokens,
    )
    tasks = list(dict.fromkeys(args.task or [task for task in DEFAULT_TASKS if task in RECALL_TASKS]))
    done = export_tasks(args.dir, settings, tasks)
    print(f"wrote {len(done.tasks)} lm-eval tasks ({done.prompts} prompts) to {args.dir}/: {' '.join(done.tasks)}")
    if done.retokenized:
        _warning("export-lm-eval")(f"{done.retokenized} of {done.prompts} prompts come back from lm-eval's tokenisation as other tokens than the harness's")
    names = ",".join([RECALL_TAG, *([QA_TASK] if QA_TASK in done.tasks else [])])
    print(f"run them: {PROG} lm-eval --model hf-kvpolicies --model_args pretrained={args.model},policy=full --include_path {args.dir} --tasks {names} --output_path OUT")
    return 0


def _warning(command: str) -> Callable[[str], None]:
    """One line on standard error per problem that does not stop the command."""
    return lambda message: print(f"{PROG} {command}: warning: {message}", file=sys.stderr)


def _quiet_libraries() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"eval": _eval, "report": _report, "lm-eval": _lm_eval, "export-lm-eval": _export}[args.command](args)
    except (UsageError, DataError) as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
