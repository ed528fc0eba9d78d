"""DecodingStage: latents -> uint8 RGB frames on the CPU."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from composer.batch import ForwardBatch, LatentBlock, VideoChunk
from composer.engine.batcher import CallBatcher, module_lock
from composer.engine.loop import Blocking, is_wait, wait_for
from composer.errors import InvalidInputError, StageVerificationError, UnsupportedError
from composer.logging import get_logger
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult

logger = get_logger(__name__)


def denormalize_latents(latents: torch.Tensor, vae_config) -> torch.Tensor:
    """Undo the latent normalisation the DiT was trained with (per-channel mean/std, or a scaling factor)."""
    if getattr(vae_config, "latents_mean", None) is not None and getattr(vae_config, "latents_std", None) is not None:
        shape = (1, -1) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(vae_config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae_config.latents_std).view(shape).to(latents.device, latents.dtype)
        return latents / inv_std + mean
    scaling = getattr(vae_config, "scaling_factor", 1.0) or 1.0
    shift = getattr(vae_config, "shift_factor", 0.0) or 0.0
    return latents / scaling + shift


def _request_key(batch: ForwardBatch) -> str:
    """The batch's request key (the same on every rank of a parallel layout; "" when it has none)."""
    from composer.engine.scheduler import RequestContext, current_request

    request = batch.get(RequestContext, None) or current_request()
    return request.key if request is not None else ""


def video_to_frames(video: torch.Tensor) -> torch.Tensor:
    """VAE output [B, 3, T, H, W] in [-1, 1] -> uint8 [B, T, H, W, 3] on the CPU."""
    video = (video * 0.5 + 0.5).clamp(0, 1)
    return (video.permute(0, 2, 3, 4, 1).float() * 255).round().to(torch.uint8).cpu()


