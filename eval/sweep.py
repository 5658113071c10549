"""A sweep: every policy x task on the same tokens, one record each, resumable, splittable.

The sweep's runs are listed in a fixed order; those already in ``results.jsonl`` are dropped;
each process sharing the ``--out`` (those of an ``accelerate launch``, or commands started side
by side) claims the rest unit by unit (:mod:`eval.claims`), so that every run is done once. A
policy's perplexity and memory always go to the same process and share one pass over the
stream: the memory figures are those of the stream the perplexity was measured on.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvpolicies import available_policies, from_spec, parse_spec
from hf_kvpolicies.cache import PolicyCache
from hf_kvpolicies.models import DEFAULT_MODEL, EMBEDDED_MODELS, load_model

from .budgets import PolicyRun, expand
from .data import EMBEDDED_TEXT, DataError, load_text, text_label, tokenize
from .memory import MemoryTrace, decode_peak, memory_in_use, model_devices
from .perplexity import curve, perplexity, streaming_nll
from .claims import claimed, clear
from .records import RESULTS, Warn, append_record, environment, identity, locked, read_records
from .report import record_problem, write_report
from .speed import speed_profile
from .protocols import DEFAULT_PROTOCOLS, answer, check_protocol, protocol_independent
from .qa import describe, exact_match, is_qa_dataset, load_samples, make_qa_case, token_f1
from .recall import TASKS as RECALL_TASKS
from .recall import make_case, parse_task, score_answer
from .stream import DEFAULT_CHUNK, resolve_chunk

MEASURES = ("perplexity", "memory", "speed")
TASKS = (*MEASURES, *RECALL_TASKS, "qa")
"""``--task`` names: the stream measures, the recall suite (options as ``TASK:key=value``), QA."""
DEFAULT_TASKS = ("perplexity", "memory", "niah_single", "niah_multikey", "passkey")
"""Recall tasks the embedded model answers with a full cache at 512 tokens (measured: niah_single
0.67, niah_multikey 1.00 over depths 0.1/0.5/0.9); variable tracking scored 0.07 there, which
would measure the model rather than the policies, so it is left to the frontier command. ``speed``
(``--task speed``) is left out to keep the default run within 10 minutes on 2 CPU cores."""
DEFAULT_POLICIES = ("full", "window", "sink:positions=absolute", "h2o", "fp8")
"""Full, FP8 and one of each bounded family, swept over ``--budgets`` (each class maps a budget
onto its parameters); bare specs, so the sweep gives them their budgets.

