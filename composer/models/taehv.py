"""A tiny preview decoder for video latents: the TAEHV architecture ("Tiny AutoEncoder for Hunyuan Video",
github.com/madebyollin/taehv), written for composer.

What it is. A small 2D-convolutional decoder (9.8 M parameters, 19 M for the "super" files, against the Wan2.1 VAE
decoder's 73 M, and no 3D convolutions) trained to turn a video model's latents into frames. It is
much cheaper than the real VAE and somewhat blurrier: composer uses it only for the previews of a causal stream
(`RuntimeArgs.preview_decoder`); whole videos are always decoded by the model's own VAE. Its quality cost against
the full VAE is measured by `benchmarks/vae.py --taehv FILE` (docs/memory.md, "Preview decoder").

The architecture, as the released weights files define it:

- frames are decoded as a stack of 2D images; the only time coupling is in the memory blocks, each of which also
  sees its own input at the previous time step (zeros before the first one), and in the frame-expansion layers,
  which turn every frame into `factor` consecutive frames (a 1x1 convolution whose output channels are split into
  `factor` groups, one per new frame);
- the base decoder: a soft clamp of the latents to (-3, 3) (3 tanh(x / 3)), a 3x3 convolution to 256 channels, then
  three stages of three memory blocks, a nearest x2 upsampling, a frame expansion and a 3x3 convolution (256 -> 128
  -> 64 -> 64 channels), and a last 3x3 convolution to 3 x patch^2 channels, pixel-shuffled by `patch` (Wan2.2's
  files: patch 2), clamped to [0, 1];
- the "super" decoder (`*_super` files: wider, ConvNeXt-like memory blocks) has no clamp, starts with a 1x1
  convolution to 512 channels, and upsamples with a convolution and a pixel shuffle instead of nearest upsampling.

The released files expand frames x1, x2, x2 (x4 in all: the Wan and HunyuanVideo VAEs' temporal factor); the decoder
drops its first `temporal_scale - 1` output frames, so T latent frames give 1 + 4 (T - 1) frames, as the VAEs do.

Latent scaling: the released files decode the latents the diffusion model works in (the DiT's normalized space), with
no per-channel mean/std or scaling factor applied; the reference's diffusers examples swap it in as a VAE whose
`latents_mean` is 0 and `latents_std` 1. So composer hands it its latents as they are (no `denormalize_latents`).

Weights: the parameter names follow the released files' `decoder.<index>...` layout (`load_preview_decoder` loads
them strictly); the files' `encoder.*` tensors are not used (composer decodes only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from composer.errors import InvalidInputError, problems_message

BASE_WIDTHS = (256, 128, 64, 64)  # the base decoder's channels: first stage ... the output convolution's input
SUPER_WIDTHS = (512, 256, 128, 64)
# where each variant's frame-expansion layers sit in `decoder` (nn.Sequential indices of the released files)
EXPANSION_INDEX = {"base": (7, 13, 19), "super": (7, 14, 21)}
OUTPUT_INDEX = 22  # the last convolution (3 x patch^2 output channels), both variants
SPATIAL_SCALE = 8  # three x2 upsamplings (before the patch's pixel shuffle)

# the released files' shapes -> their names (a description only; any consistent file loads)
KNOWN_FILES = {
    ("base", 16, 1): "taew2_1 (Wan2.1 / Wan2.2-A14B VAE) or taehv (HunyuanVideo)",
    ("base", 48, 2): "taew2_2 (Wan2.2-TI2V-5B VAE)",
    ("super", 48, 2): "taew2_2_super (Wan2.2-TI2V-5B VAE)",
    ("base", 32, 2): "taehv1_5 (HunyuanVideo 1.5)",
    ("super", 32, 2): "taehv1_5_super (HunyuanVideo 1.5)",
}


@dataclass(frozen=True)
class PreviewDecoderConfig:
    """The shape of a TAEHV decoder; `load_preview_decoder` reads it off a weights file."""

    latent_channels: int = 16
    patch_size: int = 1
    frame_factors: tuple[int, int, int] = (1, 2, 2)  # frames each expansion layer makes of one
    variant: str = "base"  # "base" or "super"

    @property
    def temporal_scale(self) -> int:
        return math.prod(self.frame_factors)

    @property
    def spatial_scale(self) -> int:
        return SPATIAL_SCALE * self.patch_size

    @property
    def frames_to_trim(self) -> int:
        """Leading output frames dropped, so that T latent frames give 1 + scale (T - 1) frames."""
        return self.temporal_scale - 1

    def num_frames(self, latent_frames: int) -> int:
        return max(0, latent_frames * self.temporal_scale - self.frames_to_trim)

    def describe(self) -> str:
        known = KNOWN_FILES.get((self.variant, self.latent_channels, self.patch_size))
        text = (f"{self.variant} TAEHV decoder, {self.latent_channels} latent channels, x{self.spatial_scale} "
                f"pixels, x{self.temporal_scale} frames")
        return f"{text} (the layout of {known})" if known else text


class SoftClamp(nn.Module):
    """Squash values smoothly into (-3, 3): 3 tanh(x / 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * (1.0 / 3.0)) * 3.0