class DecodingStage(Stage):
    """Denormalizes the latents and decodes them with the VAE into frames (`batch.frames`).

    Concurrent requests decode through one CallBatcher (composer/engine/batcher.py) holding the VAE's lock: decodes
    that queue up while another runs go as one batch (whole videos of one shape together; streamed chunks of
    streams at the same point together), each request getting its own rows back.
    """

    streams_from_upstream = True  # decodes a streaming denoiser's blocks
    concurrent = True  # its decodes go through the batcher, which holds the VAE's lock

    def __init__(self, vae: torch.nn.Module, tile_size: int | None = None,
                 preview_decoder: torch.nn.Module | None = None):
        self.vae = vae
        self.tile_size = tile_size  # latent pixels a side (RuntimeArgs.vae_tile_size; the pipeline sets it)
        # RuntimeArgs.preview_decoder, loaded once by the pipeline (`use_preview_decoder`): a causal stream's blocks
        # decode through this tiny decoder (composer/models/taehv.py) instead of the VAE; whole videos keep the VAE
        self.preview_decoder = preview_decoder
        # A sequence-parallel group to split tiled decodes over (`split_over_ranks`, set by the parallel hook)
        self.split_group = None
        self.batcher = CallBatcher(self._decode_many, lock=module_lock(vae))

    def split_over_ranks(self, group, planner) -> bool:
        """Under a sequence-parallel layout: split each tiled whole-video decode's tiles over `group`'s ranks (every
        rank runs the trunk and its share of the tiles; one all-reduce; bit-identical to one process's tiled
        decode), with rank 0 planning every decode on `planner` so the ranks' collectives meet. Only for a VAE
        with composer's exact tiling and a `vae_tile_size`; False (nothing changes) otherwise."""
        from composer.stages.vae_tiling import has_exact_tiled_decode

        if not self.tile_size or not has_exact_tiled_decode(self.vae):
            return False
        self.split_group = group
        planner.register(self.batcher)
        return True

    def use_preview_decoder(self, path: str, device: torch.device) -> None:
        """Load the TAEHV weights file at `path` (RuntimeArgs.preview_decoder) for streamed previews, in the VAE's
        dtype on `device`, and check that it decodes this VAE's latents (channels, spatial and temporal factors)."""
        from composer.models.taehv import load_preview_decoder

        model = load_preview_decoder(path, device=device, dtype=self.vae.dtype)
        cfg, vae_cfg = model.config, self.vae.config
        vae_channels = getattr(vae_cfg, "z_dim", None) or getattr(vae_cfg, "latent_channels", None)
        vae_spatial = getattr(vae_cfg, "scale_factor_spatial", None) or getattr(self.vae, "spatial_compression_ratio",
                                                                                None)
        vae_temporal = getattr(vae_cfg, "scale_factor_temporal", None) or getattr(
            self.vae, "temporal_compression_ratio", None)
        problems = [f"{what}: {mine} in the file, {theirs} for this model's VAE"
                    for what, mine, theirs in (("latent channels", cfg.latent_channels, vae_channels),
                                               ("spatial factor", cfg.spatial_scale, vae_spatial),
                                               ("temporal factor", cfg.temporal_scale, vae_temporal))
                    if theirs is not None and int(theirs) != mine]
        if problems:
            raise InvalidInputError(f"preview_decoder = {path!r} ({cfg.describe()}) is not for this model's latents: "
                                    + "; ".join(problems))
        self.preview_decoder = model

    def share_decodes(self, active) -> None:
        """Concurrent requests: wait up to 5 ms for other requests' decodes while `active()` (the pipeline's running
        requests) says there are others, so streams at the same point decode as one batch."""
        self.batcher.settle_s, self.batcher.active = 0.005, active

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("latents", batch.latents, V.ndim(5))

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        expected = (batch.batch_size, batch.num_frames, batch.height, batch.width, 3)
        if batch.frames is None or tuple(batch.frames.shape) != expected:
            shape = None if batch.frames is None else list(batch.frames.shape)
            result.add_failure("frames", shape, f"uint8 frames of shape {list(expected)}")

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        latents = denormalize_latents(latents.to(self.vae.device, self.vae.dtype), self.vae.config)
        if self.tile_size:
            from composer.stages.vae_tiling import decode_exact_tiled, has_exact_tiled_decode

            if has_exact_tiled_decode(self.vae):
                return decode_exact_tiled(self.vae, latents, tile=self.tile_size, group=self.split_group)
            return self._diffusers_tiled(latents)
        return self.vae.decode(latents, return_dict=False)[0]

    def _diffusers_tiled(self, latents: torch.Tensor) -> torch.Tensor:
        """A VAE without composer's exact tiling: diffusers' own (tiles blended at their seams: approximate)."""
        from composer.logging import log_once

        if not hasattr(self.vae, "enable_tiling"):
            raise UnsupportedError(f"vae_tile_size is set but {type(self.vae).__name__} cannot decode in tiles")
        log_once(logger, f"diffusers-tiling-{type(self.vae).__name__}", f"vae_tile_size: {type(self.vae).__name__} "
                 "decodes with diffusers' own tiling (its tiles are blended at the seams: the frames differ a little "
                 "from a whole decode; composer's exact tiling covers the Wan and HunyuanVideo VAEs)")
        saved = getattr(self.vae, "use_tiling", False)
        self.vae.enable_tiling()
        try:
            return self.vae.decode(latents, return_dict=False)[0]
        finally:
            self.vae.use_tiling = saved

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        latents = batch.latents
        key = ("video", tuple(latents.shape[1:]), latents.dtype, str(latents.device))
        batch.frames = self.batcher.submit(key, ("video", latents), rows=latents.shape[0],
                                           plan_key=(_request_key(batch), "video"))
        return batch

    def _decode_many(self, payloads: list) -> list:
        """The batcher's call: whole videos (one `decode` over every request's rows) or streamed chunks
        (`StreamingVideoDecoder.decode_together`); each request's rows back."""
        if payloads[0][0] == "video":
            latents = [p[1] for p in payloads]
            frames = video_to_frames(self.decode(torch.cat(latents))).numpy()
            return list(np.split(frames, np.cumsum([x.shape[0] for x in latents])[:-1]))
        if payloads[0][0] == "preview":
            return PreviewStreamDecoder.decode_together([p[1] for p in payloads], [p[2] for p in payloads])
        return StreamingVideoDecoder.decode_together([p[1] for p in payloads], [p[2] for p in payloads])

    # -- streaming: frames per latent block, as the denoiser finishes them -----------------------------
    def verify_stream_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """The latents arrive block by block from upstream."""

    def verify_stream_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """The frames went out chunk by chunk (each chunk's shape is checked as it is made)."""

    def stream(self, batch: ForwardBatch, upstream: Iterator[LatentBlock] | None) -> Iterator[VideoChunk]:
        """The start frames (when the request has start latents), then each upstream block's frames: the
        VAE's temporal cache is carried from chunk to chunk, so the frames equal a whole-video decode. With a
        preview decoder (RuntimeArgs.preview_decoder) the blocks go through it instead, its per-block memory carried
        the same way (its frames equal its own whole-video decode)."""
        if upstream is None:
            raise UnsupportedError("streaming decode needs a streaming denoiser before it")
        request_key = _request_key(batch)
        resumed = batch.get(StreamDecodeState, None)  # a forked or resumed session goes on from its decoder
        if resumed is None and self.preview_decoder is not None:
            from composer.logging import log_once

            log_once(logger, "preview-decoder", "preview_decoder: streamed frames are previews from the tiny TAEHV "
                     f"decoder ({self.preview_decoder.config.describe()}), of lower quality than the VAE's; whole "
                     "videos are still decoded by the VAE (docs/memory.md, Preview decoder)")
            state = StreamDecodeState(PreviewStreamDecoder(self.preview_decoder, self.batcher))
        else:
            state = resumed or StreamDecodeState(StreamingVideoDecoder(self.vae, self.batcher, self.tile_size))
        state.decoder.batcher = self.batcher
        batch.attach(state)

        def chunk(latents: torch.Tensor, block: LatentBlock | None) -> VideoChunk:
            start = time.perf_counter()
            frames = state.decoder.decode(latents, plan_key=(request_key, "stream", state.frame_index))[0]
            if frames.shape[1:] != (batch.height, batch.width, 3):
                raise StageVerificationError(self.name, "output", [("frames", list(frames.shape),
                                             f"uint8 frames [t, {batch.height}, {batch.width}, 3]")])
            piece = VideoChunk(
                frames=frames, block_index=None if block is None else block.index,
                segment=0 if block is None else block.segment,
                prompt=batch.prompt[0] if block is None else block.prompt, start_frame=state.frame_index,
                block_seconds=0.0 if block is None else block.seconds, decode_seconds=time.perf_counter() - start,
                since_start=time.perf_counter() - batch.started,
            )
            state.frame_index += len(frames)
            return piece

        if batch.start_latents is not None and resumed is None:
            yield (yield from wait_for(Blocking(lambda: chunk(batch.start_latents, None))))
        for block in upstream:
            if is_wait(block):  # the denoiser's: passed on to whoever runs the stream (composer/engine/loop.py)
                yield block
                continue
            yield (yield from wait_for(Blocking(lambda block=block: chunk(block.latents, block))))


