"""Checkpoint parameter names -> composer's HunyuanVideo DiT names, as data (ordered regex rules).

composer keeps diffusers' names except where they carry diffusers' module plumbing: the `to_out.0` /
`net.0.proj` / `net.2` indices of its Attention and FeedForward wrappers, and the refiner's extra nesting.
"""

from __future__ import annotations

DIFFUSERS_TO_COMPOSER: list[tuple[str, str]] = [
    (r"\.to_out\.0\.", ".to_out."),
    (r"\.(ff|ff_context)\.net\.0\.proj\.", r".\1.fc_in."),
    (r"\.(ff|ff_context)\.net\.2\.", r".\1.fc_out."),
    (r"^context_embedder\.token_refiner\.refiner_blocks\.", "context_embedder.refiner_blocks."),
]
