"""Generation engines: the only way training and evaluation generate text. An engine is one
class behind `rlkit.components.Engine` (group `engine`); `kv_cache` is the built-in one."""
from rlkit.engines.kv_cache import KVCache

__all__ = ["KVCache"]
