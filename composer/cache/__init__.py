"""KV cache management for causal (block-autoregressive) generation."""

from composer.cache.kv_cache import KVCache, KVCacheSpec

__all__ = ["KVCache", "KVCacheSpec"]
