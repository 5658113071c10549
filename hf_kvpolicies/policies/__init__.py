"""The named policies: thin presets of ``PolicyCache`` = one retention x one storage."""

from .full import FullCache
from .window import SlidingWindowCache

__all__ = ["FullCache", "SlidingWindowCache"]