The sinks keep absolute positions: within the model's trained context that is the StreamingLLM
layout, and chunked feeding is exact for it (``positions=cache`` re-rotates, and streams token by token).
"""
DEFAULT_BUDGETS = (64, 128)


DECODE_STEPS = 8
"""Decode steps at the end of the stream over which the peak memory is measured."""
BATCH = 16
"""Most recall prompts fed together (rows of equal length share every forward)."""


class UsageError(ValueError):
    """Bad input: the CLI prints the message on one line and exits with status 2."""


@dataclass
class Settings:
    """Everything a sweep needs besides its policies and tasks (the CLI's options)."""

    model: str = DEFAULT_MODEL
    gguf_file: str | None = None
    dataset: str = EMBEDDED_TEXT
    text_file: str | None = None
    tokens: int = 512
    chunk_size: int | None = None
    contexts: tuple[int, ...] = (512, 2048)
    steps: int = 16
    lengths: tuple[int, ...] = (512,)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    seeds: tuple[int, ...] = (0,)
    protocol: tuple[str, ...] = DEFAULT_PROTOCOLS
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    ratios: tuple[float, ...] = ()
    qa_samples: int = 20
    qa_max_tokens: int = 2048
    device: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None
    attn_implementation: str | None = None
    out: Path = Path("results")
    progress: bool = True


@dataclass(frozen=True)
class Job:
    run: PolicyRun
    task: str
    index: int
    """The policy run's place in the sweep: tables keep that order whoever ran the job."""
    length: int | None = None
    """The prompt length of a recall job."""
    protocol: str | None = None
    """The protocol of a recall or QA job; ``"any"`` for a policy that does not depend on it."""


@dataclass
class Sweep:
    """What :func:`run_sweep` did: the jobs of the sweep, those this process ran, the report."""

    jobs: list[Job]
    ran: list[Job] = field(default_factory=list)
    complete: bool = False
    table: str = ""


def default_policies(note: Callable[[str], None]) -> list[str]:
    """The default set, less the policies that are not registered (one note each)."""
    registered = set(available_policies())
    chosen = []
    for spec in DEFAULT_POLICIES:
        if spec.partition(":")[0] in registered:
            chosen.append(spec)
        else:
            note(f"note: skipping default policy {spec!r}: no policy {spec.partition(':')[0]!r} is registered")
    return chosen


def check_policies(specs: Sequence[str]) -> list[str]:
    """Each spec parsed (name, keys, value types) before anything is loaded."""
    for spec in specs:
        try:
            parse_spec(spec)
        except ValueError as error:
            raise UsageError(f"--policy {spec!r}: {error}") from error
    if len(set(specs)) != len(specs):
        raise UsageError("a --policy is given twice: give each spec once")
    return list(specs)


def check_out(out: Path) -> None:
    """``--out`` made ready before any work: a folder this process can write (created if missing),
    whose ``results.jsonl``, if there, is a file."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file, not a folder: pass a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--out {str(out)!r} cannot be created ({error.strerror}): pass a folder you can write to") from error
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"--out {str(out)!r} is not writable: pass a folder you can write to")
    if (out / RESULTS).exists() and not (out / RESULTS).is_file():
        raise UsageError(f"--out {str(out)!r} holds a {RESULTS} that is not a file: pass another folder")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available to this PyTorch; use --device cpu or auto")
    return torch.device(name)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return DTYPES[name]


def jobs_of(settings: Settings, runs: Sequence[PolicyRun], tasks: Sequence[str]) -> list[Job]:
    """The sweep's jobs in a fixed order: each policy run x task, recall and QA tasks once per
    protocol (once in all for a policy the protocol does not change) and recall once per length."""
    jobs = []
    for index, run in enumerate(runs):
        protocols = ("any",) if protocol_independent(run.spec(max(settings.lengths))) else settings.protocol
        for task in tasks:
            if task in MEASURES:
                jobs.append(Job(run, task, index))
            elif task == "qa":
                jobs += [Job(run, task, index, protocol=protocol) for protocol in protocols]
            else:
                jobs += [Job(run, task, index, length, protocol) for length in settings.lengths for protocol in protocols]
    return jobs


def task_params(job: Job, settings: Settings) -> dict:
    """The settings a job's figures depend on (part of the run's identity)."""
    chunk = settings.chunk_size or "auto"
    sweep = {"budget": job.run.budget, "ratio": job.run.ratio}
    if job.task in ("perplexity", "memory"):
        return {"tokens": settings.tokens, "chunk_size": chunk, **sweep}
    if job.task == "speed":
        return {"contexts": list(settings.contexts), "steps": settings.steps, **sweep}
    protocol = {"protocol": job.protocol, "protocols": list(settings.protocol)} if job.protocol == "any" else {"protocol": job.protocol}
    if job.task == "qa":
        return {"samples": settings.qa_samples, "max_tokens": settings.qa_max_tokens, **protocol, **sweep}
    return {
        "length": job.length,
        "depths": list(settings.depths),
        "seeds": list(settings.seeds),
        "chunk_size": chunk,
        **protocol,
        **sweep,
    }


def run_sweep(settings: Settings, policies: Sequence[str], tasks: Sequence[str], warn: Warn | None = None) -> Sweep:
    """Run the pending jobs of this process; write the report once every job has its record
    (``warn`` is told of each line of the results that the report skips)."""
    from accelerate import PartialState

    check_out(settings.out)
    device = resolve_device(settings.device)
    state = PartialState(cpu=device.type == "cpu")
    if device.type == "cuda" and state.num_processes > 1 and settings.device_map is None:
        device = state.device
    dtype = resolve_dtype(settings.dtype, device)
    if is_qa_dataset(settings.dataset):
        dataset = describe(settings.dataset)
    else:
        if "qa" in tasks:
            raise UsageError("--task qa needs a QA --dataset: longbench:SUBSET or a JSONL file of {context, input, answers}")
        dataset = text_label(settings.dataset, settings.text_file)
    base = {
        "model": settings.model,
        "gguf_file": settings.gguf_file,
        "dataset": dataset,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
    }
    jobs = jobs_of(settings, expand(list(policies), settings.budgets, settings.ratios), tasks)
    results = settings.out / RESULTS
    done = _done(results)
    pending = [job for job in jobs if identity(_key(base, job, settings)) not in done]
    sweep = Sweep(jobs)
    units = _units(pending)
    start = len(units) * state.process_index // state.num_processes  # processes start apart, then take what is free
    try:
        sweep.ran = _run_claimed(settings, units[start:] + units[:start], base, device, dtype, results)
    finally:
        clear(settings.out)
    with locked(results):
        records = read_records(results, warn, record_problem)
        have = {identity(record) for record in records}
        sweep.complete = all(identity(_key(base, job, settings)) in have for job in jobs)
        if sweep.complete:
            sweep.table = write_report(settings.out, records)
    return sweep


def _done(results: Path) -> set[str]:
    """The identities of the runs that have a usable record."""
    return {identity(record) for record in read_records(results, check=record_problem)}


def _run_claimed(settings: Settings, units: list[list[Job]], base: dict, device, dtype, results: Path) -> list[Job]:
    """Run every unit that no other process holds or has finished (:mod:`eval.claims`), loading
    the model at the first one; return the jobs run."""
    ran: list[Job] = []
    bench = bar = None
    for unit in units:
        with claimed(settings.out, json.dumps(sorted(identity(_key(base, job, settings)) for job in unit))) as mine:
            if not mine:
                continue
            done = _done(results)  # another process may have finished it since this one read the results
            todo = [job for job in unit if identity(_key(base, job, settings)) not in done]
            if not todo:
                continue
            if bench is None:
                bench = _prepare(settings, [job for unit in units for job in unit], device, dtype)
                bar = tqdm(total=sum(map(len, units)), disable=not settings.progress, desc="runs", unit="run")
            _run_unit(settings, bench, todo, base, results, bar)
            ran += todo
    if bar is not None:
        bar.close()
    return ran


def _inputs(settings: Settings) -> tuple[str, list[dict]]:
    """``(text, QA samples)``: loaded only by a process with runs to do."""
    if is_qa_dataset(settings.dataset):
        samples = load_samples(settings.dataset, settings.qa_samples)
        return "\n\n".join(sample["context"] for sample in samples), samples
    return load_text(settings.dataset, settings.text_file)[0], []


def _units(jobs: list[Job]) -> list[list[Job]]:
    """The jobs in units that one process runs together: a policy run's perplexity and memory
    share a stream, its recall tasks at one length and protocol share batches; speed and QA stand
    alone. Each process claims the units it runs (:func:`_run_claimed`)."""
    units: dict[tuple, list[Job]] = {}
    for job in jobs:
        if job.task in ("perplexity", "memory"):
            group = "stream"
        elif job.length is not None:  # every recall task at one length: prompts of one length batch together
            group = ("recall", job.length, job.protocol)
        else:
            group = (job.task, job.protocol)
        units.setdefault((job.run, group), []).append(job)
    return list(units.values())


def _key(base: dict, job: Job, settings: Settings) -> dict:
    return {**base, "policy": job.run.policy, "task": job.task, "params": task_params(job, settings)}


def _context_of(job: Job, settings: Settings) -> int:
    """The context a ratio is a fraction of: the stream, the longest speed context, the prompt."""
    if job.task in ("perplexity", "memory"):
        return settings.tokens
    if job.task == "speed":
        return max(settings.contexts)
    return job.length or settings.qa_max_tokens


@dataclass
class Bench:
    """What this process runs its jobs with: the model, its tokenizer and the inputs."""

    model: object
    tokenizer: object
    ids: torch.Tensor
    samples: list[dict]
    case_of: Callable
    environment: dict


def _prepare(settings: Settings, jobs: list[Job], device: torch.device, dtype: torch.dtype) -> Bench:
    """Load the model and the inputs, and check every job (protocols, constructors, recall
    cases) before the first long run."""
    text, samples = _inputs(settings)
    model, tokenizer = _model(settings, device, dtype)
    tasks = {job.task for job in jobs}
    ids = _ids(settings, tokenizer, text, tasks)
    for protocol in {job.protocol for job in jobs} - {None, "any"}:
        try:
            check_protocol(model, protocol)
        except ValueError as error:
            raise UsageError(f"--protocol {protocol}: {error}") from error
    for job in jobs:  # every constructor check before the first long run
        if job.task != "qa" or job.run.ratio is None:
            _build(model, job.run.spec(_context_of(job, settings)))
    recall = [job for job in jobs if job.length is not None]
    haystack = _haystack(settings, tokenizer, text) if recall else None
    for job in recall:
        _check_case(settings, tokenizer, haystack, job)
    case_of = lru_cache(maxsize=None)(lambda task, length, depth, seed: _case(tokenizer, haystack, task, length, depth, seed))
    _warm_up(model, ids)
    return Bench(model, tokenizer, ids, samples, case_of, environment())


def _run_unit(settings: Settings, bench: Bench, unit: list[Job], base: dict, results: Path, bar: tqdm) -> None:
    """Run the jobs of one unit, appending each record as it is made."""
    for job, record in _measure(settings, bench.model, bench.tokenizer, bench.ids, bench.case_of, bench.samples, unit):
        record.update(_key(base, job, settings), **_sweep_fields(job), policy_index=job.index, **bench.environment)
        record["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        append_record(results, record)
        tqdm.write(f"{_task_label(job):>22}  {job.run.label}: {_headline(record)}  ({record['elapsed_s']:.1f} s)", file=sys.stderr)
        bar.update()


def _sweep_fields(job: Job) -> dict:
    fields = {"family": job.run.family, "budget_swept": job.run.budget, "ratio": job.run.ratio, "label": job.run.label}
    if job.protocol is not None:
        fields["protocol"] = job.protocol
    return fields


def _task_label(job: Job) -> str:
    if job.length is not None:
        return f"{job.task}@{job.length} {job.protocol}"
    return job.task if job.protocol is None else f"{job.task} {job.protocol}"


def _policy_fields(cache, spec: str, swept: int | None) -> dict:
    """What every record says about the cache it measured: the spec built and what it was built
    as (the class and the keywords the spec resolved to, budget parameters included), its budget
    (the one swept, else the most tokens its first governed layer keeps, ``None`` when not known
    before the first forward), whether its class is bounded, and the layers it governs."""
    ours = isinstance(cache, PolicyCache)
    limit = cache.layers[cache.first_policy_layer].get_max_length() if ours else -1
    return {
        "spec": spec,
        "built": {"class": type(cache).__name__, "parameters": parse_spec(spec)[1]},
        "budget": swept if swept is not None else (limit if limit >= 0 else None),
        "bounded": ours and type(cache).budget_parameters(1) is not None,
        "governed_layers": cache.governed_layers if ours else None,
    }


def _measure(settings, model, tokenizer, ids, case_of, samples, unit):
    """Yield ``(job, record)`` for the jobs of one unit as each finishes."""
    first = unit[0]
    spec = first.run.spec(_context_of(first, settings))

    def make():
        return from_spec(model, spec)

    desc = first.run.label if len(first.run.label) < 40 else first.run.label[:37] + "..."
    fields = _policy_fields(make(), spec, first.run.budget_for(_context_of(first, settings)))
    mine = {job.task: job for job in unit if job.length is None}
    if "perplexity" in mine or "memory" in mine:
        start = time.perf_counter()
        cache = make()
        chunk, approximate = resolve_chunk(cache, model, settings.chunk_size)
        stream = ids[:, : settings.tokens]
        before = memory_in_use(model_devices(model))
        trace = MemoryTrace(cache, stride=max(1, settings.tokens // 64))
        nll = streaming_nll(
            model, stream, cache, progress=settings.progress, desc=desc, chunk_size=chunk, observer=trace.observe
        )
        trace.finish(stream.shape[1] - 1)
        elapsed = time.perf_counter() - start
        kept = cache.stored_tokens() if isinstance(cache, PolicyCache) else None
        common = {
            **fields, "tokens": stream.shape[1], "chunk_size": chunk, "approximate": approximate, "elapsed_s": elapsed,
            "kept_tokens": kept, "kept_fraction": None if kept is None else kept / (stream.shape[1] - 1),
            "held_bytes": trace.held[-1], "allocated_bytes": trace.bytes[-1],
        }
        if "perplexity" in mine:
            positions, values = curve(nll)
            yield mine["perplexity"], {**common, "ppl": perplexity(nll), "curve_positions": positions, "curve_ppl": values}
        if "memory" in mine:
            record = {
                **common,
                "footprint_bytes": trace.bytes[-1],
                "footprint_max_bytes": max(trace.bytes),
                "footprint_positions": trace.positions,
                "footprint_trace": trace.bytes,
                "held_trace": trace.held,
            }
            peak = decode_peak(model, cache, stream[:, -1:], DECODE_STEPS, since=before)
            yield mine["memory"], {**record, "peak_memory_bytes": peak.growth, "peak_memory_source": peak.source, "decode_steps": DECODE_STEPS}
    if "speed" in mine:
        start = time.perf_counter()
        figures = speed_profile(model, make, ids, settings.contexts, steps=settings.steps, progress=settings.progress, desc=desc)
        yield mine["speed"], {**fields, **figures, "steps": settings.steps, "approximate": False, "elapsed_s": time.perf_counter() - start}
    if first.task == "qa":
        yield first, _qa(settings, model, tokenizer, samples, first, fields)
    elif first.length is not None:
        yield from _recall(settings, model, tokenizer, case_of, unit, make, fields)


def _protocol_fields(job: Job, settings: Settings) -> dict:
    ran = "prefill" if job.protocol == "any" else job.protocol
    stands_for = list(settings.protocol) if job.protocol == "any" else [job.protocol]
    return {"protocol_ran": ran, "protocols": stands_for, "protocol_independent": job.protocol == "any"}


def _recall(settings, model, tokenizer, case_of, jobs, make, fields):
    """Every (depth, seed) cell of the recall tasks of ``jobs`` (one length, one protocol); prompts
    of equal lengths share forwards (at most :data:`BATCH` rows). Yields ``(job, record)`` per task.
    ``case_of(task, length, depth, seed)`` gives the cases, generated once per process."""
    start = time.perf_counter()
    first = jobs[0]
    protocol = _protocol_fields(first, settings)
    ran = protocol["protocol_ran"]
    cases = []
    for job in jobs:
        depths = settings.depths if parse_task(job.task)[0] != "cwe" else settings.depths[:1]  # a list of words has no depth
        cases += [(job, case_of(job.task, job.length, depth, seed)) for depth in depths for seed in settings.seeds]
    chunk, approximate = resolve_chunk(make(), model, settings.chunk_size) if ran == "streamed" else (1, False)
    groups: dict[int, list] = {}
    for job, case in cases:  # the context protocol splits prompts where the question starts
        groups.setdefault(case.context_ids.shape[1] if ran == "context" else 0, []).append((job, case))
    cells: dict[Job, list[dict]] = {job: [] for job in jobs}
    states: dict[Job, list] = {job: [] for job in jobs}
    for group in groups.values():
        for at in range(0, len(group), BATCH):
            batch = group[at : at + BATCH]
            context, question = _split([case for _, case in batch], ran)
            out = answer(model, tokenizer, context, question, make, ran, max(c.answer_tokens for _, c in batch), chunk)
            for (job, case), text in zip(batch, out.texts):
                states[job].append(out)
                cells[job].append({
                    "depth": None if case.task == "cwe" else case.depth, "seed": case.seed,
                    "expected": list(case.expected), "answer": text, "score": score_answer(text, case.expected),
                })
    elapsed = (time.perf_counter() - start) / len(jobs)  # the batches are shared: each task its share
    for job in jobs:
        yield job, {
            **fields, **protocol, **_state_fields(states[job]), "length": job.length, "cells": cells[job],
            "score": sum(cell["score"] for cell in cells[job]) / len(cells[job]),
            "chunk_size": chunk, "approximate": approximate, "elapsed_s": elapsed,
        }


def _split(cases, protocol: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(context, question)`` rows of a batch: split where the question starts under ``context``;
    the whole prompt as the context otherwise (only the context protocol treats them apart)."""
    if protocol == "context":
        return torch.cat([c.context_ids for c in cases]), torch.cat([c.question_ids for c in cases])
    prompts = torch.cat([torch.cat([c.context_ids, c.question_ids], dim=1) for c in cases])
    return prompts, prompts[:, :0]


