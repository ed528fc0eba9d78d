"""Wan2.1 models: the DiT (`WanTransformer3DModel`), its config and checkpoint name mappings."""
