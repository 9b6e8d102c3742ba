"""KV memory: page allocation, the prefix cache, host/disk tiers and the KV cache manager."""

from kvjax.memory.block_manager import AllocStatus, BlockManager, CopyOp
from kvjax.memory.kv_cache_manager import KVCacheManager
from kvjax.memory.ops import HostKV, KVDevice, KVOp, KVOpKind
from kvjax.memory.prefix_cache import PrefixCache
from kvjax.memory.slots import SlotAllocator

__all__ = [
    "AllocStatus",
    "BlockManager",
    "CopyOp",
    "HostKV",
    "KVCacheManager",
    "KVDevice",
    "KVOp",
    "KVOpKind",
    "PrefixCache",
    "SlotAllocator",
]