@dataclass(eq=False)
class StreamDecodeState:
    """A stream's decoder between chunks (its causal cache) and the frames it has made: what a session forks
    and snapshots."""

    decoder: StreamingVideoDecoder | PreviewStreamDecoder
    frame_index: int = 0

    def fork(self) -> StreamDecodeState:
        """An independent copy (cache entries are replaced, never written in place, so they can be shared)."""
        if isinstance(self.decoder, PreviewStreamDecoder):
            return StreamDecodeState(self.decoder.fork(), self.frame_index)
        twin = copy.copy(self.decoder)
        twin.feat_cache = list(self.decoder.feat_cache)
        if twin.tiled is not None:
            twin.tiled = self.decoder.tiled.fork()
        return StreamDecodeState(twin, self.frame_index)

    def export(self) -> dict[str, Any]:
        if isinstance(self.decoder, PreviewStreamDecoder):
            raise UnsupportedError("a session snapshot keeps the VAE's stream decoder state, and this session decodes "
                                   "through the tiny preview decoder (preview_decoder is set): snapshots are not "
                                   "supported with it; load the model without preview_decoder to snapshot sessions "
                                   "(fork works with it)")
        if self.decoder.tiled is not None:
            raise UnsupportedError("a session snapshot keeps the VAE's whole-frame stream decoder state, and this "
                                   "session decodes in exact tiles (vae_tile_size is set): snapshots are not supported "
                                   "with it; load the model without vae_tile_size to snapshot sessions (fork works)")
        return {"feat_cache": [e.cpu() if isinstance(e, torch.Tensor) else e for e in self.decoder.feat_cache],
                "first": self.decoder.first, "frame_index": self.frame_index}

    @classmethod
    def load(cls, vae: torch.nn.Module, data: dict[str, Any]) -> StreamDecodeState:
        decoder = StreamingVideoDecoder(vae)
        if len(data["feat_cache"]) != len(decoder.feat_cache):
            raise InvalidInputError("the snapshot's video decoder state does not fit this model's VAE")
        decoder.feat_cache = [e.to(vae.device) if isinstance(e, torch.Tensor) else e
                              for e in data["feat_cache"]]
        decoder.first = bool(data["first"])
        return cls(decoder, int(data["frame_index"]))


