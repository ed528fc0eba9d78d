"""Test helpers shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

# diffusers names -> the original Wan release's names, written out independently of composer's mapping table.
DIFFUSERS_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    (".attn1.to_out.0.", ".self_attn.o."),
    (".attn2.to_out.0.", ".cross_attn.o."),
    (".attn1.to_", ".self_attn."),
    (".attn2.to_", ".cross_attn."),
    (".attn1.norm_", ".self_attn.norm_"),
    (".attn2.norm_", ".cross_attn.norm_"),
    (".norm2.", ".norm3."),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    ("proj_out.", "head.head."),
]


def to_original_name(name: str) -> str:
    if name == "scale_shift_table":
        return "head.modulation"
    if name.endswith(".scale_shift_table"):
        return name.replace(".scale_shift_table", ".modulation")
    for old, new in DIFFUSERS_TO_ORIGINAL:
        name = name.replace(old, new)
    return name


def write_self_forcing_checkpoint(base: Path, path: Path, seed: int = 0, scale: float = 0.05, fsdp: bool = False,
                                  ema: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """A Self-Forcing-format checkpoint from a tiny Wan folder's transformer, its weights perturbed (so it is
    not the base model), with a critic and, optionally, an EMA copy perturbed differently."""
    base_state = load_file(base / "transformer" / "diffusion_pytorch_model.safetensors")
    g = torch.Generator().manual_seed(seed)
    prefix = "model._fsdp_wrapped_module." if fsdp else "model."

    def perturbed(s: float) -> dict[str, torch.Tensor]:
        return {prefix + to_original_name(k): v + s * torch.randn(v.shape, generator=g) for k, v in base_state.items()}

    raw = {"generator": perturbed(scale), "critic": {"model.dummy": torch.zeros(2)}}
    if ema:
        raw["generator_ema"] = perturbed(scale * 2)
    torch.save(raw, path)
    return raw
