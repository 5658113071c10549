"""``results.jsonl``: one JSON record per policy x task, appended as each run finishes.

Appending one line at a time under a lock on the file keeps it valid when a sweep is
interrupted (at worst its last line is cut: it is skipped on reading, with a warning, and the
next record starts on a line of its own) and when several processes write to it. Records are
ASCII JSON and lines are read one by one, so that no damaged line makes the file unreadable. A run is identified by
:data:`IDENTITY` (what was measured, on what, how): a record with the same identity is
already done, which is how an interrupted sweep resumes.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import BinaryIO

import torch

from .fields import problem, record_of, text

RESULTS = "results.jsonl"
IDENTITY = ("model", "gguf_file", "dataset", "device", "dtype", "policy", "task", "params")
"""The fields that make two records the same run; ``params`` holds the task's own settings."""
VOLATILE = ("created", "elapsed_s", "peak_memory_bytes", "prefill_ms", "median_ms", "p90_ms", "tokens_per_s")
"""Fields that change from one run of the same measurement to the next (timings, RSS)."""


def identity(record: dict) -> str:
    return json.dumps({field: record.get(field) for field in IDENTITY}, sort_keys=True)


RECORD = {"policy": text, "task": text, "params": record_of({})}
"""What makes a line a record at all: an object that names its policy, its task and its params."""
Warn = Callable[[str], None]


def read_records(path: Path, warn: Warn | None = None, check: Callable[[dict], str | None] | None = None) -> list[dict]:
    """Every record of a results file, in the order written (missing file: none).

    A line that is not a record (cut short by a killed write, not UTF-8, not JSON, not an object
    naming its policy, task and params) or that ``check`` refuses is skipped, and ``warn`` is told
    its line number and why: that run is simply not done, and a resumed sweep runs it again.
    """
    if not path.exists():
        return []
    records = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        found = _parse(raw)
        if isinstance(found, dict):
            found = problem(found, RECORD) or (check(found) if check else None) or found
        if isinstance(found, str):
            if warn is not None:
                warn(f"{path}, line {number}: {found}: skipped")
            continue
        records.append(found)
    return records


def _parse(raw: bytes) -> dict | str:
    """The line's record, or what is wrong with it."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 (a write cut short?)"
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return "not a JSON record (a write cut short?)"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a record"
    return record


@contextmanager
def locked(path: Path) -> Iterator[BinaryIO]:
    """The results file opened to append and read, under an exclusive lock that every process
    writing the same results takes (the lock is on the file itself: nothing is left behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def append_record(path: Path, record: dict) -> None:
    """Append ``record`` as one line of ASCII JSON, on a line of its own: after a line that a
    killed write cut short, a newline first, so that the cut line alone is lost."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode("ascii")
    with locked(path) as handle:
        handle.seek(0, os.SEEK_END)
        if handle.tell():
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                line = b"\n" + line
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def environment() -> dict:
    """Library versions, the git revision and the CPU threads: what a figure was measured with."""
    return {
        "versions": dict(_versions()),
        "git_revision": git_revision(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
    }


@lru_cache(maxsize=1)
def _versions() -> tuple[tuple[str, str | None], ...]:
    """Python's and the libraries' versions (read once: reading package metadata takes a while)."""
    versions = [("python", platform.python_version())]
    for package in ("hf-kvpolicies", "torch", "transformers", "accelerate", "datasets"):
        try:
            versions.append((package, metadata.version(package)))
        except metadata.PackageNotFoundError:
            versions.append((package, None))
    return tuple(versions)


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