def _state_fields(states) -> dict:
    """The cache's state once the prompt was in, over the batches (mean kept fraction; bytes per sequence)."""
    kept = [s.kept_tokens for s in states]
    fractions = [s.kept_tokens / s.fed_tokens for s in states if s.kept_tokens is not None]
    held = [s.held_bytes for s in states if s.held_bytes is not None]
    return {
        "kept_tokens": None if None in kept else max(kept),
        "kept_fraction": sum(fractions) / len(fractions) if fractions else None,
        "held_bytes": max(held) if held else None,
        "allocated_bytes": max(s.allocated_bytes for s in states),
    }


def _qa(settings, model, tokenizer, samples, job, fields) -> dict:
    """Every QA sample alone (lengths differ), scored by exact match and token F1."""
    start = time.perf_counter()
    protocol = _protocol_fields(job, settings)
    cells, states = [], []
    for index, sample in enumerate(samples):
        case = make_qa_case(tokenizer, sample, index, settings.qa_max_tokens)
        context, question = _split([case], protocol["protocol_ran"])
        spec = job.run.spec(context.shape[1] + question.shape[1])
        chunk = resolve_chunk(from_spec(model, spec), model, settings.chunk_size)[0] if protocol["protocol_ran"] == "streamed" else 1
        out = answer(model, tokenizer, context, question, lambda: from_spec(model, spec), protocol["protocol_ran"], case.answer_tokens, chunk)
        states.append(out)
        text = out.texts[0]
        cells.append({"index": index, "expected": list(case.expected), "answer": text,
                      "exact_match": exact_match(text, case.expected), "f1": token_f1(text, case.expected)})
    return {
        **fields, **protocol, **_state_fields(states), "cells": cells,
        "exact_match": sum(c["exact_match"] for c in cells) / len(cells), "f1": sum(c["f1"] for c in cells) / len(cells),
        "score": sum(c["f1"] for c in cells) / len(cells), "approximate": False, "elapsed_s": time.perf_counter() - start,
    }


