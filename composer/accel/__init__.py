"""Accelerators applied to loaded modules (hooks): weight offloading today; LoRA, step caches and compile
are planned. Nothing here imports a model family: hooks find what they need through class attributes
(e.g. `repeated_blocks`)."""