class MemoryBlock(nn.Module):
    """Three 3x3 convolutions over [this frame's input, the previous frame's input] plus the input, then a ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(2 * channels, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
        )

    def forward(self, x: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat((x, previous), dim=1)) + x)


class WideMemoryBlock(nn.Module):
    """The super decoder's memory block: a 7x7 depthwise convolution over [input, previous input], a 1x1 expansion
    to twice that width, a ReLU and a 1x1 projection back, added to the input."""

    def __init__(self, channels: int):
        super().__init__()
        both = 2 * channels
        self.conv = nn.Sequential(
            nn.Conv2d(both, both, 7, padding=3, groups=both, bias=False),
            nn.Conv2d(both, 2 * both, 1), nn.ReLU(),
            nn.Conv2d(2 * both, channels, 1, bias=False),
        )

    def forward(self, x: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat((x, previous), dim=1)) + x


class FrameExpansion(nn.Module):
    """Each frame -> `factor` consecutive frames: a 1x1 convolution to factor x channels, group k being frame k."""

    def __init__(self, channels: int, factor: int):
        super().__init__()
        self.factor = factor
        self.conv = nn.Conv2d(channels, channels * factor, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [frames, C, h, w], batch-major, time order
        n, c, h, w = x.shape
        return self.conv(x).reshape(n * self.factor, c, h, w)


MEMORY_BLOCKS = (MemoryBlock, WideMemoryBlock)


def _conv3(cin: int, cout: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, padding=1, bias=bias)


def _base_layers(config: PreviewDecoderConfig) -> list[nn.Module]:
    w = BASE_WIDTHS
    layers: list[nn.Module] = [SoftClamp(), _conv3(config.latent_channels, w[0]), nn.ReLU()]
    for stage, factor in enumerate(config.frame_factors):
        layers += [MemoryBlock(w[stage]) for _ in range(3)]
        layers += [nn.Upsample(scale_factor=2), FrameExpansion(w[stage], factor), _conv3(w[stage], w[stage + 1], False)]
    return layers + [nn.ReLU(), _conv3(w[3], 3 * config.patch_size ** 2)]


def _super_layers(config: PreviewDecoderConfig) -> list[nn.Module]:
    w = SUPER_WIDTHS
    layers: list[nn.Module] = [nn.Conv2d(config.latent_channels, w[0], 1, bias=False)]
    for stage, factor in enumerate(config.frame_factors):
        layers += [WideMemoryBlock(w[stage]) for _ in range(3)]
        layers += [_conv3(w[stage], w[stage + 1] * 4), nn.ReLU(), nn.PixelShuffle(2),
                   FrameExpansion(w[stage + 1], factor)]
    return layers + [_conv3(w[3], 3 * config.patch_size ** 2)]


@dataclass
class PreviewDecoderState:
    """What the decoder carries from one block of latent frames to the next: each memory block's input at the last
    time step ([B, C, h, w], at that block's resolution; absent before the first block) and how many output frames it
    has made (the first `frames_to_trim` are dropped). Entries are replaced, never written in place, so a fork may
    share them."""

    memory: dict[int, torch.Tensor] = field(default_factory=dict)
    frames_made: int = 0

    def fork(self) -> PreviewDecoderState:
        return PreviewDecoderState(dict(self.memory), self.frames_made)

    @staticmethod
    def stack(states: list[PreviewDecoderState]) -> PreviewDecoderState:
        """Several streams' states as one batch (equal `frames_made` and memory layout), rows in order."""
        keys = states[0].memory.keys()
        return PreviewDecoderState({k: torch.cat([s.memory[k] for s in states]) for k in keys}, states[0].frames_made)

    def split(self, rows: list[int]) -> list[PreviewDecoderState]:
        parts = {k: v.split(rows) for k, v in self.memory.items()}
        return [PreviewDecoderState({k: p[i] for k, p in parts.items()}, self.frames_made) for i in range(len(rows))]


class TinyVideoDecoder(nn.Module):
    """The TAEHV decoder. `decode(latents)` decodes a whole latent video; `decode(latents, state)` decodes the next
    latent frames of a stream and returns the state to pass with the following ones: the pieces' frames equal the
    whole decode's (the memory blocks see the same previous inputs either way)."""

    def __init__(self, config: PreviewDecoderConfig | None = None):
        super().__init__()
        self.config = config = config or PreviewDecoderConfig()
        if config.variant not in EXPANSION_INDEX:
            raise ValueError(f"variant = {config.variant!r}: expected one of {', '.join(EXPANSION_INDEX)}")
        layers = _base_layers(config) if config.variant == "base" else _super_layers(config)
        self.decoder = nn.Sequential(*layers)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def decode(self, latents: torch.Tensor, state: PreviewDecoderState | None = None
               ) -> tuple[torch.Tensor, PreviewDecoderState]:
        """Latents [B, C, T, h, w] (the DiT's normalized latents) -> (video [B, 3, t, h * s, w * s] in [0, 1], the
        state after them). Without `state` the latents are a video's first frames (a whole video)."""
        cfg = self.config
        if latents.ndim != 5 or latents.shape[1] != cfg.latent_channels:
            raise InvalidInputError(f"preview decoder: latents of shape {list(latents.shape)}: expected "
                                    f"[batch, {cfg.latent_channels}, frames, height, width]")
        state = state or PreviewDecoderState()
        b, c, t, h, w = latents.shape
        x = latents.to(self.device, self.dtype).permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        memory = dict(state.memory)
        frames = t
        for index, layer in enumerate(self.decoder):
            if isinstance(layer, MEMORY_BLOCKS):
                seq = x.view(b, frames, *x.shape[1:])
                before = memory.get(index)
                before = seq.new_zeros((b, 1, *seq.shape[2:])) if before is None else before.unsqueeze(1)
                previous = torch.cat((before, seq[:, :-1]), dim=1).reshape(x.shape)
                memory[index] = seq[:, -1].clone()  # a copy: the block's whole input is not kept alive
                x = layer(x, previous)
            else:
                x = layer(x)
                if isinstance(layer, FrameExpansion):
                    frames *= layer.factor
        if cfg.patch_size > 1:
            x = F.pixel_shuffle(x, cfg.patch_size)
        video = x.clamp(0.0, 1.0).view(b, frames, *x.shape[1:])
        drop = min(frames, max(0, cfg.frames_to_trim - state.frames_made))
        video = video[:, drop:].permute(0, 2, 1, 3, 4)
        return video, PreviewDecoderState(memory, state.frames_made + frames)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """A whole latent video [B, C, T, h, w] -> video [B, 3, t, H, W] in [0, 1]."""
        return self.decode(latents)[0]


# -- weights files ---------------------------------------------------------------------------------------
def _read(file: Path) -> dict[str, torch.Tensor]:
    kind = "safetensors" if file.suffix == ".safetensors" else "torch (.pth)"
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(file), device="cpu")
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or foreign file: one clear error naming it
        raise InvalidInputError(f"preview decoder {str(file)!r}: cannot be read as a {kind} weights file "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise InvalidInputError(f"preview decoder {str(file)!r}: expected a state dict of named tensors (a TAEHV "
                                f"weights file), got a {type(tensors).__name__}")
    return tensors


def _shape(tensors: dict[str, torch.Tensor], key: str) -> tuple[int, ...] | None:
    value = tensors.get(key)
    return None if value is None else tuple(value.shape)


def infer_config(tensors: dict[str, torch.Tensor], name: str = "the weights") -> PreviewDecoderConfig:
    """The decoder a state dict is for, read off its tensors' shapes; InvalidInputError when it is no TAEHV decoder."""
    def fail(why: str) -> InvalidInputError:
        return InvalidInputError(f"preview decoder {name}: {why}; expected a TAEHV weights file (taew2_1.pth, "
                                 "taew2_2.pth, taehv.pth ... from github.com/madebyollin/taehv)")

    if not any(k.startswith("decoder.") for k in tensors):
        example = f", e.g. {', '.join(sorted(tensors)[:3])}" if tensors else ""
        raise fail(f"no decoder.* tensors (it has {len(tensors)} tensors{example})")
    first_1x1 = _shape(tensors, "decoder.0.weight")
    first_3x3 = _shape(tensors, "decoder.1.weight")
    if first_1x1 is not None and len(first_1x1) == 4 and first_1x1[2:] == (1, 1):
        variant, latent_channels, widths = "super", first_1x1[1], SUPER_WIDTHS[1:]
    elif first_3x3 is not None and len(first_3x3) == 4 and first_3x3[2:] == (3, 3):
        variant, latent_channels, widths = "base", first_3x3[1], BASE_WIDTHS[:3]
    else:
        raise fail(f"its first decoder convolution (decoder.1.weight, or decoder.0.weight in a super file) has shape "
                   f"{first_3x3 or first_1x1}")
    factors = []
    for index, channels in zip(EXPANSION_INDEX[variant], widths):
        key = f"decoder.{index}.conv.weight"
        shape = _shape(tensors, key)
        if shape is None or len(shape) != 4 or shape[1] != channels or shape[0] % channels:
            raise fail(f"{key} (a frame expansion) has shape {shape}, expected [{channels} x factor, {channels}, 1, 1]")
        factors.append(shape[0] // channels)
    out = _shape(tensors, f"decoder.{OUTPUT_INDEX}.weight")
    patch = math.isqrt(out[0] // 3) if out is not None and len(out) == 4 and out[0] % 3 == 0 else 0
    if patch < 1 or 3 * patch * patch != out[0]:
        raise fail(f"decoder.{OUTPUT_INDEX}.weight (the output convolution) has shape {out}, expected "
                   "[3 x patch^2, 64, 3, 3]")
    return PreviewDecoderConfig(latent_channels=latent_channels, patch_size=patch, frame_factors=tuple(factors),
                                variant=variant)


def load_preview_decoder(path: str | Path, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32) -> TinyVideoDecoder:
    """A TAEHV decoder from a local weights file (.pth read with weights_only=True, or .safetensors): its variant
    read off the tensors' shapes, its `decoder.*` tensors loaded strictly (the `encoder.*` ones are ignored). A file
    that is not one raises InvalidInputError naming the file and what did not match."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise InvalidInputError(f"preview decoder {str(path)!r}: "
                                f"{'a folder' if file.is_dir() else 'no such file'}; expected a TAEHV weights file")
    tensors = _read(file)
    name = repr(str(file))
    config = infer_config(tensors, name)
    model = TinyVideoDecoder(config)
    expected = model.state_dict()
    given = {k: v for k, v in tensors.items() if k.startswith("decoder.")}
    problems = []
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected)) + sorted(k for k in tensors if not k.startswith(("decoder.",
                                                                                                     "encoder.")))
    wrong = [f"{k} has shape {list(given[k].shape)}, expected {list(expected[k].shape)}"
             for k in sorted(set(given) & set(expected)) if given[k].shape != expected[k].shape]
    for label, items in (("missing", missing), ("unexpected", unexpected)):
        if items:
            more = f" and {len(items) - 4} more" if len(items) > 4 else ""
            problems.append(f"{len(items)} {label} tensor(s): {', '.join(items[:4])}{more}")
    problems += wrong[:4] + ([f"{len(wrong) - 4} more shape mismatches"] if len(wrong) > 4 else [])
    if problems:
        raise InvalidInputError(problems_message(f"preview decoder {name} does not fit a {config.describe()}",
                                                 problems))
    model.load_state_dict(given, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
