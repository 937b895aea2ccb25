"""Generation engines: the only way training and evaluation generate text. An engine is one
class behind `rlkit.components.Engine` (group `engine`); `kv_cache` is the built-in one; `off_policy` lags and/or
runs in another precision."""

from rlkit.engines.kv_cache import KVCache
from rlkit.engines.off_policy import OffPolicy

__all__ = ["KVCache", "OffPolicy"]
