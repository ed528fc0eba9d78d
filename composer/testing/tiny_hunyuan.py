"""Build a tiny HunyuanVideo text-to-video folder in exact diffusers layout, seeded.

The folder is written by diffusers' own `HunyuanVideoPipeline.save_pretrained` from diffusers'
`HunyuanVideoTransformer3DModel` and `AutoencoderKLHunyuanVideo`, transformers' `LlamaModel` and
`CLIPTextModel`, and two tokenizers built offline with fixed vocabularies (one token per character, the
Llama chat-template markers as special tokens), so the same text always gives the same ids.
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass
from pathlib import Path

import torch

# The Llama-3 chat markers HunyuanVideo's prompt template uses; the real tokenizer has them as special tokens.
LLAMA_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
_CHARS = list(string.printable.strip())


@dataclass(frozen=True)
class TinyHunyuanSpec:
    """Sizes of the tiny model (defaults: well under 1 MB of weights, a 9x48x80 4-step video in about a second)."""

    num_heads: int = 2
    head_dim: int = 16
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)
    num_layers: int = 1  # dual-stream blocks
    num_single_layers: int = 2
    num_refiner_layers: int = 1
    latent_channels: int = 4
    text_dim: int = 32  # Llama hidden size (the DiT's text_embed_dim)
    text_layers: int = 3  # the pipeline reads hidden_states[-3]: the output of layer 1
    clip_dim: int = 32  # CLIP hidden size (the DiT's pooled_projection_dim)
    vae_channels: tuple[int, ...] = (8, 8, 16, 16)
    flow_shift: float = 7.0
    seed: int = 0


def build_llama_tokenizer():
    """A Llama tokenizer (BPE without merges: one token per character, `▁` for a space) with the Llama-3
    begin/end-of-text and chat-header tokens; right padding, BOS added, as the HunyuanVideo tokenizer."""
    from transformers import LlamaTokenizer

    specials = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", *LLAMA_SPECIAL]
    vocab: dict[str, int] = {}
    for piece in [*specials, "\u2581", "\n", *_CHARS]:
        vocab.setdefault(piece, len(vocab))
    return LlamaTokenizer(
        vocab=vocab, merges=[], unk_token="<unk>", bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>", add_prefix_space=False, add_bos_token=True, padding_side="right",
        additional_special_tokens=LLAMA_SPECIAL,
    )


def build_clip_tokenizer():
    """A CLIP tokenizer (BPE without merges: one token per character, `</w>` ending a word)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in _CHARS:
        for piece in (ch, ch + "</w>"):
            vocab.setdefault(piece, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[])


def build_tiny_hunyuan_components(spec: TinyHunyuanSpec = TinyHunyuanSpec()) -> dict:
    """The diffusers / transformers modules of a tiny HunyuanVideo T2V pipeline, seeded by `spec.seed`."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    tokenizer, tokenizer_2 = build_llama_tokenizer(), build_clip_tokenizer()
    torch.manual_seed(spec.seed)
    text_encoder = LlamaModel(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.text_dim, intermediate_size=2 * spec.text_dim,
        num_hidden_layers=spec.text_layers, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )).eval()
    torch.manual_seed(spec.seed + 1)
    text_encoder_2 = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer_2), hidden_size=spec.clip_dim, intermediate_size=2 * spec.clip_dim,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77, projection_dim=spec.clip_dim,
        bos_token_id=tokenizer_2.bos_token_id, eos_token_id=tokenizer_2.eos_token_id,
        pad_token_id=tokenizer_2.pad_token_id,
    )).eval()
    torch.manual_seed(spec.seed + 2)
    blocks = len(spec.vae_channels)
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=spec.latent_channels, block_out_channels=spec.vae_channels, layers_per_block=1,
        norm_num_groups=4, down_block_types=("HunyuanVideoDownBlock3D",) * blocks,
        up_block_types=("HunyuanVideoUpBlock3D",) * blocks,
    ).eval()
    torch.manual_seed(spec.seed + 3)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=spec.latent_channels, out_channels=spec.latent_channels, num_attention_heads=spec.num_heads,
        attention_head_dim=spec.head_dim, num_layers=spec.num_layers, num_single_layers=spec.num_single_layers,
        num_refiner_layers=spec.num_refiner_layers, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=spec.text_dim, pooled_projection_dim=spec.clip_dim,
        rope_theta=256.0, rope_axes_dim=spec.rope_axes_dim,
    ).eval()
    _randomize_zero_inits(transformer, spec.seed + 4)
    return {
        "tokenizer": tokenizer, "text_encoder": text_encoder, "tokenizer_2": tokenizer_2,
        "text_encoder_2": text_encoder_2, "vae": vae, "transformer": transformer,
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=spec.flow_shift),
    }


def _randomize_zero_inits(module: torch.nn.Module, seed: int) -> None:
    """Perturb the norms' weights (initialised to ones) and biases (zeros): at their initial values a wrong
    norm weight or a dropped affine term would pass a parity test unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name and param.ndim == 1:
                param.add_(0.2 * torch.randn(param.shape, generator=g))


def build_tiny_hunyuan(path: str | Path, spec: TinyHunyuanSpec | None = None, **overrides) -> Path:
    """Write a tiny HunyuanVideo T2V diffusers folder at `path` (created; must not hold a model already)."""
    from diffusers import HunyuanVideoPipeline

    spec = dataclasses.replace(spec or TinyHunyuanSpec(), **overrides)
    path = Path(path)
    if (path / "model_index.json").exists():
        raise FileExistsError(f"{path} already holds a model")
    pipe = HunyuanVideoPipeline(**build_tiny_hunyuan_components(spec))
    pipe.save_pretrained(str(path), safe_serialization=True)
    return path