class StreamingVideoDecoder:
    """Decodes latents chunk by chunk, carrying the Wan VAE's causal temporal cache between chunks, so the
    concatenated frames equal decoding the whole video at once (the VAE decodes frame by frame either way).

    The first latent frame gives 1 video frame, every later one gives `scale_factor_temporal` frames.
    """

    def __init__(self, vae: torch.nn.Module, batcher: CallBatcher | None = None, tile_size: int | None = None):
        counts = getattr(vae, "_cached_conv_counts", None)
        usable = (
            counts is not None and hasattr(vae, "decoder") and hasattr(vae, "post_quant_conv")
            and getattr(vae.config, "patch_size", None) is None and not getattr(vae, "use_tiling", False)
        )
        if not usable:
            raise UnsupportedError(f"streaming decode needs the Wan2.1 VAE without tiling, got {type(vae).__name__}")
        self.vae = vae
        self.batcher = batcher
        self.feat_cache: list = [None] * counts["decoder"]
        self.first = True
        # vae_tile_size: each chunk decoded in composer's exact tiles, the tiles' caches kept between chunks (the
        # frames of one tiled decode of the whole video); such a stream decodes alone (its caches are per tile)
        self.tiled = None
        if tile_size:
            from composer.stages.vae_tiling import TiledDecoder

            self.tiled = TiledDecoder(vae, tile_size)

    def batch_key(self, latents: torch.Tensor) -> tuple:
        """Decoders whose next chunks share this key decode as one batch: the same chunk shape and the same cache
        state (each cached entry's kind and shape)."""
        if self.tiled is not None:
            return ("stream-tiled", id(self))
        state = tuple(None if e is None else e if isinstance(e, str) else tuple(e.shape[1:]) for e in self.feat_cache)
        return ("stream", tuple(latents.shape[1:]), latents.dtype, self.first, state)

    def decode(self, latents: torch.Tensor, plan_key=None) -> np.ndarray:
        """Latents [B, C, f, h, w] (the next f latent frames) -> uint8 frames [B, t, H, W, 3]. `plan_key`: the
        chunk's name on every rank (a planned batcher: composer/engine/batcher.py)."""
        if self.batcher is None:
            return self.decode_together([self], [latents])[0]
        return self.batcher.submit(self.batch_key(latents), ("stream", self, latents), rows=latents.shape[0],
                                   plan_key=plan_key)

    @staticmethod
    @torch.inference_mode()
    def decode_frames_together(decoders: list[StreamingVideoDecoder], chunks: list[torch.Tensor]) -> torch.Tensor:
        """Each decoder's next chunk, decoded as one batch: the chunks' rows stacked, the decoders' causal caches
        stacked entry by entry (equal `batch_key`s), and each decoder's cache handed back; the uint8 frames
        [rows, t, H, W, 3] of every chunk (on the CPU)."""
        vae = decoders[0].vae
        rows = [c.shape[0] for c in chunks]
        z = denormalize_latents(torch.cat(chunks).to(vae.device, vae.dtype), vae.config)
        if any(d.tiled is not None for d in decoders):  # each alone (a tiled stream's batch key is its own)
            parts = []
            for decoder, part in zip(decoders, z.split(rows)):
                decoder.first = False
                parts.append(video_to_frames(decoder.tiled.decode(part)) if decoder.tiled is not None
                             else StreamingVideoDecoder.decode_frames_together([decoder], [part]))
            return torch.cat(parts)
        x = vae.post_quant_conv(z)
        if len(decoders) == 1:
            feat = decoders[0].feat_cache
        else:
            feat = [torch.cat(entries) if isinstance(entries[0], torch.Tensor) else entries[0]
                    for entries in zip(*(d.feat_cache for d in decoders))]
        first = decoders[0].first
        outs = []
        for i in range(x.shape[2]):
            outs.append(vae.decoder(x[:, :, i:i + 1], feat_cache=feat, feat_idx=[0], first_chunk=first))
            first = False
        if len(decoders) > 1:
            for j, entry in enumerate(feat):
                parts = entry.split(rows) if isinstance(entry, torch.Tensor) else [entry] * len(decoders)
                for decoder, part in zip(decoders, parts):
                    decoder.feat_cache[j] = part
        for decoder in decoders:
            decoder.first = False
        return video_to_frames(torch.cat(outs, dim=2).clamp(-1.0, 1.0))

    @staticmethod
    def decode_together(decoders: list[StreamingVideoDecoder], chunks: list[torch.Tensor]) -> list[np.ndarray]:
        """Each decoder's next chunk, decoded as one batch (`decode_frames_together`), as numpy frames per decoder."""
        frames = StreamingVideoDecoder.decode_frames_together(decoders, chunks).numpy()
        return list(np.split(frames, np.cumsum([c.shape[0] for c in chunks])[:-1]))


