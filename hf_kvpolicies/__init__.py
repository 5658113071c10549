"""hf-kvpolicies: pluggable KV-cache policies for Hugging Face Transformers.

Two independent axes: *retention* (which tokens stay: full, window, sink, H2O) and *storage*
(how they are held: native dtype, fp8). Every policy is a ``transformers.Cache``:

    cache = from_spec(model, "window:window=256")
    model.generate(**inputs, past_key_values=cache)
"""

from .cache import PolicyCache, PolicyLayer
from .policies import FullCache, SlidingWindowCache
from .specs import available_policies, from_spec, parse_spec, register_policy
from .storage import available_storages, register_storage

register_policy("full", FullCache)
register_policy("window", SlidingWindowCache)

__all__ = [
    "FullCache",
    "PolicyCache",
    "PolicyLayer",
    "SlidingWindowCache",
    "available_policies",
    "available_storages",
    "from_spec",
    "parse_spec",
    "register_policy",
    "register_storage",
]
