"""KV cache management for causal (block-autoregressive) generation."""

from composer.cache.kv_cache import KVCache, KVCacheGroup, KVCacheSpec

__all__ = ["KVCache", "KVCacheGroup", "KVCacheSpec"]