@torch.no_grad()
def _warm_up(model, ids: torch.Tensor) -> None:
    """A chunk and a decode step through a throwaway cache, so that the first policy measured
    does not pay the first calls' costs (kernel selection, allocator growth) in its figures."""
    length = min(DEFAULT_CHUNK, ids.shape[1] - 1)
    cache = DynamicCache(config=model.config)
    model(ids[:, :length].to(model.device), cache=cache)
    model(ids[:, length : length + 1].to(model.device), cache=cache)


def _headline(record: dict) -> str:
    task = record["task"]
    mark = " (approximate)" if record.get("approximate") else ""
    if task == "perplexity":
        return f"ppl {record['ppl']:.3f} over {record['tokens']} tokens{mark}"
    if task == "memory":
        held = record["held_bytes"]
        held_text = "" if held is None else f"holds {held / 2**20:.2f} MiB, "
        return f"KV cache {held_text}allocated {record['footprint_bytes'] / 2**20:.2f} MiB, peak +{record['peak_memory_bytes'] / 2**20:.1f} MiB{mark}"
    if task == "speed":
        return ", ".join(f"{ms:.1f} ms/token @{c}" for c, ms in zip(record["contexts"], record["median_ms"]))
    if task == "qa":
        return f"exact match {record['exact_match']:.2f}, F1 {record['f1']:.2f}"
    return f"score {record['score']:.2f}{mark}"


