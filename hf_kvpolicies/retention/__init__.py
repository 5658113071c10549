"""Retention policies: which tokens stay in each layer's cache."""

from .base import Retention
from .full import FullRetention
from .scored import ScoredRetention
from .window import RingRetention

__all__ = ["FullRetention", "Retention", "RingRetention", "ScoredRetention"]
