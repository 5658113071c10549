"""A sweep: every policy x task on the same tokens, one record each, resumable, splittable.

The sweep's runs are listed in a fixed order; those already in ``results.jsonl`` are dropped;
the rest are dealt round-robin to the processes of an ``accelerate launch`` (one process: all
of them). A policy's perplexity and memory always go to the same process and share one pass
over the stream: the memory figures are those of the stream the perplexity was measured on.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_kvpolicies import available_policies, from_spec, parse_spec
from hf_kvpolicies.cache import PolicyCache
from hf_kvpolicies.models import DEFAULT_MODEL, EMBEDDED_MODELS, load_model

from .data import EMBEDDED_TEXT, DataError, load_text, tokenize
from .memory import MemoryTrace, decode_peak, memory_in_use
from .passkey import make_prompt, passkey_grid
from .perplexity import curve, perplexity, streaming_nll
from .records import RESULTS, append_record, environment, identity, locked, read_records
from .report import write_report
from .speed import speed_profile
from .stream import DEFAULT_CHUNK, resolve_chunk

TASKS = ("perplexity", "memory", "speed", "passkey")
DEFAULT_POLICIES = (
    "full",
    "window:window=256",
    "sink:sink_tokens=4,window=252,positions=absolute",
    "h2o:heavy=128,recent=128",
    "fp8",
)
"""Full plus one of each other policy at a 256-token budget (FP8 keeps every token, in fp8).

