"""hf-kvpolicies: pluggable KV-cache policies for Hugging Face Transformers.

Two independent axes: *retention* (which tokens stay: full, window, sink, and the scored
evictions H2O, SnapKV, TOVA, key norm, KVzip, Expected Attention, KeyDiff) and *storage* (how
they are held: native dtype, fp8, int8/int4/int2). Every policy is a ``transformers.Cache``:

    cache = from_spec(model, "window:window=256")
    model.generate(**inputs, cache=cache)
"""

from .cache import PolicyCache, PolicyLayer
from .policies import FullCache, SlidingWindowCache
from .policies.expected_attention import ExpectedAttentionCache
from .policies.fp8 import FP8Cache
from .policies.h2o import H2OCache
from .policies.keydiff import KeyDiffCache
from .policies.knorm import KNormCache
from .policies.kvzip import KVzipCache
from .policies.scored import ScoredCache
from .policies.sink import SinkCache
from .policies.snapkv import SnapKVCache
from .policies.tova import TOVACache
from .specs import available_policies, from_spec, parse_spec, register_policy
from .storage import FP8Storage, QuantizedStorage, available_storages, register_storage

register_policy("full", FullCache)
register_policy("window", SlidingWindowCache)
register_policy("fp8", FP8Cache)
register_policy("h2o", H2OCache)
register_policy("kvzip", KVzipCache)
register_policy("sink", SinkCache)
register_policy("snapkv", SnapKVCache)
register_policy("tova", TOVACache)
register_policy("knorm", KNormCache)
register_policy("expected_attention", ExpectedAttentionCache)
register_policy("keydiff", KeyDiffCache)

__all__ = [
    "ExpectedAttentionCache",
    "FP8Cache",
    "FP8Storage",
    "FullCache",
    "H2OCache",
    "KeyDiffCache",
    "KNormCache",
    "KVzipCache",
    "PolicyCache",
    "PolicyLayer",
    "QuantizedStorage",
    "ScoredCache",
    "SinkCache",
    "SlidingWindowCache",
    "SnapKVCache",
    "TOVACache",
    "available_policies",
    "available_storages",
    "from_spec",
    "parse_spec",
    "register_policy",
    "register_storage",
]
