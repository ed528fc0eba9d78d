"""Exact tiled decoding and encoding for the Wan VAE (AutoencoderKLWan: Wan2.1 and Wan2.2).

Encoding (`encode_tiled`) is split the other way round: the encoder's full-resolution head in tiles with a halo
(aligned to its stride), the deeper layers and the mid block on whole frames. Decoding:

diffusers' `enable_tiling()` decodes overlapping tiles independently and blends their seams: each tile's mid-block
attention sees only its own tile, so the frames change (up to 47 uint8 levels at 480p, docs/gpu.md). composer
splits the decoder where it stops being global:

- the trunk (post_quant_conv, conv_in, the mid block with its attention over the whole latent frame, and the first
  up blocks) runs on whole frames, at resolutions where it is cheap;
- the head (the last two up blocks, norm_out, conv_out: convolutions, nearest upsampling and a per-position RMS norm,
  all local) runs tile by tile, each tile taken with a halo as wide as the head's receptive field, its own causal
  temporal cache carried from frame to frame, and only its interior kept.

Every output pixel then sees exactly the inputs it sees in the whole decode: the frames equal the untiled decode up
to the float rounding of convolutions over other shapes (tested <= 1 uint8 level). The halo costs compute (the last
two blocks' receptive field is 2.5 latent pixels: 20 output pixels); the peak memory is the head's activations of one
tile instead of one whole frame, at the resolutions where they are largest.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from composer.stages.tile_grid import _aligned_spans, _tiles

CACHE_T = 2  # the Wan VAE keeps the last two frames of each causal convolution's input
DEFAULT_TILE = 32  # latent pixels a side: the memory planner's choice (256 output pixels, as diffusers' tiles)


def supports_exact_tiling(vae) -> bool:
    decoder = getattr(vae, "decoder", None)
    return (type(vae).__name__ == "AutoencoderKLWan" and decoder is not None
            and all(hasattr(decoder, n) for n in ("conv_in", "mid_block", "up_blocks", "norm_out", "conv_out")))


def has_exact_tiled_decode(vae) -> bool:
    """composer decodes this VAE in exact tiles: the Wan VAE here, the HunyuanVideo VAEs in vae_tiling_hunyuan."""
    from composer.stages.vae_tiling_hunyuan import supports_hunyuan_tiling

    return supports_exact_tiling(vae) or supports_hunyuan_tiling(vae)


def decode_exact_tiled(vae, z: torch.Tensor, tile: int = 32, group=None) -> torch.Tensor:
    """The whole-video decode of denormalized latents `z` in exact spatial tiles, for any VAE with
    `has_exact_tiled_decode` (`decode_tiled` for the Wan VAE, `decode_tiled_hunyuan` for HunyuanVideo's)."""
    if supports_exact_tiling(vae):
        return decode_tiled(vae, z, tile=tile, group=group)
    from composer.stages.vae_tiling_hunyuan import decode_tiled_hunyuan

    return decode_tiled_hunyuan(vae, z, tile=tile, group=group)


def head_radius(decoder: nn.Module, trunk_blocks: int) -> float:
    """The head's spatial receptive-field radius in pixels of its input (the trunk's output): each k x k
    convolution adds (k // 2) pixels at its resolution, i.e. (k // 2) / scale input pixels, the scale doubling at
    each nearest upsampling."""
    radius, scale = 0.0, 1.0
    head = [*decoder.up_blocks[trunk_blocks:], decoder.norm_out, decoder.conv_out]
    for module in (m for part in head for m in part.modules()):
        if isinstance(module, nn.Upsample):
            factor = module.scale_factor
            scale *= float(factor[-1] if isinstance(factor, (tuple, list)) else factor)
        elif isinstance(module, (nn.Conv2d, nn.Conv3d)):
            if module.stride[-1] != 1:
                raise ValueError(f"a strided convolution in the VAE decoder's head ({module}): cannot tile it")
            radius += (module.kernel_size[-1] // 2) / scale
    return radius


def _causal_conv(conv: nn.Module, x: torch.Tensor, cache: list, idx: list[int]) -> torch.Tensor:
    """One cached causal convolution step, as diffusers' WanDecoder3d runs conv_in and conv_out."""
    i = idx[0]
    cache_x = x[:, :, -CACHE_T:].clone()
    if cache_x.shape[2] < 2 and cache[i] is not None:
        cache_x = torch.cat([cache[i][:, :, -1:].to(cache_x.device), cache_x], dim=2)
    x = conv(x, cache[i])
    cache[i] = cache_x
    idx[0] += 1
    return x


def _trunk(decoder: nn.Module, x: torch.Tensor, cache: list, first_chunk: bool, blocks: int) -> torch.Tensor:
    idx = [0]
    x = _causal_conv(decoder.conv_in, x, cache, idx)
    x = decoder.mid_block(x, feat_cache=cache, feat_idx=idx)
    for up_block in decoder.up_blocks[:blocks]:
        x = up_block(x, feat_cache=cache, feat_idx=idx, first_chunk=first_chunk)
    return x


def _head(decoder: nn.Module, x: torch.Tensor, cache: list, first_chunk: bool, blocks: int) -> torch.Tensor:
    idx = [0]
    for up_block in decoder.up_blocks[blocks:]:
        x = up_block(x, feat_cache=cache, feat_idx=idx, first_chunk=first_chunk)
    x = decoder.nonlinearity(decoder.norm_out(x))
    return _causal_conv(decoder.conv_out, x, cache, idx)


def default_trunk_blocks(vae) -> int:
    """Up blocks run on whole frames: all but the last two (whose activations, at the top resolutions, are the
    decode's peak), so the tiles' halo spans only the last two blocks' receptive field."""
    return max(0, len(vae.decoder.up_blocks) - 2)


@torch.inference_mode()
def decode_tiled(vae, z: torch.Tensor, tile: int = 32, trunk_blocks: int | None = None, group=None) -> torch.Tensor:
    """The Wan VAE's decode of latents `z` [B, C, F, h, w] (already denormalized) with the head in spatial tiles
    of at most `tile` latent pixels a side (each with a halo as wide as the head's receptive field, rounded up);
    `trunk_blocks`: up blocks run on whole frames (default: `default_trunk_blocks`). Returns the video
    [B, 3, T, H, W] clamped to [-1, 1], as `vae.decode` does.

    `group` (a torch.distributed process group of several ranks, e.g. a sequence-parallel group): the decode split
    over its ranks. Every rank runs the trunk (latent resolution: cheap) and the head of its share of the tiles
    (tile k on rank k mod size), then the tiles are summed into every rank's video (each pixel comes from one rank,
    the others add zeros: the sum is exact); every rank of the group must call it with the same latents."""
    return TiledDecoder(vae, tile, trunk_blocks, group).decode(z)


class TiledDecoder:
    """`decode_tiled` with its causal caches kept between calls (the trunk's, and each tile's own), so that a
    stream's blocks, decoded one after another, give the frames of one tiled decode of the whole video."""

    def __init__(self, vae, tile: int = 32, trunk_blocks: int | None = None, group=None):
        if not supports_exact_tiling(vae):
            raise TypeError(f"exact tiled decoding needs the Wan VAE (AutoencoderKLWan), got {type(vae).__name__}")
        if tile < 1:
            raise ValueError(f"tile = {tile}: expected a positive number of latent pixels")
        self.vae = vae
        self.tile = tile
        self.blocks = default_trunk_blocks(vae) if trunk_blocks is None else trunk_blocks
        self.group = group
        count = vae._cached_conv_counts["decoder"]
        self.trunk_cache: list = [None] * count
        self.tile_caches: dict[tuple[int, int], list] = {}
        self.first = True  # the next latent frame is the video's first (it makes one frame, the others `temporal`)

    def fork(self) -> TiledDecoder:
        """An independent copy (cache entries are replaced, never written in place, so they can be shared)."""
        twin = copy.copy(self)
        twin.trunk_cache = list(self.trunk_cache)
        twin.tile_caches = {k: list(v) for k, v in self.tile_caches.items()}
        return twin

    @torch.inference_mode()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """The next latent frames `z` [B, C, f, h, w] (denormalized) -> their video [B, 3, t, H, W] in [-1, 1]."""
        vae, decoder, blocks, group = self.vae, self.vae.decoder, self.blocks, self.group
        x = vae.post_quant_conv(z)
        frames = x.shape[2]
        count = len(self.trunk_cache)
        out: torch.Tensor | None = None
        time_index = 0
        rank, size = 0, 1
        if group is not None:
            import torch.distributed as dist

            rank, size = dist.get_rank(group), dist.get_world_size(group)
        for i in range(frames):
            first = self.first
            trunk = _trunk(decoder, x[:, :, i:i + 1], self.trunk_cache, first, blocks)
            height, width = trunk.shape[-2:]
            trunk_scale = width // x.shape[-1]  # trunk pixels per latent pixel
            halo = math.ceil(head_radius(decoder, blocks))
            step = self.tile * trunk_scale
            t = None
            tiles = _tiles(height, width, step, size)
            if len(tiles) < size:
                raise ValueError(f"a {height}x{width} frame has fewer pixels than the {size} ranks to split it over")
            for k, ((r0, r1), (c0, c1)) in enumerate(tiles):
                if k % size != rank:
                    continue
                top, left = max(0, r0 - halo), max(0, c0 - halo)
                bottom, right = min(height, r1 + halo), min(width, c1 + halo)
                cache = self.tile_caches.setdefault((r0, c0), [None] * count)
                piece = _head(decoder, trunk[:, :, :, top:bottom, left:right], cache, first, blocks)
                scale = piece.shape[-1] // (right - left)
                t = piece.shape[2]
                if out is None:  # the video's first latent frame makes one frame, each later one `temporal`
                    temporal = int(getattr(vae.config, "scale_factor_temporal", None) or 4)
                    out = piece.new_zeros(piece.shape[0], piece.shape[1], t + (frames - 1) * temporal,
                                          height * scale, width * scale)
                if time_index + t > out.shape[2]:  # a VAE of another temporal layout: grow
                    out = torch.cat([out, out.new_zeros(*out.shape[:2], time_index + t - out.shape[2],
                                                        *out.shape[3:])], dim=2)
                out[:, :, time_index:time_index + t, r0 * scale:r1 * scale, c0 * scale:c1 * scale] = \
                    piece[:, :, :, (r0 - top) * scale:(r1 - top) * scale, (c0 - left) * scale:(c1 - left) * scale]
            time_index += t
            self.first = False
        out = out[:, :, :time_index]
        if size > 1:  # each pixel from its tile's rank, zeros elsewhere: the sum is every rank's whole video
            import torch.distributed as dist

            summed = out.float() if out.dtype not in (torch.float32, torch.float64) else out
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
            out = summed.to(out.dtype)
        if vae.config.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=vae.config.patch_size)
        return out.clamp(-1.0, 1.0)


# -- encoding -----------------------------------------------------------------------------------------------
def _spatial_stride(module: nn.Module) -> int:
    """The spatial downsampling factor of one module (a strided convolution, a space-to-depth shortcut), 1 if none."""
    if isinstance(module, (nn.Conv2d, nn.Conv3d)):
        return int(module.stride[-1])
    return int(getattr(module, "factor_s", 1) or 1)  # diffusers' AvgDown3D (Wan2.2's residual shortcut)


def default_head_layers(vae) -> int:
    """Encoder layers (of `encoder.down_blocks`) run in tiles: those at the input's full resolution and the first
    one that downsamples it, where the encode's activations are largest."""
    for i, layer in enumerate(vae.encoder.down_blocks):
        if any(_spatial_stride(m) > 1 for m in layer.modules()):
            return i + 1
    return len(vae.encoder.down_blocks)


def encoder_head_reach(encoder: nn.Module, layers: int) -> int:
    """The receptive-field radius, in input pixels, of the encoder's head (conv_in and the first `layers` down-block
    layers): each convolution adds (its kernel's half + 1 for a strided one's one-sided padding) input pixels at its
    scale, the scale growing with each downsampling on the way. Conservative (a residual shortcut's downsampling is
    counted as if it came after the main path's): a larger halo is still exact."""
    radius, scale = 0, 1
    for module in (m for part in (encoder.conv_in, *encoder.down_blocks[:layers]) for m in part.modules()):
        stride = _spatial_stride(module)
        if isinstance(module, (nn.Conv2d, nn.Conv3d)):
            radius += (module.kernel_size[-1] // 2 + (1 if stride > 1 else 0)) * scale
        elif stride > 1:  # a space-to-depth shortcut reads stride pixels a side
            radius += (stride - 1) * scale
        scale *= stride
    return radius


def _head_stride(encoder: nn.Module, layers: int, channels: int, like: torch.Tensor) -> int:
    """The head's spatial downsampling factor, measured on a small probe frame (parallel paths make it hard to
    read off the modules)."""
    probe = like.new_zeros(1, channels, 1, 32, 32)
    cache: list = [None] * 1024
    idx = [0]
    x = _causal_conv(encoder.conv_in, probe, cache, idx)
    for layer in encoder.down_blocks[:layers]:
        x = layer(x, feat_cache=cache, feat_idx=idx)
    return 32 // x.shape[-1]


@torch.inference_mode()
def encode_tiled(vae, video: torch.Tensor, tile: int = 32, head_layers: int | None = None) -> torch.Tensor:
    """The Wan VAE's encoder posterior mean (what `vae.encode(video).latent_dist.mode()` gives) of `video`
    [B, 3, T, H, W] in [-1, 1], with the encoder's head (conv_in and the first `head_layers` down-block layers: the
    full-resolution ones and the first downsampling, where its activations are largest) run in spatial tiles of about
    `tile` latent pixels a side (as `decode_tiled`'s tiles), each with a halo as wide as the head's receptive field and its own causal temporal
    cache; the rest runs on whole frames. Every latent sees exactly the pixels it sees in the whole encode: equal
    up to the float rounding of convolutions over other shapes."""
    if not supports_exact_tiling(vae):
        raise TypeError(f"exact tiled encoding needs the Wan VAE (AutoencoderKLWan), got {type(vae).__name__}")
    encoder = vae.encoder
    layers = default_head_layers(vae) if head_layers is None else head_layers
    if tile < 1:
        raise ValueError(f"tile = {tile}: expected a positive number of latent pixels")
    patch = vae.config.patch_size or 1
    if vae.config.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

        video = patchify(video, patch_size=vae.config.patch_size)
    stride = _head_stride(encoder, layers, video.shape[1], video)
    halo = math.ceil(encoder_head_reach(encoder, layers) / stride) * stride
    height, width = video.shape[-2:]
    if height % stride or width % stride:
        raise ValueError(f"a {height}x{width} frame does not divide by the encoder head's stride {stride}")
    spatial = int(getattr(vae.config, "scale_factor_spatial", None) or 8) // patch  # input pixels per latent pixel
    step = max(stride, (tile * spatial // stride) * stride)
    tiles = [(r, c) for r in _aligned_spans(height, step, stride) for c in _aligned_spans(width, step, stride)]
    count = vae._cached_conv_counts["encoder"]
    tail_cache: list = [None] * count
    tile_caches: dict[tuple[int, int], list] = {}
    frames = video.shape[2]
    chunks = [(0, 1)] + [(s, min(s + 4, frames)) for s in range(1, frames, 4)]  # as diffusers' _encode
    outs = []
    for start, end in chunks:
        x = video[:, :, start:end]
        head: torch.Tensor | None = None
        for (r0, r1), (c0, c1) in tiles:
            top, left = max(0, r0 - halo), max(0, c0 - halo)
            bottom, right = min(height, r1 + halo), min(width, c1 + halo)
            cache = tile_caches.setdefault((r0, c0), [None] * count)
            idx = [0]
            piece = _causal_conv(encoder.conv_in, x[:, :, :, top:bottom, left:right], cache, idx)
            for layer in encoder.down_blocks[:layers]:
                piece = layer(piece, feat_cache=cache, feat_idx=idx)
            if head is None:
                head = piece.new_zeros(*piece.shape[:3], height // stride, width // stride)
            head[:, :, :, r0 // stride:r1 // stride, c0 // stride:c1 // stride] = piece[
                :, :, :, (r0 - top) // stride:(r1 - top) // stride, (c0 - left) // stride:(c1 - left) // stride]
        idx = [0]
        x = head
        for layer in encoder.down_blocks[layers:]:
            x = layer(x, feat_cache=tail_cache, feat_idx=idx)
        x = encoder.mid_block(x, feat_cache=tail_cache, feat_idx=idx)
        x = encoder.nonlinearity(encoder.norm_out(x))
        outs.append(_causal_conv(encoder.conv_out, x, tail_cache, idx))
    moments = vae.quant_conv(torch.cat(outs, dim=2))
    return moments[:, :vae.config.z_dim]


def encode_mode(vae, video: torch.Tensor, tile_size: int | None = None) -> torch.Tensor:
    """`vae.encode(video).latent_dist.mode()`, in exact tiles of `tile_size` latent pixels when it is set and the VAE
    has composer's exact tiled encode (the Wan VAE; HunyuanVideo-1.5's, in vae_tiling_hunyuan); another VAE with a
    tile size encodes with diffusers' own tiling (approximate, said once in the log)."""
    if tile_size:
        from composer.stages.vae_tiling_hunyuan import encode_tiled_hunyuan15, supports_hunyuan15_tiled_encode

        if supports_exact_tiling(vae):
            return encode_tiled(vae, video, tile=tile_size)
        if supports_hunyuan15_tiled_encode(vae):
            return encode_tiled_hunyuan15(vae, video, tile=tile_size)
        if hasattr(vae, "enable_tiling"):
            from composer.logging import get_logger, log_once

            log_once(get_logger(__name__), f"diffusers-encode-tiling-{type(vae).__name__}",
                     f"vae_tile_size: {type(vae).__name__} encodes with diffusers' own tiling (blended tiles: the "
                     "latents differ a little from a whole encode; composer's exact tiling covers the Wan and "
                     "HunyuanVideo-1.5 VAEs)")
            saved = getattr(vae, "use_tiling", False)
            vae.enable_tiling()
            try:
                return vae.encode(video).latent_dist.mode()
            finally:
                vae.use_tiling = saved
    return vae.encode(video).latent_dist.mode()
