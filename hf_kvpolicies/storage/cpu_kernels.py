"""Fused CPU kernels for integer storage reads: packed codes to the model's keys and values in one pass.

A read in PyTorch operations unpacks each plane, joins the planes, widens the codes, scales and
shifts them and lays the residual over them: some fifteen operations per tensor, each a pass over
the layer's slots, and on a CPU at a thousand tokens their dispatch, not their bytes, sets the
time. The kernels of ``cpu_kernels.c`` do the same arithmetic in one pass (the definition of
:mod:`.affine`: ``zero + code * scale`` in float32, whose product is exact, so the sum is its one
rounding), and give the same bits as the PyTorch operations (``tests/test_cpu_kernels.py``).

They are built on first use with the system's C compiler (``$CC``, else ``cc``) into
``$HF_KVPOLICIES_CACHE`` (default ``~/.cache/hf_kvpolicies``) and run on the OpenMP runtime that
PyTorch has loaded, with ``torch.get_num_threads()`` threads. The PyTorch operations run instead
wherever the kernels cannot serve: no compiler, a tensor off the CPU, a model in float16,
a residual that carries gradients, a step traced by ``torch.compile``, or
``HF_KVPOLICIES_CPU_KERNELS=0`` in the environment (or :func:`portable` in the code).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
MAX_WIDTH = 1024  # the kernels' per-thread buffers (MAX_WIDTH in cpu_kernels.c)
MODEL_DTYPES = (torch.float32, torch.bfloat16)
"""Models whose integer reads the kernels decode (a float16 model's zero points and scales are float16)."""

_enabled = True  # False inside portable()


@contextmanager
def portable() -> Iterator[None]:
    """Read inside the block as an accelerator does: through PyTorch operations, the ones a GPU
    runs where the CPU has a faster way of its own (the operation counts of
    ``tests/test_decode_ops.py`` and ``eval/benchmarks/ops.py`` are of this path)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built kernels, or ``None`` where they are turned off or cannot be built (said once in the log)."""
    if os.environ.get("HF_KVPOLICIES_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(), platform.machine().encode()])).hexdigest()[:16]
    directory = Path(os.environ.get("HF_KVPOLICIES_CACHE") or Path.home() / ".cache" / "hf_kvpolicies")
    target = directory / f"cpu_kernels-{key}.so"
    try:
        if not target.exists():
            directory.mkdir(parents=True, exist_ok=True)
            handle, built = tempfile.mkstemp(dir=directory, suffix=".so")
            os.close(handle)
            try:
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", built], check=True, capture_output=True, timeout=300)
                os.replace(built, target)  # atomic: processes building at once each install a whole library
            finally:
                Path(built).unlink(missing_ok=True)
        kernels = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        output = getattr(error, "stderr", None)
        detail = output.decode(errors="replace").strip() if isinstance(output, bytes) and output else error
        logger.info(
            "integer storage reads through PyTorch operations (slower on the CPU): its CPU kernels did not build with %s "
            "(%s); install a C compiler with OpenMP or name one in CC",
            compiler,
            detail,
        )
        return None
    pointers, integers = [ctypes.c_void_p] * 4, [ctypes.c_int64] * 9
    kernels.decode_channel_groups.argtypes = pointers + integers
    kernels.decode_token_groups.argtypes = pointers + integers
    kernels.overlay_entries.argtypes = pointers + [ctypes.c_int64] * 8
    for function in (kernels.decode_channel_groups, kernels.decode_token_groups, kernels.overlay_entries):
        function.restype = None
    return kernels


def _kernels(*devices: torch.device) -> ctypes.CDLL | None:
    """The kernels, where they may serve tensors on ``devices``: on the CPU, outside tracing."""
    if not _enabled or torch.compiler.is_compiling() or any(device.type != "cpu" for device in devices):
        return None
    return library()


def on_cpu_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` take the CPU's own way where one differs from an
    accelerator's: on the CPU, outside :func:`portable`."""
    return _enabled and device.type == "cpu"


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of ``dtype`` on ``device`` has its integer reads decoded by the kernels."""
    return dtype in MODEL_DTYPES and _kernels(device) is not None


def _row_stride(tensor: torch.Tensor) -> int | None:
    """Elements between rows (batch x heads) of ``[batch, heads, slots, inner]``, where each row's
    slots lie packed one after another and the rows are evenly spaced (``None`` otherwise)."""
    batch, heads, _, inner = tensor.shape
    if tensor.stride(3) != 1 or tensor.stride(2) != inner:
        return None
    if heads == 1:
        return tensor.stride(0)
    if batch > 1 and tensor.stride(0) != heads * tensor.stride(1):
        return None
    return tensor.stride(1)


KERNELS = {-2: "decode_channel_groups", -1: "decode_token_groups"}


def decode_groups(
    codes: torch.Tensor,
    zero: torch.Tensor,
    scale: torch.Tensor,
    length: int,
    width: int,
    group: int,
    axis: int,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """Slots ``[0, length)`` of ``codes`` decoded into ``[batch, heads, length, width]``; the
    groups run along ``axis`` as in :func:`.affine.decode_groups`: ``-2``, each channel over groups
    of ``group`` slots (``zero``/``scale``: ``[batch, heads, groups, width]`` bfloat16), or ``-1``,
    each slot in groups of ``group`` channels (``[batch, heads, slots, groups]``), then cast to
    ``dtype`` (the model's) as the PyTorch operations cast it. ``None`` where the kernels cannot
    serve: a model in float16 (its zero points and scales are float16) or off the CPU."""
    if dtype not in MODEL_DTYPES:
        return None
    kernels = _kernels(codes.device)
    code_row, param_row = _row_stride(codes), _row_stride(zero)
    if kernels is None or code_row is None or param_row is None or param_row != _row_stride(scale):
        return None
    if zero.dtype != torch.bfloat16 or scale.dtype != torch.bfloat16 or width > MAX_WIDTH or zero.stride() != scale.stride():
        return None
    batch, heads = codes.shape[:2]
    out = torch.empty(batch, heads, length, width, dtype=torch.float32)
    getattr(kernels, KERNELS[axis])(
        out.data_ptr(), codes.data_ptr(), zero.data_ptr(), scale.data_ptr(),
        batch * heads, length, width, codes.shape[3], code_row, param_row, group, bits, torch.get_num_threads(),
    )  # fmt: skip
    return out.to(dtype)


def overlay_entries(keys: torch.Tensor, values: torch.Tensor, native: torch.Tensor, slots: torch.Tensor, count: int) -> bool:
    """Write the first ``count`` residual entries (``native``: ``[batch, heads, size, key + value
    width]``, the slot each shadows in ``slots``, ``-1`` for none) over contiguous ``keys`` and
    ``values`` of its dtype, skipping slots outside them; ``False`` (nothing written) where the
    kernels cannot serve, or autograd must see the entries written."""
    kernels = _kernels(keys.device, native.device)
    if kernels is None or not keys.dtype == values.dtype == native.dtype:
        return False
    if not (keys.is_contiguous() and values.is_contiguous() and native.is_contiguous() and slots.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (native.requires_grad or keys.requires_grad or values.requires_grad):
        return False
    batch, heads, length, key_width = keys.shape
    kernels.overlay_entries(
        keys.data_ptr(), values.data_ptr(), native.data_ptr(), slots.data_ptr(), batch * heads, length, key_width,
        values.shape[3], native.shape[2], count, keys.element_size(), torch.get_num_threads(),
    )  # fmt: skip
    return True