class PreviewStreamDecoder:
    """Decodes a causal stream's latents chunk by chunk with the tiny preview decoder (RuntimeArgs.preview_decoder,
    composer/models/taehv.py), carrying its memory (each memory block's last input) between chunks, so the
    concatenated frames equal its whole-video decode. Frame counts are the VAE's: the first latent frame gives 1
    frame, every later one 4 (the decoder drops its first 3 outputs)."""

    def __init__(self, model: torch.nn.Module, batcher: CallBatcher | None = None):
        from composer.models.taehv import PreviewDecoderState

        self.model = model
        self.batcher = batcher
        self.state = PreviewDecoderState()

    def fork(self) -> PreviewStreamDecoder:
        twin = copy.copy(self)
        twin.state = self.state.fork()
        return twin

    def batch_key(self, latents: torch.Tensor) -> tuple:
        """Decoders whose next chunks share this key decode as one batch: the same chunk shape and the same point of
        their streams (memory present or not, leading frames still to drop or not)."""
        trim = self.model.config.frames_to_trim
        return ("preview", tuple(latents.shape[1:]), latents.dtype, min(self.state.frames_made, trim + 1),
                tuple(sorted(self.state.memory)))

    def decode(self, latents: torch.Tensor, plan_key=None) -> np.ndarray:
        """Latents [B, C, f, h, w] (the next f latent frames) -> uint8 frames [B, t, H, W, 3]."""
        if self.batcher is None:
            return self.decode_together([self], [latents])[0]
        return self.batcher.submit(self.batch_key(latents), ("preview", self, latents), rows=latents.shape[0],
                                   plan_key=plan_key)

    @staticmethod
    @torch.inference_mode()
    def decode_together(decoders: list[PreviewStreamDecoder], chunks: list[torch.Tensor]) -> list[np.ndarray]:
        """Each decoder's next chunk as one batch (equal `batch_key`s: their memories stacked row-wise and handed
        back split); the latents as the DiT makes them (the preview decoder takes the normalized latents, no
        `denormalize_latents`: composer/models/taehv.py); numpy uint8 frames per decoder."""
        from composer.models.taehv import PreviewDecoderState

        rows = [c.shape[0] for c in chunks]
        state = decoders[0].state if len(decoders) == 1 else PreviewDecoderState.stack([d.state for d in decoders])
        video, state = decoders[0].model.decode(torch.cat(chunks), state)
        for decoder, part in zip(decoders, [state] if len(decoders) == 1 else state.split(rows)):
            decoder.state = part
        frames = video_to_frames(video * 2.0 - 1.0).numpy()  # [0, 1] -> the VAE's [-1, 1]
        return list(np.split(frames, np.cumsum(rows)[:-1]))
