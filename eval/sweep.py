"""A sweep: every policy x task on the same tokens, one record each, resumable, splittable.

The sweep plans and runs; what a task measures and how its records read back is the task's own
(:mod:`eval.tasks`). Its jobs are listed in a fixed order; those already in ``results.jsonl`` are
dropped; each process sharing the ``--out`` (those of an ``accelerate launch``, or commands
started side by side) claims the rest unit by unit (:mod:`eval.claims`), so that every run is
done once. A policy's perplexity and memory always go to the same process and share one pass
over the stream: the memory figures are those of the stream the perplexity was measured on.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvpolicies import from_spec, parse_spec
from hf_kvpolicies.cache import PolicyCache
from hf_kvpolicies.models import EMBEDDED_MODELS, load_model

from .budgets import PolicyRun, expand
from .claims import claimed, clear
from .data import DataError, load_text, text_label, tokenize
from .protocols import check_protocol, protocol_independent
from .qa import describe, is_qa_dataset, load_samples
from .records import RESULTS, Warn, append_record, environment, identity, locked, read_records
from .report import record_problem, write_report
from .settings import Settings, UsageError
from .stream import DEFAULT_CHUNK
from .tasks import Bench, Job, Task, Unit, task_for
from .tasks.base import stands_for


@dataclass
class Sweep:
    """What :func:`run_sweep` did: the jobs of the sweep, those this process ran, the report."""

    jobs: list[Job]
    ran: list[Job] = field(default_factory=list)
    complete: bool = False
    table: str = ""


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


# --- plan ------------------------------------------------------------------------------------
def jobs_of(settings: Settings, runs: Sequence[PolicyRun], tasks: Sequence[str]) -> list[Job]:
    """The sweep's jobs in a fixed order: each policy run x task x the task's places
    (:meth:`Task.places`), a prompted task once per protocol (once in all for the protocols a
    policy cannot change)."""
    jobs = []
    for index, run in enumerate(runs):
        protocols = _protocols(settings, run)
        for name in tasks:
            task = task_for(name)
            for place in task.places(settings, name):
                for protocol in protocols if task.prompted else (None,):
                    where = tuple(place.items()) + ((("protocol", protocol),) if protocol is not None else ())
                    jobs.append(Job(run, name, index, where))
    return jobs


def _protocols(settings: Settings, run: PolicyRun) -> tuple[str, ...]:
    """``--protocol`` for this run; ``"any"`` in place of those it cannot change (:func:`stands_for`)."""
    if not protocol_independent(run.spec(max(settings.lengths))):
        return settings.protocol
    same = stands_for(settings)
    return ("any",) * bool(same) + tuple(name for name in settings.protocol if name not in same)


def task_params(job: Job, settings: Settings) -> dict:
    """The settings a job's figures depend on (part of the run's identity): the task's own, the
    budget or ratio, and the protocol."""
    params = {**task_for(job.task).params(settings, job), "budget": job.run.budget, "ratio": job.run.ratio}
    if job.protocol == "any":
        params.update(protocol="any", protocols=stands_for(settings))
    elif job.protocol is not None:
        params.update(protocol=job.protocol)
    return params


def _units(jobs: list[Job]) -> list[list[Job]]:
    """The jobs in units that one process runs together (a policy run's jobs of equal
    :meth:`Task.unit`: its perplexity and memory share a stream, its recall tasks at one length
    and protocol share batches). Each process claims the units it runs (:func:`_run_claimed`)."""
    units: dict[tuple, list[Job]] = {}
    for job in jobs:
        units.setdefault((job.run, task_for(job.task).unit(job)), []).append(job)
    return list(units.values())


def _key(base: dict, job: Job, settings: Settings) -> dict:
    return {**base, "policy": job.run.policy, "task": job.task, "params": task_params(job, settings)}


def _context_of(job: Job, settings: Settings) -> int:
    """The context a ratio is a fraction of (:meth:`Task.context`)."""
    return task_for(job.task).context(settings, job)


# --- run -------------------------------------------------------------------------------------
def run_sweep(settings: Settings, policies: Sequence[str], tasks: Sequence[str], warn: Warn | None = None) -> Sweep:
    """Run the pending jobs of this process; write the report once every job has its record
    (``warn`` is told of each line of the results that the report skips)."""
    from accelerate import PartialState

    check_out(settings.out)
    for task in _tasks_of(tasks):
        task.check(settings)
    device = resolve_device(settings.device)
    state = PartialState(cpu=device.type == "cpu")
    if device.type == "cuda" and state.num_processes > 1 and settings.device_map is None:
        device = state.device
    dtype = resolve_dtype(settings.dtype, device)
    base = {
        "model": settings.model,
        "gguf_file": settings.gguf_file,
        "dataset": describe(settings.dataset) if is_qa_dataset(settings.dataset) else text_label(settings.dataset, settings.text_file),
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


def _tasks_of(names) -> list[Task]:
    """The tasks of ``names`` (or of jobs' names), each once, in order."""
    return list(dict.fromkeys(task_for(name) for name in names))


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
                context = {**base, **environment()}
                bar = tqdm(total=sum(map(len, units)), disable=not settings.progress, desc="runs", unit="run")
            _run_unit(settings, bench, todo, context, results, bar)
            ran += todo
    if bar is not None:
        bar.close()
    return ran


def inputs(settings: Settings) -> tuple[str, list[dict]]:
    """``(text, QA samples)``: loaded only by a process with runs to do."""
    if is_qa_dataset(settings.dataset):
        samples = load_samples(settings.dataset, settings.qa_samples)
        return "\n\n".join(sample["context"] for sample in samples), samples
    return load_text(settings.dataset, settings.text_file)[0], []


def _prepare(settings: Settings, jobs: list[Job], device: torch.device, dtype: torch.dtype) -> Bench:
    """Load the model and the inputs, and check every job (protocols, constructors, each task's
    own checks) before the first long run."""
    text, samples = inputs(settings)
    model, tokenizer = _model(settings, device, dtype)
    tasks = _tasks_of(job.task for job in jobs)
    try:
        ids = tokenize(tokenizer, text, max(2, *(task.stream_tokens(settings) for task in tasks)))
    except DataError as error:
        raise UsageError(f"{error}: lower --tokens or --contexts, or use a longer text") from error
    for protocol in {job.protocol for job in jobs} - {None, "any"}:
        try:
            check_protocol(model, protocol)
        except ValueError as error:
            raise UsageError(f"--protocol {protocol}: {error}") from error
    for spec in dict.fromkeys(job.run.spec(_context_of(job, settings)) for job in jobs):  # every constructor check first
        build_policy(model, spec, f"--policy {spec!r}")
    bench = Bench(settings, model, tokenizer, ids, text, samples)
    for task in tasks:
        task.prepare(bench, [job for job in jobs if task_for(job.task) is task])
    _warm_up(model, ids)
    return bench


def _run_unit(settings: Settings, bench: Bench, jobs: list[Job], context: dict, results: Path, bar: tqdm) -> None:
    """Run the jobs of one unit, task by task, appending each record as it is made (``context``:
    the setup and environment every record carries)."""
    first = jobs[0]
    spec = first.run.spec(_context_of(first, settings))
    fields = policy_fields(from_spec(bench.model, spec), spec, first.run.budget_for(_context_of(first, settings)))
    unit = Unit(first.run, jobs, spec, fields, lambda: from_spec(bench.model, spec))
    for task in _tasks_of(job.task for job in jobs):
        for job, figures in task.run(bench, unit, [job for job in jobs if task_for(job.task) is task]):
            record = {**fields, **figures, **_key(context, job, settings), **_sweep_fields(job), "policy_index": job.index}
            record["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            append_record(results, record)
            tqdm.write(f"{_job_label(job):>22}  {job.run.label}: {task.headline(record)}  ({record['elapsed_s']:.1f} s)", file=sys.stderr)
            bar.update()


def _sweep_fields(job: Job) -> dict:
    fields = {"family": job.run.family, "budget_swept": job.run.budget, "ratio": job.run.ratio, "label": job.run.label}
    if job.protocol is not None:
        fields["protocol"] = job.protocol
    return fields


def _job_label(job: Job) -> str:
    """``"niah_single@512 prefill"``: the task, its places and its protocol."""
    places = "".join(f"@{value}" for name, value in job.where if name != "protocol")
    return f"{job.task}{places}" + (f" {job.protocol}" if job.protocol is not None else "")


def policy_fields(cache, spec: str, swept: int | None) -> dict:
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


@torch.no_grad()
def _warm_up(model, ids: torch.Tensor) -> None:
    """A chunk and a decode step through a throwaway cache, so that the first policy measured
    does not pay the first calls' costs (kernel selection, allocator growth) in its figures."""
    length = min(DEFAULT_CHUNK, ids.shape[1] - 1)
    cache = DynamicCache(config=model.config)
    model(ids[:, :length].to(model.device), cache=cache)
    model(ids[:, length : length + 1].to(model.device), cache=cache)


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


def build_policy(model, spec: str, given_as: str, error: type[ValueError] = UsageError):
    """``from_spec(model, spec)``; ``error`` naming ``given_as`` (the option that gave the spec) for what
    the constructor refuses, and for a policy that governs none of the model's layers."""
    try:
        cache = from_spec(model, spec)
    except (ValueError, NotImplementedError) as problem:
        raise error(f"{given_as}: {problem}") from problem
    if isinstance(cache, PolicyCache) and cache.governed_layers == 0:
        raise error(
            f"{given_as} governs none of the model's {len(cache.layers)} layers (each keeps the model's own "
            "sliding window), so it would measure the model, not the policy: use a model with full-attention layers"
        )
    return cache
