"""Claims on runs, so that processes sharing an ``--out`` split its runs instead of repeating them.

A process claims a unit of runs before doing it: an exclusive, non-blocking ``flock`` on a file
named after the unit in ``OUT/.claims/``. Whoever holds the lock does the unit; the others pass
it by. The kernel releases the lock when its process ends, however it ends, so the claim of a
killed process never blocks a resume: its file is left behind unlocked, and the next process
that asks takes it over. A claim is released (its file removed) once the unit's records are
written; a process that ends its sweep removes the folder if it is empty.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

CLAIMS = ".claims"


def claim_path(out: Path, key: str) -> Path:
    """The file that stands for the unit named by ``key`` (any string that identifies it)."""
    return out / CLAIMS / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".claim")


@contextmanager
def claimed(out: Path, key: str) -> Iterator[bool]:
    """Yield whether this process holds the claim on ``key`` (``False``: another live process
    does); a claim held is released on leaving, its file removed."""
    path = claim_path(out, key)
    handle = _lock(path)
    if handle is None:
        yield False
        return
    try:
        yield True
    finally:
        path.unlink(missing_ok=True)  # before the lock goes: a process that opens it now makes a new one
        os.close(handle)


def _lock(path: Path) -> int | None:
    """The descriptor of ``path`` locked by this process, or ``None`` if another holds it."""
    while True:
        try:
            handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # no folder yet, or a finished process just removed it
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(handle)
            return None
        try:
            current = os.stat(path).st_ino == os.fstat(handle).st_ino
        except FileNotFoundError:
            current = False
        if current:
            os.ftruncate(handle, 0)  # who holds it, for a person looking at the folder
            os.write(handle, f"{socket.gethostname()} pid {os.getpid()} since {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n".encode())
            return handle
        os.close(handle)  # its holder finished and removed it between our open and our lock: ask again


def clear(out: Path) -> None:
    """Remove the claims folder if no claim is left in it."""
    try:
        (out / CLAIMS).rmdir()
    except OSError:
        pass  # missing, or a claim another process still holds
