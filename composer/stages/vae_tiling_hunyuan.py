"""Exact tiled decoding for the HunyuanVideo VAEs (AutoencoderKLHunyuanVideo and AutoencoderKLHunyuanVideo15).

As for the Wan VAE (`composer.stages.vae_tiling`), the decoder is split where it stops being local:

- the trunk (post_quant_conv, conv_in, the mid block with its attention over the whole latent video, and all up
  blocks but the last two) runs on whole frames, at resolutions where it is cheap;
- the head (the last two up blocks, the output norm and conv_out) runs tile by tile, each tile taken with a halo as
  wide as the head's receptive field (measured once from the head's own convolutions), only its interior kept.

HunyuanVideo-1.5's norms are per position (an RMS norm over channels): its head is local, and a tile is one call.
HunyuanVideo's are GroupNorms, whose mean and variance are taken over the whole video (every frame and pixel of a
group's channels): a tile alone would normalise by its own statistics (what diffusers' `enable_tiling()` does, one
reason its tiles differ from a whole decode and must be blended). Here the head runs as a program per tile that
stops at each GroupNorm; the tiles' interiors give their sums (float64), the sums give the whole video's statistics
(all-reduced over the ranks of a split decode), and every tile goes on normalised by them. Every output pixel then
sees exactly what it sees in the whole decode: the frames equal the untiled decode up to float rounding (tested
<= 1 uint8 level).

While one tile runs, the others wait *parked*: on the host when the VAE is on an accelerator (the device then holds
one tile's activations, at the price of a copy each way at each GroupNorm), in place on the CPU.

HunyuanVideo's own decode splits long videos in time (diffusers' framewise decoding: chunks of latent frames
blended over their overlap); the tiled decode keeps that split exactly as it is and tiles each chunk in space, so it
equals the decode it replaces.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Generator

import torch
from torch import nn

from composer.stages.tile_grid import _aligned_spans, _tiles

HUNYUAN_VAES = ("AutoencoderKLHunyuanVideo", "AutoencoderKLHunyuanVideo15")


def supports_hunyuan_tiling(vae) -> bool:
    decoder = getattr(vae, "decoder", None)
    return (type(vae).__name__ in HUNYUAN_VAES and decoder is not None
            and all(hasattr(decoder, n) for n in ("conv_in", "mid_block", "up_blocks", "conv_act", "conv_out")))


def _is_v15(vae) -> bool:
    return type(vae).__name__ == "AutoencoderKLHunyuanVideo15"


def default_trunk_blocks(vae) -> int:
    """All up blocks but the last two run on whole frames (the last two, at the top resolutions, hold the peak)."""
    return max(0, len(vae.decoder.up_blocks) - 2)


# -- the head: its modules, its receptive field, its program ------------------------------------------------
def _head_modules(vae, blocks: int) -> list[nn.Module]:
    decoder = vae.decoder
    norm = decoder.norm_out if _is_v15(vae) else decoder.conv_norm_out
    return [*decoder.up_blocks[blocks:], norm, decoder.conv_act, decoder.conv_out]


_RADII: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_radius(vae, blocks: int, like: torch.Tensor) -> float:
    """The head's spatial receptive-field radius in pixels of its input, measured once per decoder: a probe through
    the head on a small input records, for each convolution, its reach ((kernel - 1) * dilation / 2 pixels) at its
    resolution relative to the head's input. Refuses a head that is not local (attention, strided convolutions)."""
    decoder = vae.decoder
    cached = _RADII.get(decoder, {}).get(blocks)
    if cached is not None:
        return cached
    modules = _head_modules(vae, blocks)
    for module in (m for part in modules for m in part.modules()):
        kind = type(module).__name__
        if "Attention" in kind or "Attn" in kind:
            raise ValueError(f"the VAE decoder's last blocks hold attention ({kind}): they cannot run in tiles")
    reach: list[float] = []
    probe_width = 8

    def record(module, _inputs, output):
        if module.stride[-1] != 1 or module.stride[-2] != 1:
            raise ValueError(f"a strided convolution in the VAE decoder's head ({module}): cannot tile it")
        scale = output.shape[-1] / probe_width
        for axis in (-1, -2):
            reach.append(module.dilation[axis] * (module.kernel_size[axis] - 1) / 2 / scale)

    hooks = [m.register_forward_hook(record) for part in modules for m in part.modules()
             if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    try:
        with torch.inference_mode():
            x = like.new_zeros(1, like.shape[1], min(2, like.shape[2]), probe_width, probe_width)
            for module in modules:
                x = module(x)
    finally:
        for hook in hooks:
            hook.remove()
    # the convolutions run one after another, so their reaches add up (two axes recorded per convolution)
    radius = sum(reach[0::2]) if reach else 0.0
    radius = max(radius, sum(reach[1::2]) if reach else 0.0)
    _RADII.setdefault(decoder, {})[blocks] = radius
    return radius


Norm = tuple[nn.GroupNorm, torch.Tensor]  # what a tile's program yields: a GroupNorm and its input
Program = Generator[Norm, torch.Tensor, torch.Tensor]


def _hunyuan_resnet(resnet: nn.Module, x: torch.Tensor, park: Callable, fetch: Callable) -> Program:
    """diffusers' HunyuanVideoResnetBlockCausal3D.forward, stopping at its two GroupNorms."""
    x = x.contiguous()
    residual = park(x)
    h = yield resnet.norm1, x
    del x
    h = resnet.conv1(resnet.nonlinearity(h))
    h = yield resnet.norm2, h
    h = resnet.conv2(resnet.dropout(resnet.nonlinearity(h)))
    residual = fetch(residual)
    if resnet.conv_shortcut is not None:
        residual = resnet.conv_shortcut(residual)
    return h + residual


def _hunyuan_head(vae, blocks: int, park: Callable, fetch: Callable) -> Callable[[torch.Tensor], Program]:
    decoder = vae.decoder

    def program(x: torch.Tensor) -> Program:
        for up_block in decoder.up_blocks[blocks:]:
            for resnet in up_block.resnets:
                x = yield from _hunyuan_resnet(resnet, x, park, fetch)
            for upsampler in up_block.upsamplers or ():
                x = upsampler(x)
        h = yield decoder.conv_norm_out, x
        return decoder.conv_out(decoder.conv_act(h))

    return program


def _local_head(vae, blocks: int) -> Callable[[torch.Tensor], Program]:
    decoder = vae.decoder

    def program(x: torch.Tensor) -> Program:
        for up_block in decoder.up_blocks[blocks:]:
            x = up_block(x)
        return decoder.conv_out(decoder.conv_act(decoder.norm_out(x)))
        yield  # a program with no GroupNorm: one call

    return program


# -- GroupNorm over the whole video from the tiles' sums ----------------------------------------------------
class _GroupSums:
    """Sums of x and x^2 per sample and group over the tiles' interiors, in float64; all-reduced over `group`. Each
    tile's come from its own mean and variance (fp32, torch's stable var_mean: no cancellation within a tile, and no
    float64 copy of it), as n * mean and n * (var + mean^2)."""

    def __init__(self):
        self.count = 0
        self.s1: torch.Tensor | None = None
        self.s2: torch.Tensor | None = None

    def add(self, x: torch.Tensor, groups: int) -> None:
        b = x.shape[0]
        flat = x.reshape(b, groups, -1).float()
        var, mean = torch.var_mean(flat, dim=-1, correction=0)
        n = flat.shape[-1]
        mean, var = mean.to(torch.float64), var.to(torch.float64)
        s1, s2 = n * mean, n * (var + mean * mean)
        self.count += n
        self.s1 = s1 if self.s1 is None else self.s1 + s1
        self.s2 = s2 if self.s2 is None else self.s2 + s2

    def moments(self, group, like: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.s1 is None:  # this rank had no tile (never: every rank gets one) -- keep the collective matched
            self.s1 = torch.zeros(like.shape[0], groups, dtype=torch.float64, device=like.device)
            self.s2 = torch.zeros_like(self.s1)
        if group is not None:
            import torch.distributed as dist

            packed = torch.stack([self.s1, self.s2, torch.full_like(self.s1, float(self.count))])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            self.s1, self.s2, count = packed[0], packed[1], packed[2]
        else:
            count = self.count
        mean = self.s1 / count
        var = (self.s2 / count - mean * mean).clamp_min(0.0)
        return mean, var


def _group_norm(norm: nn.GroupNorm, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """`norm(x)` with the whole video's statistics instead of x's own."""
    b, c = x.shape[:2]
    groups = norm.num_groups
    shape = (b, groups) + (1,) * (x.dim() - 1)
    scale = torch.rsqrt(var.to(device=x.device, dtype=torch.float32) + norm.eps).reshape(shape)
    shift = mean.to(device=x.device, dtype=torch.float32).reshape(shape)
    y = ((x.float().reshape(b, groups, c // groups, *x.shape[2:]) - shift) * scale).reshape(x.shape)
    if norm.affine:
        view = (1, c) + (1,) * (x.dim() - 2)
        y = y * norm.weight.float().reshape(view) + norm.bias.float().reshape(view)
    return y.to(x.dtype)


# -- the decode -----------------------------------------------------------------------------------------------
def _trunk(vae, z: torch.Tensor, blocks: int) -> torch.Tensor:
    decoder = vae.decoder
    if _is_v15(vae):
        x = decoder.conv_in(z) + z.repeat_interleave(repeats=decoder.repeat, dim=1)
    else:
        x = decoder.conv_in(z)
    x = decoder.mid_block(x)
    for up_block in decoder.up_blocks[:blocks]:
        x = up_block(x)
    return x


def _parking(device: torch.device, park_on_host: bool | None) -> tuple[Callable, Callable]:
    if park_on_host is None:
        park_on_host = device.type != "cpu"
    if not park_on_host or device.type == "cpu":
        return (lambda t: t), (lambda t: t)
    return (lambda t: t.to("cpu")), (lambda t: t.to(device, non_blocking=True))


def _decode_chunk(vae, z: torch.Tensor, tile: int, blocks: int, group, park_on_host: bool | None) -> torch.Tensor:
    """decoder(z) for one chunk of latent frames (post_quant_conv already applied for HunyuanVideo), its head in
    exact spatial tiles."""
    trunk = _trunk(vae, z, blocks)
    height, width = trunk.shape[-2:]
    trunk_scale = max(1, width // z.shape[-1])
    halo = math.ceil(head_radius(vae, blocks, trunk) - 1e-9)
    rank, size = 0, 1
    if group is not None:
        import torch.distributed as dist

        rank, size = dist.get_rank(group), dist.get_world_size(group)
    tiles = _tiles(height, width, tile * trunk_scale, size)
    if len(tiles) < size:
        raise ValueError(f"a {height}x{width} frame has fewer pixels than the {size} ranks to split it over")
    mine = [(r, c) for k, (r, c) in enumerate(tiles) if k % size == rank]
    park, fetch = _parking(trunk.device, park_on_host)
    program = _local_head(vae, blocks) if _is_v15(vae) else _hunyuan_head(vae, blocks, park, fetch)

    boxes, runs, waiting = [], [], []
    for (r0, r1), (c0, c1) in mine:
        top, left = max(0, r0 - halo), max(0, c0 - halo)
        bottom, right = min(height, r1 + halo), min(width, c1 + halo)
        boxes.append(((r0, r1, c0, c1), (top, bottom, left, right)))
        runs.append(program(trunk[:, :, :, top:bottom, left:right]))
        waiting.append(None)  # what the tile's program gets next: None to start, then its normalised input
    del trunk

    out: torch.Tensor | None = None
    pending: list = [None] * len(runs)  # each tile's GroupNorm input, parked, between rounds
    norm: nn.GroupNorm | None = None
    moments = None
    while True:
        sums, done = _GroupSums(), 0
        norm_now = None
        for k, run in enumerate(runs):
            if run is None:
                done += 1
                continue
            if pending[k] is not None:
                waiting[k] = _group_norm(norm, fetch(pending[k]), *moments)
                pending[k] = None
            try:
                norm_now, x = run.send(waiting[k])
            except StopIteration as finished:
                piece = finished.value
                runs[k], waiting[k] = None, None
                out = _place(out, piece, boxes[k], (height, width), z)
                done += 1
                continue
            waiting[k] = None
            (r0, r1, c0, c1), (top, bottom, left, right) = boxes[k]
            sh, sw = x.shape[-2] // (bottom - top), x.shape[-1] // (right - left)
            sums.add(x[:, :, :, (r0 - top) * sh:(r1 - top) * sh, (c0 - left) * sw:(c1 - left) * sw].contiguous(),
                     norm_now.num_groups)
            pending[k] = park(x)
            del x
        if done == len(runs):
            break
        norm = norm_now
        moments = sums.moments(group, z, norm.num_groups)
    if out is None:
        raise ValueError("no tile was decoded")
    if size > 1:  # each pixel from its tile's rank, zeros elsewhere: the sum is every rank's whole video
        import torch.distributed as dist

        summed = out.float() if out.dtype not in (torch.float32, torch.float64) else out
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        out = summed.to(out.dtype)
    return out


def _place(out, piece: torch.Tensor, box, trunk_size: tuple[int, int], z: torch.Tensor) -> torch.Tensor:
    (r0, r1, c0, c1), (top, bottom, left, right) = box
    scale = piece.shape[-1] // (right - left)
    if out is None:
        height, width = trunk_size
        out = piece.new_zeros(*piece.shape[:3], height * scale, width * scale)
    out[:, :, :, r0 * scale:r1 * scale, c0 * scale:c1 * scale] = \
        piece[:, :, :, (r0 - top) * scale:(r1 - top) * scale, (c0 - left) * scale:(c1 - left) * scale]
    return out


@torch.inference_mode()
def decode_tiled_hunyuan(vae, z: torch.Tensor, tile: int = 32, trunk_blocks: int | None = None, group=None,
                         park_on_host: bool | None = None) -> torch.Tensor:
    """`vae.decode(z).sample` for a HunyuanVideo or HunyuanVideo-1.5 VAE, latents `z` [B, C, F, h, w] (already
    denormalized), with the decoder's head in exact spatial tiles of at most `tile` latent pixels a side.

    `group`: split over the ranks of a process group (each rank the head of its share of the tiles, GroupNorm sums
    all-reduced, the tiles summed into every rank's video); every rank must call it with the same latents.
    `park_on_host`: where waiting tiles are kept (default: the host when the VAE is on an accelerator)."""
    if not supports_hunyuan_tiling(vae):
        raise TypeError(f"exact tiled decoding here needs a HunyuanVideo VAE, got {type(vae).__name__}")
    if tile < 1:
        raise ValueError(f"tile = {tile}: expected a positive number of latent pixels")
    blocks = default_trunk_blocks(vae) if trunk_blocks is None else trunk_blocks

    def decode(chunk: torch.Tensor) -> torch.Tensor:
        if not _is_v15(vae):
            chunk = vae.post_quant_conv(chunk)
        return _decode_chunk(vae, chunk, tile, blocks, group, park_on_host)

    if _is_v15(vae):
        return decode(z)
    return _framewise(vae, z, decode)


def _framewise(vae, z: torch.Tensor, decode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """HunyuanVideo's split of a long video in time, as its decode does (`use_framewise_decoding`): chunks of
    latent frames overlapping by one, each decoded, blended over their overlap in time."""
    frames = z.shape[2]
    ratio_t = vae.temporal_compression_ratio
    min_frames = vae.tile_sample_min_num_frames // ratio_t
    if not (getattr(vae, "use_framewise_decoding", False) and frames > min_frames):
        return decode(z)
    stride = vae.tile_sample_stride_num_frames // ratio_t
    blend = vae.tile_sample_min_num_frames - vae.tile_sample_stride_num_frames
    keep = vae.tile_sample_stride_num_frames
    pieces = []
    for i in range(0, frames, stride):
        piece = decode(z[:, :, i:i + min_frames + 1])
        pieces.append(piece if i == 0 else piece[:, :, 1:])
    kept = []
    for i, piece in enumerate(pieces):
        if i == 0:
            kept.append(piece[:, :, :keep + 1])
        else:
            kept.append(vae.blend_t(pieces[i - 1], piece, blend)[:, :, :keep])
    return torch.cat(kept, dim=2)[:, :, :(frames - 1) * ratio_t + 1]


# -- encoding (HunyuanVideo-1.5) ----------------------------------------------------------------------------
def supports_hunyuan15_tiled_encode(vae) -> bool:
    encoder = getattr(vae, "encoder", None)
    return (type(vae).__name__ == "AutoencoderKLHunyuanVideo15" and encoder is not None
            and all(hasattr(encoder, n) for n in ("conv_in", "down_blocks", "mid_block", "norm_out", "conv_out")))


def _encoder_head_geometry(encoder: nn.Module, layers: int, like: torch.Tensor) -> tuple[int, float]:
    """(stride, reach) of the encoder's head (conv_in and the first `layers` down blocks), measured by a probe: its
    spatial downsampling factor, and its receptive-field radius in input pixels (each convolution's (kernel - 1) /
    2 pixels at its resolution, scaled back to the input's)."""
    probe_width = 32
    reach: list[float] = []

    def record(module, _inputs, output):
        if module.stride[-1] != 1 or module.stride[-2] != 1:
            raise ValueError(f"a strided convolution in the VAE encoder's head ({module}): not supported here")
        scale = output.shape[-1] / probe_width
        reach.append(max(module.dilation[a] * (module.kernel_size[a] - 1) / 2 for a in (-1, -2)) / scale)

    modules = [encoder.conv_in, *encoder.down_blocks[:layers]]
    hooks = [m.register_forward_hook(record) for part in modules for m in part.modules()
             if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    try:
        with torch.inference_mode():
            x = like.new_zeros(1, like.shape[1], 1, probe_width, probe_width)
            for module in modules:
                x = module(x)
    finally:
        for hook in hooks:
            hook.remove()
    return probe_width // x.shape[-1], sum(reach)


@torch.inference_mode()
def encode_tiled_hunyuan15(vae, video: torch.Tensor, tile: int = 32, head_layers: int = 1) -> torch.Tensor:
    """HunyuanVideo-1.5's encoder posterior mean (what `vae.encode(video).latent_dist.mode()` gives) of `video`
    [B, 3, T, H, W] in [-1, 1], with the encoder's head (conv_in and the first `head_layers` down blocks: the
    full-resolution ones, where its activations are largest) in spatial tiles of about `tile` latent pixels a side,
    each with a halo as wide as the head's receptive field, every tile edge on the head's downsampling grid (so each
    tile's space-to-channel packing is the whole frame's); the rest on whole frames. Its norms are per position: every
    latent sees exactly the pixels it sees in the whole encode."""
    if not supports_hunyuan15_tiled_encode(vae):
        raise TypeError(f"this tiled encode needs HunyuanVideo-1.5's VAE, got {type(vae).__name__}")
    if tile < 1:
        raise ValueError(f"tile = {tile}: expected a positive number of latent pixels")
    encoder = vae.encoder
    stride, reach = _encoder_head_geometry(encoder, head_layers, video)
    halo = math.ceil(reach / stride - 1e-9) * stride
    height, width = video.shape[-2:]
    if height % stride or width % stride:
        raise ValueError(f"a {height}x{width} video is not on the encoder's {stride}-pixel grid")
    step = tile * vae.spatial_compression_ratio
    head = None
    for r0, r1 in _aligned_spans(height, step, stride):
        for c0, c1 in _aligned_spans(width, step, stride):
            top, left = max(0, r0 - halo), max(0, c0 - halo)
            bottom, right = min(height, r1 + halo), min(width, c1 + halo)
            piece = encoder.conv_in(video[:, :, :, top:bottom, left:right])
            for block in encoder.down_blocks[:head_layers]:
                piece = block(piece)
            if head is None:
                head = piece.new_zeros(*piece.shape[:3], height // stride, width // stride)
            head[:, :, :, r0 // stride:r1 // stride, c0 // stride:c1 // stride] = piece[
                :, :, :, (r0 - top) // stride:(r1 - top) // stride, (c0 - left) // stride:(c1 - left) // stride]
    x = head
    for block in encoder.down_blocks[head_layers:]:
        x = block(x)
    x = encoder.mid_block(x)
    b, _, frames, h, w = x.shape
    shortcut = x.view(b, -1, encoder.group_size, frames, h, w).mean(dim=2)
    moments = encoder.conv_out(encoder.conv_act(encoder.norm_out(x))) + shortcut
    return moments.chunk(2, dim=1)[0]
