"""Storage formats, selected by name through ``storage=`` on every policy."""

from __future__ import annotations

from collections.abc import Callable

from .base import Storage
from .native import NativeStorage

StorageFactory = Callable[[], Storage]

_STORAGES: dict[str, StorageFactory] = {"native": NativeStorage}


def register_storage(name: str, factory: StorageFactory) -> None:
    """Make ``storage=name`` available to every retention policy."""
    _STORAGES[name] = factory


def available_storages() -> list[str]:
    return sorted(_STORAGES)


def storage_factory(storage: str | StorageFactory) -> StorageFactory:
    """Resolve ``storage=`` (a registered name, or a zero-argument factory) to a factory."""
    if callable(storage):
        return storage
    if storage not in _STORAGES:
        raise ValueError(
            f"unknown storage {storage!r}: choose one of {', '.join(available_storages())}"
        )
    return _STORAGES[storage]


__all__ = ["NativeStorage", "Storage", "StorageFactory", "available_storages", "register_storage", "storage_factory"]
