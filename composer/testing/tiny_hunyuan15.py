"""Build tiny HunyuanVideo-1.5 text- and image-to-video folders in exact diffusers layout, seeded.

The folder is written by diffusers' own `HunyuanVideo15Pipeline.save_pretrained` from diffusers'
`HunyuanVideo15Transformer3DModel`, `AutoencoderKLHunyuanVideo15`, `FlowMatchEulerDiscreteScheduler` and
`ClassifierFreeGuidance` (the guider, a component of its own), transformers' `Qwen2_5_VLTextModel` and
`T5EncoderModel`, a byte-level Qwen2 tokenizer built offline (the 256 byte symbols, the chat markers as special
tokens and a Qwen-style chat template: the same text always gives the same ids) and the ByT5 tokenizer (bytes:
it needs no vocabulary file); the image-to-video folder (`HunyuanVideo15ImageToVideoPipeline`) adds transformers'
`SiglipVisionModel` and its image processor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

# Qwen2.5's chat template for string contents (the released one also renders images and tool calls).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class TinyHunyuan15Spec:
    """Sizes of the tiny model (defaults: about 1 MB of weights; a 9x48x80 video is 3x3x5 latents)."""

    num_heads: int = 2
    head_dim: int = 16
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)
    num_layers: int = 2
    num_refiner_layers: int = 1
    latent_channels: int = 4
    text_dim: int = 32  # Qwen2.5-VL hidden size (the DiT's text_embed_dim)
    text_layers: int = 3  # the pipeline reads hidden_states[-3]: the output of layer 1
    byt5_dim: int = 16  # T5 d_model (the DiT's text_embed_2_dim)
    image_embed_dim: int = 12  # the SigLIP width the DiT's image projection takes (zeros for text-to-video)
    vae_channels: tuple[int, ...] = (8, 8, 16, 16, 16)  # 5 blocks: 16x spatial, 4x temporal
    target_size: int = 64  # the default size's pixel budget (diffusers' pipeline sizes a video without one by it)
    siglip_image_size: int = 32  # image-to-video: the vision tower's input (32 / 8 = 4x4 = 16 image tokens)
    flow_shift: float = 5.0
    guidance_scale: float = 6.0
    guidance_rescale: float = 0.0
    seed: int = 0


def build_qwen_tokenizer():
    """A byte-level Qwen2 tokenizer without merges: one token per byte, `<|im_start|>` / `<|im_end|>` special."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {token: i for i, token in enumerate(QWEN_SPECIAL)}
    for symbol in bytes_to_unicode().values():
        vocab.setdefault(symbol, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", additional_special_tokens=QWEN_SPECIAL[1:])
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def build_tiny_hunyuan15_components(spec: TinyHunyuan15Spec = TinyHunyuan15Spec()) -> dict:
    """The diffusers / transformers modules of a tiny HunyuanVideo-1.5 T2V pipeline, seeded by `spec.seed`."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    tokenizer, tokenizer_2 = build_qwen_tokenizer(), ByT5Tokenizer()
    torch.manual_seed(spec.seed)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=spec.text_dim, intermediate_size=2 * spec.text_dim,
        num_hidden_layers=spec.text_layers, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
    )).eval()
    torch.manual_seed(spec.seed + 1)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=spec.byt5_dim, d_kv=8, d_ff=2 * spec.byt5_dim, num_layers=2,
        num_heads=2, feed_forward_proj="gated-gelu", pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
    )).eval()
    torch.manual_seed(spec.seed + 2)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=spec.latent_channels, block_out_channels=spec.vae_channels, layers_per_block=1,
    ).eval()
    torch.manual_seed(spec.seed + 3)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * spec.latent_channels + 1, out_channels=spec.latent_channels,
        num_attention_heads=spec.num_heads, attention_head_dim=spec.head_dim, num_layers=spec.num_layers,
        num_refiner_layers=spec.num_refiner_layers, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
        text_embed_dim=spec.text_dim, text_embed_2_dim=spec.byt5_dim, image_embed_dim=spec.image_embed_dim,
        rope_theta=256.0, rope_axes_dim=spec.rope_axes_dim, target_size=spec.target_size, task_type="t2v",
    ).eval()
    _randomize_zero_inits(transformer, spec.seed + 4)
    return {
        "tokenizer": tokenizer, "text_encoder": text_encoder, "tokenizer_2": tokenizer_2,
        "text_encoder_2": text_encoder_2, "vae": vae, "transformer": transformer,
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=spec.flow_shift),
        "guider": ClassifierFreeGuidance(guidance_scale=spec.guidance_scale, guidance_rescale=spec.guidance_rescale),
    }


def _randomize_zero_inits(module: torch.nn.Module, seed: int) -> None:
    """Perturb the norms' weights (ones) and biases (zeros) and the condition-type table: at their initial values a
    wrong norm weight or a dropped affine term would pass a parity test unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ("norm" in name and param.ndim == 1) or name.startswith("cond_type_embed"):
                param.add_(0.2 * torch.randn(param.shape, generator=g))


def build_tiny_hunyuan15(path: str | Path, spec: TinyHunyuan15Spec | None = None, **overrides) -> Path:
    """Write a tiny HunyuanVideo-1.5 T2V diffusers folder at `path` (created; must not hold a model already)."""
    from diffusers import HunyuanVideo15Pipeline

    spec = dataclasses.replace(spec or TinyHunyuan15Spec(), **overrides)
    return _save(HunyuanVideo15Pipeline(**build_tiny_hunyuan15_components(spec)), path)


def build_tiny_hunyuan15_i2v(path: str | Path, spec: TinyHunyuan15Spec | None = None, **overrides) -> Path:
    """Write a tiny HunyuanVideo-1.5 I2V diffusers folder at `path`: the T2V components (`task_type` "i2v") and a
    seeded SigLIP vision tower of `image_embed_dim` width."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    spec = dataclasses.replace(spec or TinyHunyuan15Spec(), **overrides)
    components = build_tiny_hunyuan15_components(spec)
    components["transformer"].register_to_config(task_type="i2v")
    torch.manual_seed(spec.seed + 5)
    components["image_encoder"] = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=spec.image_embed_dim, intermediate_size=2 * spec.image_embed_dim, num_hidden_layers=1,
        num_attention_heads=2, image_size=spec.siglip_image_size, patch_size=8,
    )).eval()
    size = spec.siglip_image_size
    # the PIL backend by name: the torchvision one (what `SiglipImageProcessor` is where torchvision is installed)
    # may round differently
    components["feature_extractor"] = SiglipImageProcessorPil(size={"height": size, "width": size})
    return _save(HunyuanVideo15ImageToVideoPipeline(**components), path)


def _save(pipe, path: str | Path) -> Path:
    path = Path(path)
    if (path / "model_index.json").exists():
        raise FileExistsError(f"{path} already holds a model")
    pipe.save_pretrained(str(path), safe_serialization=True)
    return path
