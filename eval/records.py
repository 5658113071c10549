"""``results.jsonl``: one JSON record per policy x task, appended as each run finishes.

Appending one line at a time under a file lock keeps the file valid when a sweep is
interrupted (at worst its last line is cut, and skipped on reading) and when several
processes of one ``accelerate launch`` write to it. A run is identified by
:data:`IDENTITY` (what was measured, on what, how): a record with the same identity is
already done, which is how an interrupted sweep resumes.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import torch

RESULTS = "results.jsonl"
IDENTITY = ("model", "gguf_file", "dataset", "device", "dtype", "policy", "task", "params")
"""The fields that make two records the same run; ``params`` holds the task's own settings."""
VOLATILE = ("created", "elapsed_s", "peak_memory_bytes", "prefill_ms", "median_ms", "p90_ms", "tokens_per_s")
"""Fields that change from one run of the same measurement to the next (timings, RSS)."""


def identity(record: dict) -> str:
    return json.dumps({field: record.get(field) for field in IDENTITY}, sort_keys=True)


def read_records(path: Path) -> list[dict]:
    """Every complete record of a results file, in the order written (missing file: none)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line an interrupted write cut short: that run is simply not done
    return records


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path.lock``, shared by every process writing the same results."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def append_record(path: Path, record: dict) -> None:
    line = json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n"
    with locked(path), open(path, "a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def environment() -> dict:
    """Library versions, the git revision and the CPU threads: what a figure was measured with."""
    versions = {"python": platform.python_version()}
    for package in ("hf-kvpolicies", "torch", "transformers", "accelerate", "datasets"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "versions": versions,
        "git_revision": git_revision(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
    }


@lru_cache(maxsize=1)
def git_revision() -> str | None:
    """``git describe --always --dirty`` of the checkout this code runs from, if it is one."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