def _model(settings: Settings, device: torch.device, dtype: torch.dtype):
    device_map = settings.device_map or (str(device) if device.type == "cuda" else None)
    try:
        return load_model(settings.model, settings.gguf_file, dtype, device_map, settings.attn_implementation)
    except (OSError, ValueError, ModuleNotFoundError, FileNotFoundError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        for option, value in (("--attn-implementation", settings.attn_implementation), ("--device-map", settings.device_map)):
            if value is not None and value in first:
                raise UsageError(f"{option} {value!r} was refused while loading the model ({first})") from error
        raise UsageError(
            f"cannot load model {settings.model!r} ({first}): pass an embedded name "
            f"({', '.join(EMBEDDED_MODELS)}), a Hub id, or a local folder with config.json and a tokenizer"
        ) from error


def _ids(settings: Settings, tokenizer, text: str, tasks: set[str]) -> torch.Tensor:
    needed = 0
    if tasks & {"perplexity", "memory"}:
        needed = settings.tokens
    if "speed" in tasks:
        needed = max(needed, max(settings.contexts) + 1)  # the context and the first token decoded
    try:
        return tokenize(tokenizer, text, max(needed, 2))
    except DataError as error:
        raise UsageError(f"{error}: lower --tokens or --contexts, or use a longer text") from error


def _haystack(settings: Settings, tokenizer, text: str) -> torch.Tensor:
    """The recall suite's haystack: enough of the text for seeds to start at different places."""
    try:
        return tokenize(tokenizer, text, max(4 * max(settings.lengths), 20_000), start=False)
    except DataError:
        return tokenize(tokenizer, text, start=False)


def _case(tokenizer, haystack, task: str, length: int, depth: float, seed: int):
    name, options = parse_task(task)
    return make_case(tokenizer, haystack, name, length, depth, seed, **options)


def _check_case(settings: Settings, tokenizer, haystack, job: Job) -> None:
    try:
        _case(tokenizer, haystack, job.task, job.length, settings.depths[0], settings.seeds[0])
    except ValueError as error:
        raise UsageError(f"--task {job.task} at --lengths {job.length}: {error}") from error


def _build(model, spec: str):
    try:
        cache = from_spec(model, spec)
    except (ValueError, NotImplementedError) as error:
        raise UsageError(f"--policy {spec!r}: {error}") from error
    if isinstance(cache, PolicyCache) and cache.governed_layers == 0:
        raise UsageError(
            f"--policy {spec!r} governs none of the model's {len(cache.layers)} layers (each keeps the model's own "
            "sliding window), so it would measure the model, not the policy: use a model with full-attention layers"
        )
    return cache
