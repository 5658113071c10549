"""Storage formats, selected by name through ``storage=`` on every policy: native, fp8, and the
KIVI-style integer storages int8, int4 and int2."""

from __future__ import annotations

from collections.abc import Callable

from .affine import BITS
from .base import Storage
from .fp8 import FP8Storage
from .native import NativeStorage
from .quantized import QuantizedFactory, QuantizedStorage

StorageFactory = Callable[[], Storage]

_STORAGES: dict[str, StorageFactory] = {"native": NativeStorage, "fp8": FP8Storage}


def register_storage(name: str, factory: StorageFactory) -> None:
    """Make ``storage=name`` available to every retention policy.

    A factory that also has ``from_options(text)`` (returning a factory) accepts options in the
    name: ``storage="fp8:residual=16;dtype=e5m2"``, ``storage="int4:group_size=64;residual=128"``.
    """
    _STORAGES[name] = factory


for _bits in BITS:
    register_storage(f"int{_bits}", QuantizedFactory(_bits))


def available_storages() -> list[str]:
    return sorted(_STORAGES)


def storage_factory(storage: str | StorageFactory) -> StorageFactory:
    """Resolve ``storage=`` (a registered name, ``name:options``, or a zero-argument factory) to a factory."""
    if callable(storage):
        return storage
    name, _, options = str(storage).partition(":")
    if name not in _STORAGES:
        raise ValueError(
            f"unknown storage {storage!r}: choose one of {', '.join(available_storages())}"
        )
    factory = _STORAGES[name]
    if not options:
        return factory
    from_options = getattr(factory, "from_options", None)
    if from_options is None:
        raise ValueError(f"storage {name!r} takes no options, got {storage!r}")
    return from_options(options)


__all__ = [
    "FP8Storage",
    "NativeStorage",
    "QuantizedStorage",
    "Storage",
    "StorageFactory",
    "available_storages",
    "register_storage",
    "storage_factory",
]
