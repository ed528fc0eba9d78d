"""Parallel primitives (sequence-parallel attention and the like) that wrap composer's single `Attention`."""