The sinks keep absolute positions: within the model's trained context that is the StreamingLLM
layout, and fast mode is exact for it (``positions=cache`` re-rotates, and streams token by token).
"""


DECODE_STEPS = 8
"""Decode steps at the end of the stream over which the peak memory is measured."""


class UsageError(ValueError):
    """Bad input: the CLI prints the message on one line and exits with status 2."""


@dataclass
class Settings:
    """Everything a sweep needs besides its policies and tasks (the CLI's options)."""

    model: str = DEFAULT_MODEL
    gguf_file: str | None = None
    dataset: str = EMBEDDED_TEXT
    text_file: str | None = None
    tokens: int = 1024
    chunk_size: int | None = None
    contexts: tuple[int, ...] = (512, 2048)
    steps: int = 16
    passkey_lengths: tuple[int, ...] = (320, 640)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    device: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None
    attn_implementation: str | None = None
    seed: int = 0
    out: Path = Path("results")
    progress: bool = True


@dataclass(frozen=True)
class Job:
    policy: str
    task: str
    index: int
    """The policy's place in the sweep: tables keep that order whoever ran the job."""


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


def task_params(task: str, settings: Settings) -> dict:
    """The settings a task's figures depend on (part of the run's identity)."""
    chunk = settings.chunk_size or "auto"
    if task in ("perplexity", "memory"):
        return {"tokens": settings.tokens, "chunk_size": chunk}
    if task == "speed":
        return {"contexts": list(settings.contexts), "steps": settings.steps}
    return {
        "lengths": list(settings.passkey_lengths),
        "depths": list(settings.passkey_depths),
        "seed": settings.seed,
        "chunk_size": chunk,
    }


def run_sweep(settings: Settings, policies: Sequence[str], tasks: Sequence[str]) -> Sweep:
    """Run the pending jobs of this process; write the report once every job has its record."""
    from accelerate import PartialState

    device = resolve_device(settings.device)
    state = PartialState(cpu=device.type == "cpu")
    if device.type == "cuda" and state.num_processes > 1 and settings.device_map is None:
        device = state.device
    dtype = resolve_dtype(settings.dtype, device)
    text, dataset = load_text(settings.dataset, settings.text_file)
    base = {
        "model": settings.model,
        "gguf_file": settings.gguf_file,
        "dataset": dataset,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
    }
    jobs = [Job(spec, task, index) for index, spec in enumerate(policies) for task in tasks]
    results = settings.out / RESULTS
    done = {identity(record) for record in read_records(results)}
    pending = [job for job in jobs if identity(_key(base, job, settings)) not in done]
    state.wait_for_everyone()  # every process has read the same file before any writes to it
    sweep = Sweep(jobs)
    units = _units(pending)
    sweep.ran = [job for unit in units[state.process_index :: state.num_processes] for job in unit]
    if sweep.ran:
        _run_jobs(settings, sweep.ran, base, device, dtype, text, results)
    with locked(results):
        records = read_records(results)
        have = {identity(record) for record in records}
        sweep.complete = all(identity(_key(base, job, settings)) in have for job in jobs)
        if sweep.complete:
            sweep.table = write_report(settings.out, records)
    return sweep


def _units(jobs: list[Job]) -> list[list[Job]]:
    """The jobs in units that one process runs together: a policy's perplexity and memory share
    a stream; speed and passkey stand alone. Units are dealt round-robin to the processes."""
    units: dict[tuple[str, str], list[Job]] = {}
    for job in jobs:
        group = "stream" if job.task in ("perplexity", "memory") else job.task
        units.setdefault((job.policy, group), []).append(job)
    return list(units.values())


def _key(base: dict, job: Job, settings: Settings) -> dict:
    return {**base, "policy": job.policy, "task": job.task, "params": task_params(job.task, settings)}


def _run_jobs(settings, jobs, base, device, dtype, text, results) -> None:
    model, tokenizer = _model(settings, device, dtype)
    tasks = {job.task for job in jobs}
    ids = _ids(settings, tokenizer, text, tasks)
    if "passkey" in tasks:
        _check_passkey(settings, tokenizer)
    policies = list(dict.fromkeys(job.policy for job in jobs))
    for spec in policies:
        _build(model, spec)  # every constructor check before the first long run
    _warm_up(model, ids)
    environment_fields = environment()
    bar = tqdm(total=len(jobs), disable=not settings.progress, desc="runs", unit="run")
    for spec in policies:
        mine = {job.task: job for job in jobs if job.policy == spec}
        for task, record in _measure(settings, model, tokenizer, ids, spec, mine):
            job = mine[task]
            record.update(_key(base, job, settings), policy_index=job.index, **environment_fields)
            record["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            append_record(results, record)
            tqdm.write(f"{task:>10}  {spec}: {_headline(record)}  ({record['elapsed_s']:.1f} s)", file=sys.stderr)
            bar.update()
    bar.close()


def _measure(settings, model, tokenizer, ids, spec, jobs):
    """Yield ``(task, record)`` for the jobs of one policy as each finishes."""
    def make():
        return from_spec(model, spec)
    desc = spec if len(spec) < 40 else spec[:37] + "..."
    if "perplexity" in jobs or "memory" in jobs:
        start = time.perf_counter()
        cache = make()
        chunk, approximate = resolve_chunk(cache, model, settings.chunk_size)
        stream = ids[:, : settings.tokens]
        before = memory_in_use(model.device)
        trace = MemoryTrace(cache, stride=max(1, settings.tokens // 64))
        nll = streaming_nll(
            model, stream, cache, progress=settings.progress, desc=desc, chunk_size=chunk, observer=trace.observe
        )
        trace.finish(stream.shape[1] - 1)
        elapsed = time.perf_counter() - start
        common = {"tokens": stream.shape[1], "chunk_size": chunk, "approximate": approximate, "elapsed_s": elapsed}
        if "perplexity" in jobs:
            positions, values = curve(nll)
            yield "perplexity", {**common, "ppl": perplexity(nll), "curve_positions": positions, "curve_ppl": values}
        if "memory" in jobs:
            kept = cache.stored_tokens(cache.first_policy_layer) if isinstance(cache, PolicyCache) else None
            record = {
                **common,
                "footprint_bytes": trace.bytes[-1],
                "footprint_max_bytes": max(trace.bytes),
                "footprint_positions": trace.positions,
                "footprint_trace": trace.bytes,
                "kept_tokens": kept,
            }
            peak = decode_peak(model, cache, stream[:, -1:], DECODE_STEPS, since=before)
            yield "memory", {**record, "peak_memory_bytes": peak.growth, "peak_memory_source": peak.source, "decode_steps": DECODE_STEPS}
    if "speed" in jobs:
        start = time.perf_counter()
        figures = speed_profile(model, make, ids, settings.contexts, steps=settings.steps, progress=settings.progress, desc=desc)
        yield "speed", {**figures, "steps": settings.steps, "approximate": False, "elapsed_s": time.perf_counter() - start}
    if "passkey" in jobs:
        start = time.perf_counter()
        chunk, approximate = resolve_chunk(make(), model, settings.chunk_size)
        grid = passkey_grid(
            model, tokenizer, make, settings.passkey_lengths, settings.passkey_depths, settings.seed, chunk,
            progress=settings.progress, desc=desc,
        )
        yield "passkey", {**grid, "chunk_size": chunk, "approximate": approximate, "elapsed_s": time.perf_counter() - start}


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
        return f"KV cache {record['footprint_bytes'] / 2**20:.2f} MiB, peak +{record['peak_memory_bytes'] / 2**20:.1f} MiB{mark}"
    if task == "speed":
        return ", ".join(f"{ms:.1f} ms/token @{c}" for c, ms in zip(record["contexts"], record["median_ms"]))
    return f"passkey accuracy {record['accuracy']:.2f}{mark}"


def _model(settings: Settings, device: torch.device, dtype: torch.dtype):
    device_map = settings.device_map or (str(device) if device.type == "cuda" else None)
    try:
        return load_model(settings.model, settings.gguf_file, dtype, device_map, settings.attn_implementation)
    except (OSError, ValueError, ModuleNotFoundError, FileNotFoundError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
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


def _check_passkey(settings: Settings, tokenizer) -> None:
    for length in settings.passkey_lengths:
        try:
            make_prompt(tokenizer, length, settings.passkey_depths[0], settings.seed)
        except ValueError as error:
            raise UsageError(f"--passkey-lengths: {error}") from error


def _build(model, spec: str):
    try:
        return from_spec(model, spec)
    except (ValueError, NotImplementedError) as error:
        raise UsageError(f"--policy {spec!r}: {error}") from error
